"""Multi-level codes (docs/policies.md): the `codebook` vocabulary with ``levels`` L, interleaved as L consecutive
plan steps in the planner-executor; gradients reach every level; usage per level; bad input."""
import json
import math

import pytest
import torch

import concept
from concept import ComponentRef
from concept.errors import ConfigError
from concept.planner.diagnostics import evaluate_planned
from concept.planner.search import beam_search, score_plans
from concept.planner.model import Plan

from .conftest import randomize_new_modules
from .test_planner_executor import pe_config

TYPES = [{"name": "topic", "size": 8, "max_len": 2}, {"name": "gist", "size": 16, "max_len": 4}]


def config(levels=2, **planner):
    cfg = pe_config(types=TYPES, **planner)
    cfg.vocabulary = ComponentRef("codebook", {"code_dim": 8, "levels": levels})
    return cfg


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = randomize_new_modules(concept.build(config()))
    with torch.no_grad():  # spread logits, so every level's choice matters
        for v in m.vocabularies:
            v.log_scale.fill_(1.0)
    return m.eval()


def inputs(B=3, L=11):
    g = torch.Generator().manual_seed(1)
    u = torch.randint(0, 256, (B, L), generator=g)
    valid = torch.ones_like(u, dtype=torch.bool)
    valid[1, :3] = False
    return u, valid


def test_each_level_has_its_own_codebook(model):
    vocab = model.vocabularies[1]
    assert vocab.levels == 2 and vocab.book(0) is vocab.codebook and vocab.book(1) is vocab.deeper[0]
    ids = torch.tensor([[1, 2], [3, 4]])
    level = torch.tensor([[0, 1], [1, 0]])
    mixed = vocab.embed_hard(ids, level)
    for l in (0, 1):
        assert torch.allclose(mixed[level == l], vocab.embed_hard(ids, l)[level == l])
    h = torch.randn(2, 2, 32)
    assert torch.allclose(vocab.logits(h, level)[level == 1], vocab.logits(h, 1)[level == 1])
    assert not torch.allclose(vocab.logits(h, 0), vocab.logits(h, 1))


def test_levels_interleave_as_consecutive_plan_steps(model):
    u, valid = inputs()
    with torch.no_grad():
        plan = model.planner(u, valid, sample=False)
        forced = model.planner_forced(u, valid, plan)
        greedy, _ = beam_search(model, u, valid, 1)
        beams, logp = beam_search(model, u, valid, 3)
        scores = score_plans(model, u, valid, u, valid, beams, 3)
    assert (plan.lengths(2) % 2 == 0).all() and (beams.lengths(2) % 2 == 0).all()  # whole concepts only
    a = plan.active
    assert torch.equal(torch.isinf(plan.logits[a]), torch.isinf(forced.logits[a]))
    finite = torch.isfinite(plan.logits[a])
    assert not torch.isnan(plan.logits[a]).any() and not torch.isnan(forced.logits[a]).any()
    assert (plan.logits[a][finite] - forced.logits[a][finite]).abs().max() < 1e-5  # decode = teacher forcing
    assert greedy.rows() == plan.rows() and torch.allclose(scores.plan, logp, atol=1e-4)
    # inside a concept (an odd number of its type's codes written before the step) <EOS> is impossible
    inside = a & (plan.before(2) % 2 == 1)
    assert inside.any()
    assert torch.isinf(forced.logits[inside].gather(-1, model.sizes[plan.types[inside]][:, None])).all()


def test_gradients_reach_every_levels_codebook(model, monkeypatch):
    u, valid = inputs()
    plan = Plan.from_rows([[(0, 1), (0, 2), (1, 3), (1, 4)], [(1, 5), (1, 6)], [(0, 7), (0, 0)]], (8, 16))

    def grads():
        model.zero_grad()
        out = model(u, attention_mask=valid, labels=u, plan=plan)
        mask = out.plan.active & ~out.plan.forced
        planner_ce = torch.nn.functional.cross_entropy(out.plan.logits[mask].float(), out.plan.classes[mask])
        (out.loss + planner_ce).backward()
        return [[v.book(l).grad for l in range(2)] for v in model.vocabularies]

    for per_type in grads():
        assert all(g is not None and g.abs().sum() > 0 for g in per_type)
    # the check fails when a level is cut off: detach level 1's codebook
    vocab_class = type(model.vocabularies[0])
    original = vocab_class.book
    monkeypatch.setattr(vocab_class, "book", lambda self, level: original(self, level).detach() if level == 1 else
                        original(self, level))
    for per_type in grads():
        assert per_type[0].abs().sum() > 0 and per_type[1] is None
    model.zero_grad()


def test_usage_is_reported_per_level(model):
    u, valid = inputs()
    result = evaluate_planned(model, [{"input_ids": u, "attention_mask": valid}], controls=False)
    for key in ("usage_perplexity/topic/level0", "usage_perplexity/topic/level1", "usage_perplexity/gist/level1"):
        assert key in result and result[key] >= 1.0


def test_training_with_levels_and_hard_em(tmp_path):
    from concept.training import TrainConfig, Trainer

    concept.save(concept.build(config()), tmp_path / "pe")
    cfg = TrainConfig(steps=2, seq_len=16, batch=2, eval_every=2, eval_batches=1, log_every=1, warmup=1,
                      plan_training="hard-em", beam=2, lora=concept.lora.LoraSettings(rank=2))
    Trainer.start(tmp_path / "pe", tmp_path / "run", cfg).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    assert all(r["estep_share"] > 0 for r in steps)  # the E-step searched plans of whole two-level concepts
    built, loaded = concept.load(tmp_path / "pe"), concept.load(tmp_path / "run")
    for before, after in zip(built.vocabularies, loaded.vocabularies):
        assert after.levels == 2
        for level in range(2):  # the M-step trained every level's codebook
            assert not torch.equal(before.book(level), after.book(level)), level


def test_bad_levels():
    with pytest.raises(ConfigError, match="levels: at least 1"):
        concept.build(config(levels=0))
    with pytest.raises(ConfigError, match="use a multiple of 2"):
        cfg = config()
        cfg.sections["planner"]["types"] = [{"name": "a", "size": 8, "max_len": 3}]
        concept.build(cfg)
    # (the streaming family's multi-level codes: tests/test_multilevel_streaming.py)
