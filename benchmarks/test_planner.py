"""The planner-executor's training and planning speed-ups, each measured side by side in one run against
its baseline on the same input (``baseline s`` / ``concept s`` columns: the baseline, then the speed-up):

* a training step: online Gumbel-ST (the baseline) vs Hard-EM with the example's plan not cached (the
  E-step runs: beam search + batched scoring) and cached (teacher-forced planner and executor only);
* greedy planning: the plain planner (the baseline) vs MTP concepts (k = 2, 4 steps per forward) and
  parallel types (every type at once). The "ideal" is the ratio of sequential planner forwards;
* the E-step's beam search (width 4): the plain planner's vs the MTP planner's (k = 2, 4), same ideal.

    .venv/bin/python -m pytest benchmarks/test_planner.py [--smollm2]
"""
from __future__ import annotations

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.planner.hard_em import HardEMObjective
from concept.lora import LoraSettings, add_lora

from .conftest import side_by_side

TINY_TYPES = [{"name": "topic", "size": 64, "max_len": 4}, {"name": "gist", "size": 256, "max_len": 12}]
SMOL_TYPES = [{"name": "topic", "size": 256, "max_len": 4}, {"name": "gist", "size": 1024, "max_len": 12}]


def _model(backbone: str, **planner):
    if backbone == "smollm2":
        cfg = BuildConfig(family="planner-executor", position_scheme=ComponentRef("per-type"),
                          sections={"planner": {"types": SMOL_TYPES, **planner}})
    else:
        cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2,
                                                              "intermediate": 512, "vocab": 1024}),
                          family="planner-executor", position_scheme=ComponentRef("per-type"),
                          sections={"planner": {"types": TINY_TYPES, **planner}})
    torch.manual_seed(0)
    return concept.build(cfg)


def _planners(backbone, device, B, T, **planner):
    """The plain planner and one with ``planner`` options (eval mode), both confident enough to write full
    plans (every type to ``max_len``: the worst case for sequential planning), and B rows of T tokens."""
    plain, fast = _model(backbone).to(device).eval(), _model(backbone, **planner).to(device).eval()
    with torch.no_grad():
        for m in (plain, fast):
            m.eos_bias.value.fill_(-20.0)
    ids = torch.randint(0, plain.backbone.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    return plain, fast, ids, torch.ones_like(ids, dtype=torch.bool)


def _side_by_side(benchmark, device, baseline, case):
    """Time ``case`` against ``baseline`` in alternating rounds; None (after one call of each) when timing is off."""
    if benchmark.disabled:
        baseline(), case()
        return None
    timing = side_by_side(baseline, case, rounds=3, device=device)
    benchmark.pedantic(case, rounds=1, iterations=1)
    return timing


def _skip(request, backbone):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")


CASES = [("tiny-llama", 4, 64), ("smollm2", 4, 64)]


@pytest.mark.parametrize("plans", ["full", "empty"])
@pytest.mark.parametrize("cached", [False, True], ids=["estep", "cached"])
@pytest.mark.parametrize("backbone,B,T", CASES, ids=[f"{b}-B{n}-T{t}" for b, n, t in CASES])
def test_hard_em_step_vs_gumbel(benchmark, record, request, device, backbone, B, T, cached, plans):
    """``plans`` full (every type to max_len: equal plan lengths, the worst case for sequential planning) or empty
    (every type ends at once: Gumbel's planner stops after its <EOS>s; Hard-EM's search runs its fixed
    ``Σ (max_len + 1)`` steps and its plans are that wide, the worst case for its fixed shapes)."""
    _skip(request, backbone)
    if plans == "empty" and benchmark.disabled:
        pytest.skip("the smoke run (--benchmark-disable) runs the full plans' code path only")
    model = _model(backbone)
    add_lora(model.backbone, LoraSettings())
    model.to(device).train()
    with torch.no_grad():
        model.eos_bias.value.fill_(-20.0 if plans == "full" else 20.0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    hard_em = HardEMObjective(1.0, beam=4, every=1 if not cached else 10 ** 9)

    def gumbel():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    calls = iter(range(1, 10 ** 9))

    def hard():
        b = hard_em.prepare(model, batch, step=next(calls))  # every=1: the E-step runs at every call
        out = model(ids, labels=ids, plan=b["plan"])
        (out.loss + hard_em(model, b, out)).backward()
        model.zero_grad(set_to_none=True)

    hard_em.prepare(model, batch, step=0)  # (cached: the plan is in the cache from here on)
    if benchmark.disabled:
        gumbel(), hard()
        return
    timing = side_by_side(gumbel, hard, rounds=3, device=device)
    benchmark.pedantic(hard, rounds=1, iterations=1)
    plan_len = float(len(next(iter(hard_em.cache.values())).rows))
    searched = hard_em._stats["rows"]  # the last call's E-step: every row (uncached) or none (cached)
    assert searched == (0 if cached else B)
    ideal = float("nan")  # (no FLOP ideal: the steps differ in kind, not only in size)
    record(benchmark, f"train step hard-em ({'cached' if cached else 'E-step'}, {plans} plans) vs gumbel {backbone} "
                      f"B={B} T={T}",
           {"dense_s": timing["dense_s"], "concept_s": timing["concept_s"], "speedup": timing["speedup"]}, ideal,
           tokens=B * T, plan_len=plan_len, gumbel_tokens_per_s=B * T / timing["dense_s"],
           hard_em_tokens_per_s=B * T / timing["concept_s"])


SPEEDUPS = [("mtp", {"mtp": 2}), ("mtp", {"mtp": 4}), ("parallel", {"parallel": True})]


@pytest.mark.parametrize("name,planner", SPEEDUPS, ids=["mtp2", "mtp4", "parallel"])
@pytest.mark.parametrize("backbone,B,T", CASES, ids=[f"{b}-B{n}-T{t}" for b, n, t in CASES])
def test_planning_speedup(benchmark, record, request, device, backbone, B, T, name, planner):
    _skip(request, backbone)
    plain, fast, ids, valid = _planners(backbone, device, B, T, **planner)

    def plan(m):
        with torch.no_grad():
            return m.planner(ids, valid, sample=False)

    timing = _side_by_side(benchmark, device, lambda: plan(plain), lambda: plan(fast))
    if timing is None:
        return
    types = SMOL_TYPES if backbone == "smollm2" else TINY_TYPES
    steps = sum(t["max_len"] + 1 for t in types)
    fast_steps = (max(t["max_len"] + 1 for t in types) if name == "parallel" else -(-steps // planner["mtp"]))
    label = "parallel types" if name == "parallel" else f"MTP k={planner['mtp']}"
    record(benchmark, f"planning {label} vs plain {backbone} B={B} T={T}", timing, steps / fast_steps,
           planner_forwards=fast_steps, plain_forwards=steps)


@pytest.mark.parametrize("k", [2, 4], ids=["mtp2", "mtp4"])
@pytest.mark.parametrize("backbone,B,T", CASES, ids=[f"{b}-B{n}-T{t}" for b, n, t in CASES])
def test_beam_search_speedup(benchmark, record, request, device, backbone, B, T, k):
    from concept.planner.search import beam_search

    _skip(request, backbone)
    plain, fast, ids, valid = _planners(backbone, device, B, T, mtp=k)
    timing = _side_by_side(benchmark, device, lambda: beam_search(plain, ids, valid, 4), lambda: beam_search(fast, ids, valid, 4))
    if timing is None:
        return
    types = SMOL_TYPES if backbone == "smollm2" else TINY_TYPES
    steps = sum(t["max_len"] + 1 for t in types)
    record(benchmark, f"beam search (4) MTP k={k} vs plain {backbone} B={B} T={T}", timing, steps / -(-steps // k),
           planner_forwards=-(-steps // k), plain_forwards=steps)
