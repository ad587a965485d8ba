"""Hard-EM for the planner-executor (docs/planner_executor.md): one-pass teacher forcing = the step-wise planner, beam
search, batched plan scoring, the plan cache (refresh, checkpoint, corruption), training and bad input."""
import json

import pytest
import torch

import concept
from concept.errors import ConfigError
from concept.planner.hard_em import CachedPlan, HardEMObjective, example_key
from concept.planner.search import beam_search, score_plans
from concept.planner.model import Plan, text_loss
from concept.training import TrainConfig, Trainer

from .conftest import randomize_new_modules
from .test_objectives import interrupted_at_three
from .test_planner_executor import built, check_beam_search, pe_config, pe_run, plan_inputs, small  # noqa: F401 (pe_run: fixture)


@pytest.fixture(scope="module")
def model():
    return built()


def close_where_finite(a, b, atol=1e-5):
    """Equal within ``atol`` where finite, and infinite at the same places; a NaN anywhere fails."""
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[a.isinf()], b[b.isinf()])
    finite = torch.isfinite(a)
    assert (a[finite] - b[finite]).abs().max() < atol


def test_one_pass_teacher_forcing_equals_the_stepwise_planner(model):
    u, valid = plan_inputs()
    plans = [Plan.from_rows([[(0, 1), (0, 2), (1, 3)], [], [(1, 1)] * 4], (8, 16))]
    with torch.no_grad():
        plans.append(model.planner(u, valid, sample=False))
        for plan in plans:
            stepwise = model.planner(u, valid, teacher=plan, sample=False)
            one_pass = model.planner_forced(u, valid, plan)
            a = plan.active
            close_where_finite(stepwise.logits[a], one_pass.logits[a])
            assert torch.equal(stepwise.forced & a, one_pass.forced & a)
            assert torch.allclose(stepwise.embeds[a], one_pass.embeds[a])
        one_pass = model.planner_forced(u, valid, plans[0])
    assert one_pass.forced[2].any() and not one_pass.forced[1].any()  # row 2 hit max_len 4 of `gist`


def test_beam_search(model):
    u, valid = plan_inputs()
    beams, logp, scores = check_beam_search(model, u, valid, 4)
    rows = beams.rows()
    for b in range(3):
        mine = rows[b * 4:(b + 1) * 4]
        assert len({tuple(r) for r in mine}) == 4  # distinct plans
        assert (beams.lengths(2)[b * 4:(b + 1) * 4] <= torch.tensor([2, 4])).all()
    # the executor part of the score is log p(y | z), summed over y
    with torch.no_grad():
        rep = lambda t: t.repeat_interleave(4, 0)  # noqa: E731
        direct = -text_loss(model.executor(beams, rep(u), rep(valid)), rep(u), rep(valid), reduction="none").sum(1)
    assert torch.allclose(scores.text.flatten(), direct, atol=1e-4)


def test_beam_search_keeps_minus_inf_beyond_the_distinct_plans():
    torch.manual_seed(0)
    tiny = randomize_new_modules(concept.build(pe_config(types=[{"name": "a", "size": 2, "max_len": 1}]))).eval()
    u, valid = plan_inputs()
    with torch.no_grad():
        beams, logp = beam_search(tiny, u, valid, 4)  # plans: [], [0], [1]: three
    assert torch.isfinite(logp[:, :3]).all() and torch.isinf(logp[:, 3]).all()
    assert torch.allclose(logp[:, :3].exp().sum(1), torch.ones(3), atol=1e-5)  # every plan there is, probability 1


def test_estep_cache_refresh_and_statistics(model):
    objective = HardEMObjective(1.0, beam=3, every=2)
    u, valid = plan_inputs()
    batch = {"input_ids": u, "attention_mask": valid}
    out = objective.prepare(model, batch, step=0)
    assert objective._stats["rows"] == 3 and objective._stats["old"] == 0
    keys = [example_key(u[b][valid[b]], u[b][valid[b]]) for b in range(3)]
    assert sorted(objective.cache) == sorted(keys)
    assert out["plan"].rows() == [objective.cache[k].rows for k in keys]
    with torch.no_grad():  # z* is the best of the beam under S(z)
        beams, _ = beam_search(model, u, valid, 3)
        best = score_plans(model, u, valid, u, valid, beams, 3).total.max(1).values
    assert torch.allclose(torch.tensor([objective.cache[k].score for k in keys]), best, atol=1e-4)
    objective.prepare(model, batch, step=1)  # fresh: no search
    assert objective._stats["rows"] == 0
    objective.prepare(model, batch, step=2)  # two steps old: searched again; the same model finds the same plans
    assert objective._stats["rows"] == 3 and objective._stats["old"] == 3 and objective._stats["flips"] == 0
    assert objective._stats["gap"] == pytest.approx(0.0, abs=1e-4)
    stats = objective.log_stats(objective.stats(model, None, None), {})
    assert stats["flip_rate"] == 0 and stats["estep_share"] == 1  # estep_margin: the test below


def test_estep_margin_is_the_mean_gap_between_the_best_and_the_runner_up_plan(model):
    """estep_margin, recomputed from the beam's own scores: top-1 minus top-2 of S(z), averaged over
    the rows (a row with one distinct plan adds 0)."""
    objective = HardEMObjective(1.0, beam=3, every=1)
    u, valid = plan_inputs()
    objective.prepare(model, {"input_ids": u, "attention_mask": valid}, step=0)
    stats = objective.log_stats(objective.stats(model, None, None), {})
    with torch.no_grad():
        beams, logp = beam_search(model, u, valid, 3)
        total = score_plans(model, u, valid, u, valid, beams, 3).total.masked_fill(~torch.isfinite(logp), float("-inf"))
    top = total.sort(dim=1, descending=True).values
    gaps = [float(a - b) if b > float("-inf") else 0.0 for a, b in zip(top[:, 0], top[:, 1])]
    assert any(g > 1e-3 for g in gaps)  # the rows' plans do differ in score: the check can fail
    assert stats["estep_margin"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)
    assert stats["estep_margin"] != pytest.approx(float((top[:, 0] - top[:, -1]).mean()), abs=1e-4)  # not top-1 - last


def test_the_cached_plan_competes(model):
    """A cached plan competes with the beam: z* is the better of the two under S(z)."""
    u, valid = plan_inputs(B=1)
    key = example_key(u[0][valid[0]], u[0][valid[0]])
    with torch.no_grad():
        beams, _ = beam_search(model, u, valid, 4)
        scores = score_plans(model, u, valid, u, valid, beams, 4).total[0]
    rows = beams.rows()
    for cached in (1, 2, 3):  # a plan a beam of 1 does not find (the beam's second to fourth)
        objective = HardEMObjective(1.0, beam=1, every=1)
        objective.cache[key] = CachedPlan(rows[cached], 0.0, 0)
        objective.prepare(model, {"input_ids": u, "attention_mask": valid}, step=1)
        winner = cached if scores[cached] > scores[0] else 0
        assert objective.cache[key].rows == rows[winner]
        assert objective.cache[key].score == pytest.approx(float(scores[winner]), abs=1e-4)
        assert objective._stats["gap"] == pytest.approx(float(scores[winner] - scores[cached]), abs=1e-4)
        assert objective._stats["flips"] == float(winner != cached)


def test_mstep_loss_is_the_planners_ce_on_zstar(model):
    objective = HardEMObjective(0.5)
    u, valid = plan_inputs()
    plan = Plan.from_rows([[(0, 1), (1, 3)], [(1, 2)], [(0, 0), (0, 1), (1, 1)]], (8, 16))
    out = model(u, attention_mask=valid, labels=u, plan=plan)
    term = objective(model, {}, out)
    mask = out.plan.active & ~out.plan.forced
    logp = torch.log_softmax(out.plan.logits.float(), -1).gather(-1, out.plan.classes.clamp(min=0)[..., None])[..., 0]
    assert torch.allclose(term, -0.5 * logp[mask].mean())
    assert out.plan.forced[2, 2]  # row 2's forced <EOS> of `topic` (max_len 2) is not part of the CE


def hard(**kw):
    return small(**{"plan_training": "hard-em", "beam": 2, "estep_every": 2, **kw})


def test_hard_em_trains_logs_and_resumes_exactly(pe_run, tmp_path):
    Trainer.start(pe_run, tmp_path / "full", hard()).train()
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    for key in ("plan_ce", "estep_share", "estep_margin", "estep_s", "plan_len", "eos_bias"):
        assert key in rows[0], key
    assert not any(k.startswith("_") for r in rows for k in r)
    for key in ("delta_nll_shuffle", "delta_nll_mask", "delta_nll_random", "delta_nll_dropout", "entropy/gist",
                "max_prob/topic", "cos_soft_hard", "nll_by_position/0-64", "grad_norm/vocabularies", "grad_norm/lora"):
        assert key in rows[1], key  # the planner diagnostics, every --log-every 2 steps
    assert rows[1]["grad_norm/vocabularies"] > 0
    assert json.loads((tmp_path / "full" / "checkpoint" / "state.json").read_text())["files"]["plan_ce.json"]
    assert (tmp_path / "full" / "planner.png").stat().st_size > 1000  # the planner diagnostics' curves
    resumed = interrupted_at_three(pe_run, tmp_path / "part", hard())
    assert not resumed.notes and resumed.objectives[-2].cache  # the cache came back with the checkpoint
    resumed.train()
    again = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    assert [r["plan_ce"] for r in again] == [r["plan_ce"] for r in rows]


@pytest.mark.parametrize("damage", ["checksum", "missing", "unfit"])
def test_a_corrupted_plan_cache_is_rebuilt_with_a_warning(pe_run, tmp_path, damage):
    first = Trainer.start(pe_run, tmp_path / "run", hard(steps=2))
    first.train()
    file = tmp_path / "run" / "checkpoint" / "plan_ce.json"
    if damage == "checksum":
        file.write_bytes(file.read_bytes().replace(b"[", b"[ ", 1))  # valid JSON, wrong bytes
    elif damage == "missing":
        file.unlink()
    else:  # a concept id outside its type's vocabulary, with a matching checksum
        import hashlib

        state = json.loads(file.read_bytes())
        key = next(iter(state["entries"]))
        state["entries"][key][0] = [[0, 99]]
        file.write_bytes(json.dumps(state).encode())
        meta_file = tmp_path / "run" / "checkpoint" / "state.json"
        meta = json.loads(meta_file.read_text())
        meta["files"]["plan_ce.json"] = hashlib.sha256(file.read_bytes()).hexdigest()
        meta_file.write_text(json.dumps(meta))
    resumed = Trainer.resume(tmp_path / "run", steps=3)
    assert any("plan_ce" in note and "rebuilt" in note for note in resumed.notes), resumed.notes
    hem = next(o for o in resumed.objectives if o.name == "plan_ce")
    assert hem.cache == {}
    resumed.train()  # the next E-step searches every example again
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["estep_share"] == 1.0


def test_bad_hard_em_options(pe_run, tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer.start(pe_run, tmp_path / "a", hard(estep_every=0, beam=0, curriculum="64:0.5"))
    text = str(err.value)
    assert "estep-every" in text and "beam" in text and "end shorter than it starts" in text
    assert not (tmp_path / "a").exists()
    streaming = tmp_path / "streaming"
    concept.save(concept.build(concept.BuildConfig(backbone=pe_config().backbone)), streaming)
    with pytest.raises(ConfigError, match="plan-training hard-em: only for planner-executor"):
        Trainer.start(streaming, tmp_path / "b", TrainConfig(steps=1, seq_len=16, plan_training="hard-em"))


def test_step_diagnostics_are_the_controls_against_the_trained_plan(model):
    from concept.planner.diagnostics import masked_embeds, step_diagnostics

    u, valid = plan_inputs()
    plan = Plan.from_rows([[(0, 1), (1, 3)], [(1, 2)], [(0, 0), (0, 1), (1, 1)]], (8, 16))
    with torch.no_grad():
        out = model(u, attention_mask=valid, labels=u, plan=plan)
        row = step_diagnostics(model, out, {"input_ids": u, "attention_mask": valid})
        base = text_loss(out.logits, u, valid)
        masked = text_loss(model.executor(out.plan, u, valid, embeds=masked_embeds(model, out.plan)), u, valid)
        shuffled = text_loss(model.executor(plan.select(torch.tensor([2, 0, 1])), u, valid), u, valid)
    assert row["delta_nll_mask"] == pytest.approx(float(masked - base), abs=1e-5)
    assert row["delta_nll_shuffle"] == pytest.approx(float(shuffled - base), abs=1e-5)
    assert row["delta_nll_mask"] != 0 and 0 < row["cos_soft_hard"] <= 1


def test_estep_prior_weight(model):
    """β = 0: z* is the beam's plan that best explains y, whatever its prior."""
    u, valid = plan_inputs()
    with torch.no_grad():
        beams, _ = beam_search(model, u, valid, 3)
        scores = score_plans(model, u, valid, u, valid, beams, 3)
    rows = beams.rows()
    for prior, total in ((0.0, scores.text), (1.0, scores.total), (2.0, scores.text + 2 * scores.plan)):
        objective = HardEMObjective(1.0, beam=3, prior=prior)
        objective.prepare(model, {"input_ids": u, "attention_mask": valid}, step=0)
        keys = [example_key(u[b][valid[b]], u[b][valid[b]]) for b in range(3)]
        assert [objective.cache[k].rows for k in keys] == [rows[b * 3 + int(total[b].argmax())] for b in range(3)]
