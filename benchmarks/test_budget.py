"""The default static budget (``max_ratio`` ``auto``: ``ceil(1.25 r n) + 6`` boundaries for a policy with a
per-document tracker) against the rule before it (``ceil(2 r n) + 4``) and the dense backbone, side by side in one
run, next to each one's static FLOP ideal (``concept.streaming.family.static_widths_flops``).

    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_budget.py --smollm2 -s      # the real backbone
    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_budget.py --smollm2 --device cuda --dtype bf16 -s

The default build (SmolLM2-135M, split 4,18,8, `auto` attention: `chunked` on a CPU, `flex` on CUDA), its decisions
forced evenly at 0.125 concepts per token (within both budgets, so both compute the same outputs): a no-grad forward
of one row, and a training step (forward + backward, LoRA on every projection) of the demo recipe's rows of 128
tokens. The two budgets are the same model with ``concept.streaming.budget.TRACKED`` set before each call (the
budget is resolved at every forward). Without ``--smollm2`` (and in the default suite, ``--benchmark-disable``) the
tiny random backbone.
"""
from __future__ import annotations

import pytest
import torch

from concept.dense import DenseModel
from concept.flops import evenly_spaced_keep
from concept.lora import LoraSettings, add_lora
from concept.streaming import budget
from concept.streaming.family import static_widths_flops
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

from .conftest import autocast, dtype_name, side_by_side_named
from .test_forward import _model

BEFORE = (2.0, 4)  # auto's (headroom, slack) for a tracked policy until 2026-11-28
CASES = [("forward", 1, 1024), ("forward", 1, 8192), ("train", 4, 128), ("train", 128, 128)]


def ideal(model, T: int, rule: tuple[float, int]) -> tuple[float, int]:
    """The static FLOP ideal and the concept slots of ``model`` over T tokens with ``auto`` at ``rule``."""
    kept = budget.TRACKED
    budget.TRACKED = rule
    try:
        report, slots, _ = static_widths_flops(model, evenly_spaced_keep(T, DEFAULT_TARGET_RATIO))
    finally:
        budget.TRACKED = kept
    return report.speedup, slots


@pytest.mark.parametrize("kind,B,T", CASES, ids=[f"{k}-B{b}-T{t}" for k, b, t in CASES])
def test_budget_vs_before_vs_dense(benchmark, record, request, device, dtype, kind, B, T):
    real = request.config.getoption("--smollm2")
    if (T == 8192 or B == 128) and device.type != "cuda":
        pytest.skip("a GPU case (--device cuda)")
    if benchmark.disabled:  # the smoke run: the same code on the tiny backbone and a short row
        real, B, T = False, min(B, 2), 64
    model = _model("default" if real else "tiny-llama", "auto")
    assert budget.tracks_documents(model.length_policy) and budget.rule(model.length_policy) != BEFORE
    precision = dtype if device.type == "cuda" else torch.float32
    if kind == "train":
        add_lora(model.backbone, LoraSettings())
    model.to(device).train(kind == "train")
    dense = DenseModel(model.backbone).train(kind == "train")
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (B, T), device=device)
    keep = evenly_spaced_keep(T, DEFAULT_TARGET_RATIO)[None].expand(B, T).to(device)
    today = budget.TRACKED

    def run(m, rule=None, **kw):
        budget.TRACKED = today if rule is None else rule
        with autocast(device, precision):
            if kind == "forward":
                with torch.no_grad():
                    return m(ids, **kw).logits
            loss = m(ids, labels=ids, **kw).loss
        loss.backward()
        m.zero_grad(set_to_none=True)

    fns = {"dense": lambda: run(dense), "concept": lambda: run(model, keep=keep),
           "before": lambda: run(model, BEFORE, keep=keep)}
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
           dense_tokens_per_s=B * T / timing["dense_s"], suite="budget", dtype=dtype_name(precision))
