"""The code-only controls (docs/diagnostics.md): ``delta_nll_codes_shuffled`` / ``delta_nll_codes_zero`` change
only the concepts' discrete embeddings, each slot keeping its continuous part; ``gate_norm`` is the identity
start's gate RMS; the planner-executor's per-type plan shuffle. Every value is checked against a second,
independent way of computing it (forced ids, a zeroed gate, the NLL by hand)."""
import copy

import pytest
import torch

import concept
from concept.diagnostics import evaluate, pair_nll
from concept.streaming.diagnostics import _code_control

from .conftest import mix_decisions, randomize_new_modules, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(seed=0, B=3, T=20):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def model_with(concept_input="identity", **extra):
    m = mix_decisions(randomize_new_modules(concept.build(tiny_config(concept_input=concept_input, **extra))))
    return m.eval()


@pytest.fixture(scope="module")
def identity():
    return model_with()


def forced_ids_for_the_shuffle(model, b, seed):
    """The ids the codes_shuffled control gives each concept slot, drawn as the control draws them
    (``torch.randperm`` of the batch's valid slots, in slot order, from a generator seeded ``seed``), written
    as a ``concept_ids`` override at each slot's id source: the forward then reads each slot's own state and
    another slot's id."""
    with torch.no_grad():
        out = model(b["input_ids"], attention_mask=b["attention_mask"])
    layout = out.layout
    valid = layout.concept_meta.valid
    src = layout.concept_id_src[valid]  # [n] time index of each valid slot (in slot order: row by row)
    rows = valid.nonzero()[:, 0]
    ids = out.concept_ids[rows, src]
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    forced = torch.full_like(b["input_ids"], -1)
    forced[rows, src] = ids[perm]
    return out, forced


def test_codes_shuffled_is_each_slot_with_another_slots_id(identity):
    b = batch(1)
    out, forced = forced_ids_for_the_shuffle(identity, b, seed=7)
    with torch.no_grad():
        control = identity(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep,
                           perturb_codes=_code_control("codes_shuffled", torch.Generator().manual_seed(7)))
        by_ids = identity(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep, concept_ids=forced)
    assert int(out.keep.sum()) > 5
    torch.testing.assert_close(control.logits, by_ids.logits, atol=1e-5, rtol=0)
    assert (control.logits - out.logits).abs().max() > 1e-3  # the ids moved


def test_codes_zero_is_the_gate_closed(identity):
    """Identity start: the input is h + gate * e; removing e is the model with its gate at zero."""
    b = batch(2)
    closed = copy.deepcopy(identity)
    with torch.no_grad():
        closed.concept_gate.gate.zero_()
        out = identity(b["input_ids"], attention_mask=b["attention_mask"])
        control = identity(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep,
                           perturb_codes=_code_control("codes_zero", torch.Generator()))
        reference = closed(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep)
    torch.testing.assert_close(control.logits, reference.logits, atol=1e-5, rtol=0)


def test_code_controls_are_the_nll_differences_by_hand(identity):
    batches = [batch(3), batch(4, B=2, T=17)]
    result = evaluate(identity, batches, seed=5)
    code_gen = torch.Generator().manual_seed(6)  # the evaluation's code generator: seed + 1
    sums = {"base": 0.0, "codes_shuffled": 0.0, "codes_zero": 0.0}
    n = 0
    with torch.no_grad():
        for b in batches:
            ids, mask = b["input_ids"], b["attention_mask"]
            valid = mask.bool()
            out = identity(ids, attention_mask=mask)
            nll, pair = pair_nll(out.logits, ids, valid, None)
            sums["base"] += float(nll.double()[pair].sum())
            n += int(pair.sum())
            for name in ("codes_shuffled", "codes_zero"):
                bad = identity(ids, attention_mask=mask, keep=out.keep, perturb_codes=_code_control(name, code_gen))
                sums[name] += float(pair_nll(bad.logits, ids, valid, None)[0].double()[pair].sum())
    for name in ("codes_shuffled", "codes_zero"):
        assert result[f"delta_nll_{name}"] == pytest.approx((sums[name] - sums["base"]) / n, abs=1e-9), name
    gate = identity.concept_gate.gate.detach()
    assert result["gate_norm"] == pytest.approx(float(gate.pow(2).mean().sqrt()), rel=1e-6)


def test_negative_control_a_closed_gate_reads_zero_on_codes_not_on_whole_inputs(identity):
    """What an unused code looks like: with the gate at 0 (as built) the id reaches nothing, so both code
    controls are exactly 0, while shuffling the whole inputs (the shallow states move too) still costs NLL."""
    closed = copy.deepcopy(identity)
    with torch.no_grad():
        closed.concept_gate.gate.zero_()
    result = evaluate(closed, [batch(3), batch(4)], seed=1)
    assert result["gate_norm"] == 0.0
    assert result["delta_nll_codes_shuffled"] == 0.0 and result["delta_nll_codes_zero"] == 0.0
    assert abs(result["delta_nll_shuffle"]) > 1e-3
    opened = evaluate(identity, [batch(3), batch(4)], seed=1)
    assert opened["delta_nll_codes_shuffled"] != 0.0 and opened["delta_nll_codes_zero"] != 0.0


def test_without_identity_start_removing_the_codes_removes_the_input():
    """concept_input=embedding: the discrete embedding is the whole input, so codes_zero is the input zeroed and
    there is no gate."""
    model = model_with(concept_input="embedding")
    b = batch(5)
    with torch.no_grad():
        out = model(b["input_ids"], attention_mask=b["attention_mask"])
        control = model(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep,
                        perturb_codes=_code_control("codes_zero", torch.Generator()))
        zeroed = model(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep,
                       perturb=lambda c, valid: torch.where(valid[..., None], torch.zeros_like(c), c))
    torch.testing.assert_close(control.logits, zeroed.logits, atol=1e-5, rtol=0)
    assert "gate_norm" not in evaluate(model, [b], controls=False)


def test_multilevel_codes_shuffle_within_a_level():
    """With L code levels each slot is one level's code: the shuffle permutes codes among slots of the same
    level only (a level-0 code never lands in a level-1 slot)."""
    from concept import ComponentRef

    model = model_with(vocabulary=ComponentRef("codebook", {"size": 16, "code_dim": 8, "levels": 2}))
    b = batch(6)
    seen = {}

    def spy(e, valid, level):
        seen["level"], seen["valid"], seen["e"] = level, valid, e
        out = _code_control("codes_shuffled", torch.Generator().manual_seed(0))(e, valid, level)
        seen["out"] = out
        return out

    with torch.no_grad():
        out = model(b["input_ids"], attention_mask=b["attention_mask"])
        model(b["input_ids"], attention_mask=b["attention_mask"], keep=out.keep, perturb_codes=spy)
    level, valid, e, shuffled = seen["level"], seen["valid"], seen["e"], seen["out"]
    assert level is not None and set(level[valid].tolist()) == {0, 1}
    for lv in (0, 1):
        at = valid & (level == lv)
        before = {tuple(r) for r in e[at].round(decimals=5).tolist()}
        assert {tuple(r) for r in shuffled[at].round(decimals=5).tolist()} == before  # a permutation within lv
    assert not torch.equal(shuffled[valid], e[valid])


# -- the planner-executor: one type's block shuffled ------------------------------------------------------
def test_shuffle_type_moves_one_types_block_and_keeps_the_others():
    from concept.planner.diagnostics import shuffle_type
    from concept.planner.model import Plan

    class Two:
        sizes = torch.tensor([4, 6])

    plan = Plan.from_rows([[(0, 1), (1, 2), (1, 3)], [(0, 0), (0, 2), (1, 5)], [(1, 0)]], (4, 6))
    rolled = shuffle_type(Two(), plan, 1, torch.tensor([2, 0, 1]))
    assert rolled.rows() == [[(0, 1), (1, 0)], [(0, 0), (0, 2), (1, 2), (1, 3)], [(1, 5)]]
    assert shuffle_type(Two(), plan, 0, torch.tensor([1, 2, 0])).rows() == [
        [(0, 0), (0, 2), (1, 2), (1, 3)], [(1, 5)], [(0, 1), (1, 0)]]


def test_planner_reports_each_types_shuffle_by_hand():
    """Per type: the NLL with only that type's block rolled by one row, minus the NLL of the plan itself."""
    from concept.planner.diagnostics import evaluate_planned, shuffle_type, step_diagnostics
    from concept.planner.model import Plan, text_loss

    from .test_planner_executor import built, plan_inputs

    model = built()
    u, valid = plan_inputs()
    plan = Plan.from_rows([[(0, 1), (1, 3)], [(1, 2)], [(0, 0), (0, 1), (1, 1)]], (8, 16))
    roll = torch.tensor([2, 0, 1])
    with torch.no_grad():
        out = model(u, attention_mask=valid, labels=u, plan=plan)
        row = step_diagnostics(model, out, {"input_ids": u, "attention_mask": valid})
        base = text_loss(out.logits, u, valid)
        for i, name in enumerate(("topic", "gist")):
            rolled = text_loss(model.executor(shuffle_type(model, plan, i, roll), u, valid), u, valid)
            assert row[f"delta_nll_shuffle/{name}"] == pytest.approx(float(rolled - base), abs=1e-5), name
            assert row[f"delta_nll_shuffle/{name}"] != 0
    result = evaluate_planned(model, [{"input_ids": u, "attention_mask": valid.long()}], beam=0)
    assert {"delta_nll_shuffle/topic", "delta_nll_shuffle/gist"} <= set(result)
