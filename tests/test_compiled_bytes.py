"""``benchmarks.compiled_bytes``: inductor's count of a compiled graph's kernels, their bytes and matmul FLOPs, the
CPU proxy of what a compiled step asks of the device (docs/benchmarks.md, "What the compiled step asks of the
device")."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config

import concept.compiled

from benchmarks.compiled_bytes import DEVICES, FLOORS, SHAPES, KernelLog, census, measure, summary, table

M, N, K = 64, 48, 32
FP32 = 4


def fused(x, w):
    return (torch.mm(x, w.t()) * 2 + 1).relu()


def split(x, w):  # the same ops, a graph break between them: two kernels for the elementwise part
    y = torch.mm(x, w.t()) * 2
    torch._dynamo.graph_break()
    return (y + 1).relu()


def counted(fn) -> list[dict]:
    torch._dynamo.reset()
    x, w = torch.randn(M, K), torch.randn(N, K)
    with torch._inductor.config.patch(fx_graph_cache=False), KernelLog() as log:
        torch.compile(fn)(x, w)
    return log.kernels()


@pytest.fixture(scope="module")
def kernels():
    return counted(fused)


def test_a_matmul_counts_its_operands_and_2mnk_flops(kernels):
    (mm,) = [k for k in kernels if k["kind"] == "matmul"]
    assert mm["flops"] == 2 * M * N * K
    assert mm["bytes"] == FP32 * (M * K + N * K + M * N)  # x and w read, the product written


def test_fused_elementwise_ops_are_one_kernel_that_reads_and_writes_once(kernels):
    (glue,) = [k for k in kernels if k["kind"] == "generated"]
    assert glue["bytes"] == FP32 * 2 * M * N


def test_a_graph_break_between_the_same_ops_counts_two_kernels_and_twice_the_bytes():
    glue = [k for k in counted(split) if k["kind"] == "generated"]
    assert len(glue) == 2 and sum(k["bytes"] for k in glue) == FP32 * 4 * M * N


def test_nothing_is_counted_without_the_log():  # negative control: the handler is what makes inductor count
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(fused)(torch.randn(M, K), torch.randn(N, K))
    assert metrics.nodes_num_elem == []


def test_the_roofline_takes_each_kernels_slower_bound(kernels):
    row = summary(kernels, tokens=M)
    peak, bandwidth = DEVICES["h200"]
    mm, glue = sorted(kernels, key=lambda k: k["kind"] != "matmul")
    assert row["kernels"] == 2 and row["matmul_flops"] == 2 * M * N * K
    assert row["bytes"] == mm["bytes"] + glue["bytes"] and row["generated_bytes"] == glue["bytes"]
    expected = max(mm["flops"] / peak, mm["bytes"] / bandwidth) + glue["bytes"] / bandwidth
    assert row["roofline_ms_h200"] == pytest.approx(1e3 * expected)


def test_with_floors_no_kernel_counts_less_than_the_shortest_of_its_kind(kernels):
    """These two kernels move a few kB: each is below its kind's floor, so the floored sum is the two floors; a
    kernel above its floor (its bytes scaled up) counts its own roofline. Negative control: without the floors the
    small step's sum is a thousandth of it."""
    row = summary(kernels, tokens=M)
    assert row["at_floor_h200"] == 2
    assert row["floor_ms_h200"] == pytest.approx(1e3 * (FLOORS["matmul"] + FLOORS["generated"]))
    assert row["roofline_ms_h200"] < row["floor_ms_h200"] / 100
    big = [{**k, "bytes": k["bytes"] * 10**6} for k in kernels]
    big_row = summary(big, tokens=M)
    assert big_row["at_floor_h200"] == 0 and big_row["floor_ms_h200"] == pytest.approx(big_row["roofline_ms_h200"])


def test_a_generated_kernel_is_named_by_the_ops_fused_into_it(kernels):
    (glue,) = [k for k in kernels if k["kind"] == "generated"]
    assert glue["ops"] == "add,mul,relu"
    assert census(kernels + [glue], top=1) == [("add,mul,relu", 2, 2 * glue["bytes"])]


def test_the_table_gives_each_streaming_row_its_roofline_ratio_to_dense():
    rows = [{"model": m, "case": "train", "B": 2, "T": 8, "tokens": 16, "kernels": k, "generated_kernels": k,
             "matmul_kernels": 0, "attention_kernels": 0, "bytes": 1e9, "generated_bytes": 1e9, "matmul_flops": 0,
             "roofline_ms_h200": ms, "floor_ms_h200": floor, "at_floor_h200": n}
            for m, k, ms, floor, n in (("streaming", 10, 2.0, 3.0, 4), ("dense", 12, 3.0, 3.6, 1))]
    lines = table(rows).splitlines()
    assert lines[2].startswith("| train 2 x 8 | streaming | 10 ") and lines[2].endswith("| 1.50x | 3.00 (4) | 1.20x |")
    assert lines[3].endswith("|  | 3.60 (1) |  |")  # (dense: no ratio to itself)


@pytest.mark.slow
def test_the_benchmark_counts_a_whole_compiled_training_step(monkeypatch):
    """``measure`` end to end on the tiny shape, both models: every adapted projection's 8 matmuls a step (3
    forward, 5 backward: the first layer's, whose input needs no gradient, fewer) are among the counted matmuls.
    (At this width the concept head outweighs the layers the streaming model saves, so no ratio is held here; the
    SmolLM2-width rows are in docs/benchmarks.md.)"""
    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", concept.compiled.LAYER_REGIONS)  # (measure sets it)
    rows = {kind: measure(kind, "train", 2, 32, "tiny") for kind in ("streaming", "dense")}
    layers = SHAPES["tiny"]["layers"]
    for row in rows.values():
        assert row["matmul_kernels"] >= (layers - 1) * 7 * 8 and row["generated_kernels"] > 0
        assert row["roofline_ms_h200"] > 0
    assert rows["streaming"]["matmul_flops"] != rows["dense"]["matmul_flops"]
