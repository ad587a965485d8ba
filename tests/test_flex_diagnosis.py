"""The GPU kit's flex diagnosis (benchmarks/gpu_kit/flex_diagnosis.py) on the CPU (``--dry``: eager, T = 128):
every variant builds, runs and is checked against the dense-mask reference; the report names the fastest exact
FlexAttention variant and the `flex` settings that give it. Negative control: a variant whose mask is wrong is
reported as not exact and is never the one to adopt. (The whole dry run, every variant, runs inside the kit's
dry speed stage: tests/test_gpu_kit.py.)"""
import importlib
import json

import pytest
import torch

from benchmarks.gpu_kit import flex_diagnosis

VARIANTS = ("sdpa-causal", "today", "ranges-static", "floor", "cascade", "gathered-sdpa", "blocks-64")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_dry_diagnosis_checks_every_variant_and_names_the_fastest(tmp_path):
    report = flex_diagnosis.diagnose(True, tmp_path / "flex.json", variants=VARIANTS)
    rows = {r["variant"]: r for r in report["variants"]}
    assert list(rows) == list(VARIANTS) and all("ms" in r and "failed" not in r for r in rows.values())
    assert rows["today"]["exact"] and rows["ranges-static"]["exact"] and rows["cascade"]["exact"]
    assert rows["blocks-64"]["exact"] and rows["gathered-sdpa"]["exact"] and rows["gathered-sdpa"]["gathered_width"] == 1
    assert report["fastest_exact"]["variant"] in rows and rows[report["fastest_exact"]["variant"]]["exact"]
    assert rows["floor"]["exact"] is None and rows["floor"]["error"] > 0.1  # the floor computes masked pairs too
    assert report["closes_the_gap"]["variant"] in ("today", "ranges-static", "blocks-64")
    assert report["adopt"] == flex_diagnosis.FLEX_SETTINGS[report["closes_the_gap"]["variant"]]
    assert report["block_mask"]["partial_per_q_block"] > 0
    # smaller blocks compute fewer masked pairs: at T = 128 one 128-block is the whole causal triangle's square
    small, large = report["block_mask_64"], report["block_mask"]
    assert (small["block"], large["block"]) == (64, 128)
    assert 1 <= small["computed_over_needed"] < large["computed_over_needed"]
    assert json.loads((tmp_path / "flex.json").read_text())["closes_the_gap"] == json.loads(json.dumps(
        report["closes_the_gap"], default=float))
    table = flex_diagnosis.markdown(report)
    assert "| `ranges-static` |" in table and "Fastest exact FlexAttention variant" in table


def test_negative_control_a_wrong_mask_is_reported_and_not_adopted(monkeypatch):
    # the module the diagnosis will import now: a module object bound when this file was collected may no longer
    # be the one in sys.modules (a test that purges concept_plugins.* leaves a fresh copy behind), and patching
    # a stale copy would leave the diagnosis's mask right (docs/gpu.md, "The flex diagnosis's negative control")
    flex = importlib.import_module("concept_plugins.attention.flex")
    real = flex.slot_ranges

    def no_tail(layout):  # a tail token no longer sees its own segment
        concept_lo, concept_hi, tail_lo = real(layout)
        return concept_lo, concept_hi, torch.where(layout.meta.valid, layout.length, tail_lo).int()

    monkeypatch.setattr(flex, "slot_ranges", no_tail)
    report = flex_diagnosis.diagnose(True, None, variants=("sdpa-causal", "today", "ranges-static"))
    rows = {r["variant"]: r for r in report["variants"]}
    assert rows["ranges-static"]["exact"] is False and rows["today"]["exact"]
    assert report["closes_the_gap"]["variant"] == "today"


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # compiling: ~15 s
def test_two_masks_of_one_shape_in_one_process_are_each_exact(compiled):
    """The `flex` backend reuses what it can across calls (the compiled FlexAttention, dynamo's graphs around a
    ``mask_mod`` closure of the same code): two different masks of the same shape, one after the other in one
    process, each match the dense-mask reference. Negative control: the first mask's plan on the second's
    inputs does not (the two masks differ where it shows)."""
    from concept.packing import pack
    from concept_plugins.attention.flex import FlexConfig, FlexPattern
    from concept_plugins.attention.sdpa import DenseMaskPattern

    T = 64
    layouts = []
    for concepts in (range(7, T, 8), (0, 1, 2, 3, 30, 31, 50, 63)):  # 8 concepts each: the same shapes
        keep = torch.zeros(1, T, dtype=torch.bool)
        keep[0, list(concepts)] = True
        layouts.append(pack(keep, torch.ones_like(keep)))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, layouts[0].length, 16, generator=g)
    k, v = (torch.randn(1, 2, layouts[0].length, 16, generator=g) for _ in range(2))
    with torch.no_grad():
        plans = [FlexPattern(layout, FlexConfig(compile=compiled)) for layout in layouts]
        outs = [plan(q, k, v, 0.25) for plan in plans]
        refs = [DenseMaskPattern(layout)(q, k, v, 0.25) for layout in layouts]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert (outs[0] - refs[1]).abs().max() > 0.1


@pytest.mark.parametrize("fault", [None, "a block dropped"], ids=["exact", "negative-control"])
def test_gathered_sdpa_equals_the_dense_mask_over_several_blocks(fault):
    """The `gathered-sdpa` variant at 1,024 tokens (8 query blocks; each visits up to 3 KV blocks of 128: the
    concepts' and its own) against the dense one-pass mask, fp32, 9 query heads over 3 KV heads. Negative control:
    a query block's last gathered KV block swapped for another is caught."""
    from concept.flops import evenly_spaced_keep
    from concept.packing import allowed, pack
    from concept_plugins.attention.flex import FlexConfig, FlexPattern
    from concept_plugins.attention.sdpa import DenseMaskPattern

    keep = evenly_spaced_keep(1024, 0.125)[None]
    layout = pack(keep, torch.ones_like(keep))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, layout.length, 64, generator=g)
    k, v = (torch.randn(1, 3, layout.length, 64, generator=g) for _ in range(2))
    block_mask = FlexPattern(layout, FlexConfig(compile=False)).block_mask
    idx, mask = flex_diagnosis.gathered_blocks(block_mask, allowed(layout.meta, layout.meta), 128, 3, q.dtype)
    assert idx.shape == (8, 3)
    if fault:
        idx = idx.clone()
        idx[-1, -1] = (idx[-1, -1] + 1) % 8
    out = flex_diagnosis.gathered_attention(q, k, v, 0.125, idx, mask, 128)
    error = flex_diagnosis.relative_error(out, DenseMaskPattern(layout)(q, k, v, 0.125), layout)
    assert (error < 1e-5) is (fault is None), error


def test_variants_are_ranked_by_their_device_time_in_a_cuda_graph_where_every_one_has_it():
    """Events around one compiled FlexAttention call time its launch from the host too (the H200: 0.367 ms by
    events, about 0.17 ms of device time): where each exact variant has its time in a CUDA graph (``graphed``), the
    fastest is the fastest there, as the compiled forward runs it. Negative control: with one variant's graph time
    missing, the ranking falls back to the event times, and names the other variant."""
    rows = [{"variant": "sdpa-causal", "ms": 0.26, "graph_ms": 0.25, "exact": None, "error": 0.9, "first_call_s": 0.1},
            {"variant": "ranges-static", "ms": 0.37, "graph_ms": 0.12, "exact": True, "error": 1e-3, "first_call_s": 2.6},
            {"variant": "gathered-sdpa", "ms": 0.30, "graph_ms": 0.20, "exact": True, "error": 1e-3, "first_call_s": 0.2}]
    report = {"variants": rows, "T": 8192, "ratio": 0.125, "dtype": "bfloat16", "heads": [9, 3, 64], "timer": "t",
              "ideal_speedup": 7.95, "block_mask": {}}
    found = flex_diagnosis.conclude(report)
    assert found["ranked_by"] == "graph_ms" and found["fastest_exact"]["variant"] == "ranges-static"
    assert found["fastest_exact"]["ms"] == 0.12 and found["closes_the_gap"]["timed_by"] == "graph_ms"
    table = flex_diagnosis.markdown({**report, **found})
    assert "| `ranges-static` | 0.370 | 0.120 |" in table and "(0.120 ms in a CUDA graph" in table
    del rows[1]["graph_ms"]
    rows[1]["graph_failed"] = "RuntimeError: capture"
    found = flex_diagnosis.conclude(report)
    assert found["fastest_exact"]["variant"] == "gathered-sdpa" and found["fastest_exact"]["timed_by"] == "ms"
    assert "| `ranges-static` | 0.370 | failed |" in flex_diagnosis.markdown({**report, **found})
    assert flex_diagnosis.timing_key(rows[::2]) == "graph_ms" and flex_diagnosis.timing_key([]) == "ms"
    sdpa, ranges, gathered = rows
    assert flex_diagnosis.against_dense(gathered, sdpa, 7.95) == {"speedup_vs_dense": 1.25,
                                                                  "fraction_of_ideal": 1.25 / 7.95,
                                                                  "compared_by": "graph_ms"}
    assert flex_diagnosis.against_dense(ranges, sdpa, 7.95)["compared_by"] == "ms"  # (no graph time: events)


def test_the_cuda_graph_timer_captures_calls_and_divides_each_replay_by_them(monkeypatch):
    """``graphed`` on stand-ins for torch.cuda (this CPU has no CUDA graphs): two warm-up calls on a side stream,
    ``calls`` captured once, ``reps`` replays each timed by events and divided by ``calls``; a capture that raises
    (a host sync inside it, on a GPU) gives ``graph_failed`` and no time."""
    import contextlib
    from types import SimpleNamespace

    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            log.append("record")

        def elapsed_time(self, end):
            return 2.0  # ms, a replay

    class Graph:
        def replay(self):
            log.append("replay")

    capturing = []

    @contextlib.contextmanager
    def graph(g):
        capturing.append(True)
        yield
        capturing.pop()

    stream = SimpleNamespace(wait_stream=lambda other: None)
    fake = SimpleNamespace(Stream=lambda device: stream, current_stream=lambda device: stream,
                           stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph, graph=graph, Event=Event,
                           synchronize=lambda device: None)
    monkeypatch.setattr(torch, "cuda", fake)
    calls = []
    out = flex_diagnosis.graphed(lambda: calls.append(bool(capturing)), "cuda", reps=5, calls=4)
    assert calls == [False, False, True, True, True, True] and log.count("replay") == 5
    assert out == {"graph_ms": 0.5, "graph_spread_ms": [0.5, 0.5], "graph_calls": 4}

    def syncs():
        if capturing:
            raise RuntimeError("operation not permitted when stream is capturing")

    failed = flex_diagnosis.graphed(syncs, "cuda", reps=5, calls=4)
    assert set(failed) == {"graph_failed"} and "capturing" in failed["graph_failed"]
