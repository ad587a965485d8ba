"""The objectives' terms without a host sync (issue 39, item 4): each masked term equals the boolean-indexed one it
replaced (kept here as the slow reference: ``if not bool(mask.any())``, ``x[mask]``), values and gradients, with
an empty, a full and a partial mask; an empty mask gives exactly what the skipped branch gave (the term 0, no
gradient). Negative controls: a term that ignores its mask differs, and the indexed references are counted
by ``HostSyncs``. The training steps of every recipe: ``tests/test_recipe_syncs.py``."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import concept
from concept.objectives import next_token_pairs, usage_kl, zero
from concept.streaming.objectives import PlacementObjective, UsageObjective, depth_gain, top_fraction
from concept.syncs import HostSyncs
from concept.teacher import teacher_forward
from tests.conftest import randomize_new_modules, tiny_config
from tests.test_objectives import batch, with_lora

pytestmark = pytest.mark.usefixtures("one_thread")


def masks(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"empty": torch.zeros(shape, dtype=torch.bool), "full": torch.ones(shape, dtype=torch.bool),
            "partial": torch.rand(shape, generator=g) < 0.3}


def value_and_grad(fn, x):
    x = x.detach().clone().requires_grad_(True)
    value = fn(x)
    grad = torch.autograd.grad(value, x, allow_unused=True)[0] if value.requires_grad else None
    return value.detach(), torch.zeros_like(x) if grad is None else grad


def assert_same(new, old, atol=1e-6):
    (v1, g1), (v0, g0) = new, old
    torch.testing.assert_close(v1, v0, atol=atol, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=atol, rtol=1e-5)


# -- usage_kl (streaming --usage-weight; the planner's per-type usage) -------------------------------------------
def indexed_usage(logits, keep, weight=0.5):
    """``UsageObjective`` and ``usage_kl`` as they were: skipped without a concept, the kept rows indexed."""
    if not bool(keep.any()):
        return zero(logits)
    p_bar = torch.softmax(logits[keep].float(), dim=-1).mean(0)
    return weight * (p_bar * torch.log(p_bar.clamp_min(1e-12) * p_bar.shape[-1])).sum()


def test_the_masked_usage_term_equals_the_indexed_one():
    logits = torch.randn(2, 9, 6, generator=torch.Generator().manual_seed(1)) * 2
    for name, keep in masks((2, 9)).items():
        new = value_and_grad(lambda x: 0.5 * usage_kl(x, keep), logits)
        assert_same(new, value_and_grad(lambda x: indexed_usage(x, keep), logits))
        if name == "empty":  # exactly the skipped branch: 0, no gradient
            assert float(new[0]) == 0.0 and not new[1].any()
    # through the objective (the streaming family's), and the negative control: the same comparison fails for a
    # term that ignores its mask
    keep = masks((2, 9))["partial"]
    model = type("M", (), {"vocabulary": type("V", (), {"size": 6})()})()
    objective = UsageObjective(0.5)
    out = lambda x: type("O", (), {"head_logits": x, "keep": keep})()  # noqa: E731
    assert_same(value_and_grad(lambda x: objective(model, {"input_ids": keep.long()}, out(x)), logits),
                value_and_grad(lambda x: indexed_usage(x, keep), logits))
    every = value_and_grad(lambda x: 0.5 * usage_kl(x, torch.ones_like(keep)), logits)
    with pytest.raises(AssertionError):
        assert_same(every, value_and_grad(lambda x: indexed_usage(x, keep), logits))


def test_the_indexed_usage_term_syncs_and_the_masked_one_does_not():
    logits, keep = torch.randn(2, 9, 6), masks((2, 9))["partial"]
    with HostSyncs() as new:
        usage_kl(logits, keep)
    with HostSyncs() as old:
        indexed_usage(logits, keep)
    assert new.hidden == 0 and dict(old.syncs) == {"_local_scalar_dense": 1, "index": 1}


# -- the placement term (--placement) ------------------------------------------------------------------------------
def indexed_placement(objective, model, batch, out, teacher):
    """``PlacementObjective.__call__`` as it was: skipped without a pair, the BCE of the indexed pairs."""
    valid, doc = batch["attention_mask"].bool(), batch.get("document_ids")
    pair = next_token_pairs(valid, doc)
    ratio = float(objective.target())
    if ratio >= 1.0 or not bool(pair.any()):
        return zero(batch["input_ids"])
    with torch.no_grad():
        skip = model.skip_middle(batch["input_ids"], batch.get("attention_mask"), doc)
        gain = depth_gain(teacher.logits[:, :-1], skip[:, :-1])
        label = top_fraction(gain, pair, ratio)
    h = out.shallow.detach()
    logit = model.length_policy.keep_logit(model.vocabulary.logits(h), h)[:, :-1]
    return objective.weight * F.binary_cross_entropy_with_logits(logit[pair].float(), label[pair].float())


def placement_batches():
    b = batch(B=3, T=12, pad=3, docs=True, seed=2)
    alone = dict(b, document_ids=torch.arange(12).expand(3, 12).clone())  # every token its own document: no pair
    full = dict(b, attention_mask=torch.ones_like(b["attention_mask"]), document_ids=torch.zeros_like(b["input_ids"]))
    return {"partial": b, "empty": alone, "full": full}


@pytest.mark.parametrize("case", ["partial", "empty", "full"])
def test_the_masked_placement_term_equals_the_indexed_one(case, monkeypatch):
    model = with_lora(randomize_new_modules(concept.build(tiny_config()), 0))
    b = placement_batches()[case]
    teacher = teacher_forward(model, b["input_ids"], b["attention_mask"], b["document_ids"], frozenset({"logits"}))
    out = model(b["input_ids"], b["attention_mask"], document_ids=b["document_ids"])
    objective = PlacementObjective(2.0, lambda: 0.25)
    head = [p for p in model.vocabulary.parameters() if p.requires_grad]

    def term_and_grads(fn):
        value = fn(objective, model, b, out, teacher)
        grads = torch.autograd.grad(value, head, allow_unused=True, retain_graph=True) if value.requires_grad else \
            [None] * len(head)
        return value.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(head, grads)]

    (v1, g1), (v0, g0) = term_and_grads(PlacementObjective.__call__), term_and_grads(indexed_placement)
    torch.testing.assert_close(v1, v0)
    for a, c in zip(g1, g0):
        torch.testing.assert_close(a, c)
    assert (float(v1) == 0.0 and not any(g.any() for g in g1)) if case == "empty" else float(v1) > 0
    if case == "partial":  # negative control: the pairs' mask ignored (every position's BCE) is another term
        pair = next_token_pairs(b["attention_mask"].bool(), b["document_ids"])
        monkeypatch.setattr("concept.streaming.objectives.pair_mean", lambda values, mask: values.mean())
        with pytest.raises(AssertionError):
            torch.testing.assert_close(objective(model, b, out, teacher), v0)
        assert not bool(pair.all())


# -- the planner-executor's terms (commitment, <EOS>, usage, MTP concepts) -----------------------------------------
def planner_out(mtp=1):
    from tests.test_planner_executor import built

    model = built(**({"mtp": mtp} if mtp > 1 else {}))
    model.train()
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    return model, ids, model(ids, labels=ids)


def indexed_planner_terms(model, ids, out):
    """The commitment, <EOS>, usage and MTP-concept terms as they were (weight 1)."""
    from concept.planner.objectives import eos_probs

    plan, found = out.plan, {}
    mask = plan.concepts
    soft, hard = plan.soft[mask].float(), plan.hard[mask].float().detach()
    found["commitment"] = zero(plan.classes) if not bool(mask.any()) else \
        (soft - hard).pow(2).sum(-1).mean() / hard.pow(2).sum(-1).mean().clamp_min(1e-12)
    forced = plan.forced
    found["eos"] = zero(plan.classes) if not bool(forced.any()) else \
        -torch.log(eos_probs(model, plan)[forced].clamp_min(1e-12)).mean()
    total = zero(plan.classes)
    for i, size in enumerate(model.sizes.tolist()):
        m = plan.concepts & (plan.types == i)
        total = total + (usage_kl(plan.logits[..., :size], m) if bool(m.any()) else math.log(size))
    found["plan_usage"] = total / len(model.sizes)
    return found


def planner_terms(model, ids, out):
    from concept.planner.objectives import CommitmentObjective, EOSObjective, PlanUsageObjective

    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {"commitment": CommitmentObjective(1.0)(model, b, out), "eos": EOSObjective(1.0)(model, b, out),
            "plan_usage": PlanUsageObjective(1.0)(model, b, out)}


def test_the_planners_masked_terms_equal_the_indexed_ones():
    model, ids, out = planner_out()
    params = [p for p in model.vocabularies.parameters() if p.requires_grad]
    no_concept = dataclasses.replace(out, plan=dataclasses.replace(out.plan, is_eos=out.plan.is_eos | out.plan.active,
                                                                   forced=torch.zeros_like(out.plan.active)))
    for case, o in (("sampled", out), ("no concept, nothing forced", no_concept)):
        new, old = planner_terms(model, ids, o), indexed_planner_terms(model, ids, o)
        for name in new:
            torch.testing.assert_close(new[name], old[name], msg=f"{case}: {name}")
            grads = [torch.autograd.grad(t, params, allow_unused=True, retain_graph=True) if t.requires_grad
                     else [None] * len(params) for t in (new[name], old[name])]
            for p, a, c in zip(params, *grads):
                torch.testing.assert_close(torch.zeros_like(p) if a is None else a,
                                           torch.zeros_like(p) if c is None else c, msg=f"{case}: {name}'s gradient")
    assert bool(out.plan.concepts.any())
    with HostSyncs() as seen:
        planner_terms(model, ids, out)
    assert seen.hidden == 0, dict(seen.syncs)


def indexed_plan_mtp(model, batch, out):
    """``PlanMTPObjective.__call__`` as it was (weight 1)."""
    plan = out.plan
    if plan.head is not None and bool((plan.head > 0).any()):
        with torch.no_grad():
            u, u_valid, _, _ = model.split_example(batch["input_ids"], batch.get("attention_mask"))
            plan = model.planner_forced(u, u_valid, plan)
    hidden, total, heads = plan.hidden.detach(), zero(out.plan.classes), model.settings.mtp
    for j in range(1, min(heads, plan.classes.shape[1])):
        mask = plan.active[:, j:] & ~plan.forced[:, j:]
        if not bool(mask.any()):
            continue
        state = model.mtp_heads.state(hidden[:, :-j][mask], j - 1)
        logits = model.plan_logits(state, plan.types[:, j:][mask], plan.before(model.num_types)[:, j:][mask])
        total = total + F.cross_entropy(logits.float(), plan.classes[:, j:][mask])
    return total / max(1, heads - 1)


def test_the_masked_mtp_concept_term_equals_the_indexed_one():
    from concept.planner.objectives import PlanMTPObjective

    model, ids, out = planner_out(mtp=2)
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    params = list(model.mtp_heads.parameters())
    idle = dataclasses.replace(out, plan=dataclasses.replace(out.plan, active=torch.zeros_like(out.plan.active)))
    for case, o in (("sampled", out), ("no step", idle)):
        new, old = PlanMTPObjective(1.0)(model, b, o), indexed_plan_mtp(model, b, o)
        torch.testing.assert_close(new, old, msg=case)
        g_new = torch.autograd.grad(new, params, allow_unused=True, retain_graph=True) if new.requires_grad else \
            [None] * len(params)
        g_old = torch.autograd.grad(old, params, allow_unused=True, retain_graph=True) if old.requires_grad else \
            [None] * len(params)
        for p, a, c in zip(params, g_new, g_old):
            torch.testing.assert_close(torch.zeros_like(p) if a is None else a, torch.zeros_like(p) if c is None else c)
    assert float(PlanMTPObjective(1.0)(model, b, out).detach()) > 0
    with HostSyncs() as seen:
        PlanMTPObjective(1.0)(model, b, out)
    assert dict(seen.declared) == {} and seen.hidden == 0, dict(seen.syncs)
