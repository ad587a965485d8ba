"""``benchmarks.compiled_bytes``: inductor's count of a compiled graph's kernels, their bytes and matmul FLOPs, the
CPU proxy of what a compiled step asks of the device (docs/benchmarks.md, "What the compiled step asks of the
device")."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from benchmarks.compiled_bytes import DEVICES, KernelLog, census, summary

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


def test_a_generated_kernel_is_named_by_the_ops_fused_into_it(kernels):
    (glue,) = [k for k in kernels if k["kind"] == "generated"]
    assert glue["ops"] == "add,mul,relu"
    assert census(kernels + [glue], top=1) == [("add,mul,relu", 2, 2 * glue["bytes"])]
