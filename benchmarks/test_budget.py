"""The default static budget (``max_ratio`` ``auto``: ``ceil(1.25 r n) + 6`` boundaries for a policy with a
per-document tracker) against the rule before it (``ceil(2 r n) + 4``) and the dense backbone, side by side in one
run, next to each one's static FLOP ideal (``concept.streaming.family.static_widths_flops``).

    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_budget.py --smollm2 -s      # the real backbone
    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_budget.py --smollm2 --device cuda --dtype bf16 -s

The decisions are forced within both budgets, so both sides compute the same outputs; the two budgets are the same
model with ``concept.streaming.budget.TRACKED`` set before each call (the budget is resolved at every forward). The
cases, the build and the calls: ``benchmarks/two_settings.py``.
"""
from __future__ import annotations

import pytest

from concept.flops import evenly_spaced_keep
from concept.streaming import budget
from concept.streaming.family import static_widths_flops
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

from .conftest import dtype_name, side_by_side_named
from .two_settings import CASES, IDS, case

BEFORE = (2.0, 4)  # auto's (headroom, slack) for a tracked policy until 2026-11-28


def ideal(model, T: int, rule: tuple[float, int]) -> tuple[float, int]:
    """The static FLOP ideal and the concept slots of ``model`` over T tokens with ``auto`` at ``rule``."""
    kept = budget.TRACKED
    budget.TRACKED = rule
    try:
        report, slots, _ = static_widths_flops(model, evenly_spaced_keep(T, DEFAULT_TARGET_RATIO))
    finally:
        budget.TRACKED = kept
    return report.speedup, slots


@pytest.mark.parametrize("kind,B,T", CASES, ids=IDS)
def test_budget_vs_before_vs_dense(benchmark, record, request, device, dtype, kind, B, T):
    c = case(request, benchmark, device, dtype, kind, B, T)
    model, B, T = c.model, c.B, c.T
    assert budget.tracks_documents(model.length_policy) and budget.rule(model.length_policy) != BEFORE
    today = budget.TRACKED

    def run(rule):
        budget.TRACKED = rule
        return c.run(model, keep=c.keep)

    fns = {"dense": lambda: c.run(c.dense), "concept": lambda: run(today), "before": lambda: run(BEFORE)}
    try:
        if benchmark.disabled:
            for fn in fns.values():
                fn()
            return
        timing = side_by_side_named(fns, rounds=7 if device.type == "cpu" else None, device=device)
        benchmark.pedantic(fns["concept"], rounds=1, iterations=1)
    finally:
        budget.TRACKED = today
    timing["before_speedup"] = timing["dense_s"] / timing["before_s"]
    timing["over_before"] = timing["before_s"] / timing["concept_s"]
    (speedup, slots), (before_speedup, before_slots) = ideal(model, T, today), ideal(model, T, BEFORE)
    record(benchmark, f"budget {kind} B={B} T={T} r={DEFAULT_TARGET_RATIO}", timing, speedup,
           before_ideal_speedup=before_speedup, concept_slots=slots, before_concept_slots=before_slots, T=T, B=B,
           tokens_per_s=B * T / timing["concept_s"], before_tokens_per_s=B * T / timing["before_s"],
           dense_tokens_per_s=B * T / timing["dense_s"], suite="budget", dtype=dtype_name(c.precision))
