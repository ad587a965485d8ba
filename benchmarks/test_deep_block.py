"""The deep stack over its block (``packing.DeepBlock``: concepts and tail in T slots) against the same model over the
layout's ``[concepts ; tail]`` (C + T slots; ``model.deep_block = False``) and the dense backbone, side by side in
one run, next to each one's static FLOP ideal (``flops.forward_flops(static_slots=..., deep_block=...)``).

    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_deep_block.py --smollm2 -s      # the real backbone
    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_deep_block.py --smollm2 --device cuda --dtype bf16 -s

The cases, the build and the calls: ``benchmarks/two_settings.py``.
"""
from __future__ import annotations

import pytest

from concept.flops import evenly_spaced_keep
from concept.streaming.family import static_widths_flops
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

from .conftest import dtype_name, side_by_side_named
from .two_settings import CASES, IDS, case


def ideals(model, T: int) -> dict:
    """The static FLOP ideal over the block and over the layout."""
    keep = evenly_spaced_keep(T, DEFAULT_TARGET_RATIO)
    return {f"{name}_ideal_speedup": static_widths_flops(model, keep, block)[0].speedup
            for name, block in (("block", True), ("layout", False))}


@pytest.mark.parametrize("kind,B,T", CASES, ids=IDS)
def test_deep_block_vs_layout_vs_dense(benchmark, record, request, device, dtype, kind, B, T):
    c = case(request, benchmark, device, dtype, kind, B, T)
    model, B, T = c.model, c.B, c.T
    assert model.plans_deep_block()

    def run(block: bool):
        model.deep_block = block
        return c.run(model, keep=c.keep)

    fns = {"dense": lambda: c.run(c.dense), "concept": lambda: run(True), "layout": lambda: run(False)}
    if benchmark.disabled:
        for fn in fns.values():
            fn()
        return
    timing = side_by_side_named(fns, rounds=5 if device.type == "cpu" else None, device=device)
    timing["layout_speedup"] = timing["dense_s"] / timing["layout_s"]
    timing["block_over_layout"] = timing["layout_s"] / timing["concept_s"]
    benchmark.pedantic(fns["concept"], rounds=1, iterations=1)
    flops = ideals(model, T)
    record(benchmark, f"deep block {kind} B={B} T={T} r={DEFAULT_TARGET_RATIO}", timing,
           flops["block_ideal_speedup"], layout_ideal_speedup=flops["layout_ideal_speedup"], T=T, B=B,
           tokens_per_s=B * T / timing["concept_s"], layout_tokens_per_s=B * T / timing["layout_s"],
           dense_tokens_per_s=B * T / timing["dense_s"], suite="deep-block", dtype=dtype_name(c.precision))
