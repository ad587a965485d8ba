"""The planner-executor family (docs/planner_executor.md): config, token layout, planner and executor, decoding =
teacher forcing, batching, gradients, objectives, training with exact resume, and bad input."""
import dataclasses
import json
import math

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.errors import ConfigError
from concept.planner.model import Plan, PlannerExecutorModel, TokenLayout, text_loss
from concept.training import TrainConfig, Trainer

from .conftest import randomize_new_modules
from .test_objectives import interrupted_at_three

TYPES = [{"name": "topic", "size": 8, "max_len": 2}, {"name": "gist", "size": 16, "max_len": 4}]


def pe_config(types=TYPES, **planner):
    return BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 3, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                             "intermediate": 64}),
                       family="planner-executor", position_scheme=ComponentRef("per-type"),
                       sections={"planner": {"types": types, **planner}})


def built(**planner):
    """A tiny planner-executor with random new modules and LoRA adapters that count, in eval mode."""
    torch.manual_seed(0)
    m = randomize_new_modules(concept.build(pe_config(**planner)))
    concept.lora.add_lora(m.backbone, concept.lora.LoraSettings(rank=2))
    with torch.no_grad():  # LoRA B starts at 0: make the adapters count
        for name, p in m.backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return m.eval()


def plan_inputs(B=3, L=11, seed=1):
    """Rows of u (one of them left-padded) and their mask."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 256, (B, L), generator=g)
    valid = torch.ones_like(u, dtype=torch.bool)
    valid[B // 2, :3] = False
    return u, valid


def check_beam_search(model, u, valid, k: int):
    """Beam search against the slow references: k = 1 is greedy decoding, and the search's own log p(z | u)
    equals the batched teacher-forced re-score, best first. Returns (beams, log p, scores)."""
    from concept.planner.search import beam_search, score_plans

    with torch.no_grad():
        greedy = model.planner(u, valid, sample=False)
        one, _ = beam_search(model, u, valid, 1)
        beams, logp = beam_search(model, u, valid, k)
        scores = score_plans(model, u, valid, u, valid, beams, k)
    assert one.rows() == greedy.rows()
    assert torch.allclose(scores.plan, logp, atol=1e-4) and (logp[:, :-1] >= logp[:, 1:]).all()
    return beams, logp, scores


@pytest.fixture(scope="module")
def model():
    return built()


def test_build_and_layout(model):
    assert isinstance(model, PlannerExecutorModel) and model.resolution.family == "planner-executor"
    with pytest.warns(DeprecationWarning, match="model.resolution"):  # the old name of the build resolution
        assert model.plan is model.resolution
    layout = model.layout
    assert layout == TokenLayout(256, (8, 16))
    assert [layout.concept_id(0, 0), layout.eos_id(0), layout.concept_id(1, 0), layout.eos_id(1)] == [256, 264, 265, 281]
    assert (layout.plan_id, layout.sep_id(0), layout.sep_id(1), layout.size) == (282, 283, 284, 285)


def test_unified_logits_are_restricted_by_phase(model):
    h = torch.randn(3, 32)
    executing = model.unified_logits(h, None)
    assert torch.isfinite(executing[:, :256]).all() and torch.isinf(executing[:, 256:]).all()
    for i in range(2):
        planning = model.unified_logits(h, i)
        start, stop = model.layout.offset(i), model.layout.eos_id(i) + 1
        assert torch.isfinite(planning[:, start:stop]).all()
        assert torch.isinf(planning[:, :start]).all() and torch.isinf(planning[:, stop:]).all()
        # the planner's per-type logits are the same numbers
        assert torch.allclose(model.plan_logits(h, torch.full((3,), i))[:, : stop - start], planning[:, start:stop])


def test_plans_respect_max_len_and_end_every_type(model):
    u = torch.randint(0, 256, (5, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plan = model.planner(u, torch.ones_like(u, dtype=torch.bool), sample=False)
    lengths = plan.lengths(2)
    assert (lengths <= torch.tensor([2, 4])).all()
    assert (plan.is_eos.sum(1) == 2).all()  # one <EOS> per type, the last step of each row
    rows = plan.rows()
    again = Plan.from_rows(rows, (8, 16))
    assert again.rows() == rows and torch.equal(again.active.sum(1), plan.active.sum(1))


def test_executor_never_sees_u(model):
    """Change u, hold the plan fixed: the executor's logits must not move (bit for bit)."""
    g = torch.Generator().manual_seed(2)
    u = torch.randint(0, 256, (3, 12), generator=g)
    y = torch.randint(0, 256, (3, 9), generator=g)
    yv = torch.ones_like(y, dtype=torch.bool)
    plan = Plan.from_rows([[(0, 1), (1, 3)], [(1, 5), (1, 6), (1, 7)], []], (8, 16))
    with torch.no_grad():
        a = model(torch.cat([u, y], 1), plan=plan)  # the model's forward reads u (reconstruct: y = u)
        model.task, model.context_len = "continue", 12
        try:
            b = model(torch.cat([u, y], 1), plan=plan)
            c = model(torch.cat([torch.randint(0, 256, (3, 12), generator=g), y], 1), plan=plan)
        finally:
            model.task, model.context_len = "reconstruct", None
        direct = model.executor(plan, y, yv)
    assert torch.equal(b.logits, c.logits) and torch.equal(b.logits, direct)
    assert not torch.equal(a.logits[:, :9], b.logits)  # (reconstruct scored another y: the test can fail)


def test_generation_equals_teacher_forcing(model):
    """Plan and text written with KV caches equal the teacher-forced planner and executor on them."""
    prompts = [[5, 17, 42, 9, 100, 3], [7, 7, 8]]
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=6, output_logits=True)
        for b, prompt in enumerate(prompts):
            u = torch.tensor([prompt])
            plan = Plan.from_rows([[(i, c) for i, p in enumerate(out.plans[b]) for c in p["ids"]]], (8, 16))
            forced = model.planner(u, torch.ones_like(u, dtype=torch.bool), teacher=plan, sample=False)
            assert forced.rows() == plan.rows()
            # the cached planner wrote the greedy plan of the teacher-forced logits: at every step the argmax
            # (or the <EOS> that max_len forces), a property the KV-cached planning could break
            steps = forced.active[0]
            eos = model.sizes[forced.types[0].clamp(min=0)]
            greedy = torch.where(forced.forced[0], eos, forced.logits[0].argmax(-1))
            assert torch.equal(greedy[steps], forced.classes[0][steps])
            y = torch.tensor([out.tokens[b]])
            tf = model.executor(plan, y, torch.ones_like(y, dtype=torch.bool))
            assert torch.allclose(out.logits[b], tf[0], atol=1e-5), (out.logits[b] - tf[0]).abs().max()


def test_batched_generation_equals_one_prompt_at_a_time(model):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [200, 100, 50, 25]]
    with torch.no_grad():
        batch = model.generate(prompts, max_new_tokens=5, output_logits=True)
        for b, prompt in enumerate(prompts):
            alone = model.generate([prompt], max_new_tokens=5, output_logits=True)
            assert alone.plans[0] == batch.plans[b]
            assert alone.tokens[0] == batch.tokens[b]
            assert torch.allclose(alone.logits[0], batch.logits[b], atol=1e-5)


def test_executor_loss_reaches_the_planner(model):
    """Straight-through concept embeddings: the text CE alone gives the planner's heads and the LoRA
    adapters a gradient; with the executor reading detached embeddings the heads get none."""
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    model.train()
    try:
        torch.manual_seed(0)
        out = model(ids, labels=ids)
        model.zero_grad(set_to_none=True)
        out.loss.backward()
        heads = [v.head.weight.grad for v in model.vocabularies]
        assert all(g is not None and g.abs().sum() > 0 for g in heads)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        plan = model.planner(*model.split_example(ids)[:2])
        loss = text_loss(model.executor(plan, ids, torch.ones_like(ids, dtype=torch.bool), embeds=plan.embeds.detach()),
                         ids, torch.ones_like(ids, dtype=torch.bool))
        loss.backward()
        assert all(v.head.weight.grad is None for v in model.vocabularies)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_objectives_and_quota_controller(model):
    from concept.planner.objectives import (CommitmentObjective, EOSObjective, PlannerQuotaController, PlanUsageObjective,
                                         QuotaObjective, eos_probs)

    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(4))
    model.train()
    try:
        out = model(ids, labels=ids)
    finally:
        model.eval()
    plan = out.plan
    forced = plan.forced
    assert forced.any()  # the untrained planner runs into max_len
    expected = -torch.log(eos_probs(model, plan)[forced]).mean()
    assert torch.allclose(EOSObjective(2.0)(model, {}, out), 2 * expected)
    mask = plan.concepts
    soft, hard = plan.soft[mask], plan.hard[mask]
    want = (soft - hard).pow(2).sum(-1).mean() / hard.pow(2).sum(-1).mean()
    assert torch.allclose(CommitmentObjective(1.0)(model, {}, out), want)
    assert float(PlanUsageObjective(1.0)(model, {}, out).detach()) >= 0
    quota = QuotaObjective(1.0, PlannerQuotaController(budget=2.0, ki=0.5))
    surrogate = ((1 - eos_probs(model, plan)) * plan.active).sum(1).mean()
    assert torch.allclose(quota(model, {}, out), (surrogate - 2.0) ** 2 / 4.0)
    before = float(model.eos_bias.value)
    try:
        stats = quota.stats(model, None, out)
        assert stats["plan_len"] == pytest.approx(float(plan.lengths(2).sum(1).float().mean()))
        steady, go = torch.tensor(True), torch.tensor(False)
        length = lambda value: {"plan_len": torch.tensor(value, dtype=torch.float64)}  # noqa: E731
        quota.device_step(model, length(4.0), {}, go)  # over budget: <EOS> more likely
        assert float(model.eos_bias.value) == pytest.approx(before + 0.5 * (4.0 - 2.0) / 2.0)
        quota.device_step(model, length(9.0), {}, steady)  # a skipped step
        assert float(model.eos_bias.value) == pytest.approx(before + 0.5 * (4.0 - 2.0) / 2.0)
        quota.device_step(model, length(0.0), {}, go)
        assert float(model.eos_bias.value) == pytest.approx(before + 0.5 - 0.5)
    finally:
        model.eos_bias.value.fill_(before)


def test_per_type_quota_holds_each_types_share_and_the_usage_term_cannot_be_escaped():
    from concept.planner.objectives import PlannerQuotaController, PlanUsageObjective, QuotaObjective, eos_probs

    model = built(quota="per-type", budget=3)
    assert model.settings.type_targets == pytest.approx([1.0, 2.0])  # 3 in proportion to max_len 2 : 4
    assert model.eos_bias.value.shape == (2,)
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.eos_bias.value.zero_()  # (built() randomised it)
        x = torch.randn(2, 32)
        before = model.type_logits(x, 1)
        model.eos_bias.value[1] = 2.0  # type 1's bias moves only type 1's <EOS>
        assert torch.equal(model.type_logits(x, 1)[:, -1], before[:, -1] + 2.0)
        assert torch.equal(model.type_logits(x, 1)[:, :-1], before[:, :-1])
        model.eos_bias.value.zero_()
    model.train()
    out = model(ids, labels=ids)
    model.eval()
    plan, budget = out.plan, model.settings.type_targets
    quota = QuotaObjective(1.0, PlannerQuotaController(budget, ki=0.5))
    going = (1 - eos_probs(model, plan)) * plan.active
    want = sum(((going * (plan.types == i)).sum(1).mean() - b) ** 2 / b ** 2 for i, b in enumerate(budget)) / 2
    assert torch.allclose(quota(model, {}, out), want)
    lengths = {f"plan_len/{name}": torch.tensor(value, dtype=torch.float64) for name, value in (("topic", 2.0),
                                                                                              ("gist", 1.0))}
    logged = {k: float(v) for k, v in quota.device_step(model, lengths, {}, torch.tensor(False)).items()}
    # topic over its share (2 vs 1): <EOS_topic> more likely; gist under (1 vs 2): less likely
    assert model.eos_bias.value.tolist() == pytest.approx([0.5 * (2 - 1) / 1, 0.5 * (1 - 2) / 2])
    assert logged == pytest.approx({"eos_bias": 0.125, "eos_bias/topic": 0.5, "eos_bias/gist": -0.25})
    # the usage term: a type with no emitted concept counts as collapsed, so ending a type never lowers it
    usage = PlanUsageObjective(1.0)
    full = float(usage(model, {}, out).detach())
    ended = dataclasses.replace(plan, is_eos=plan.is_eos | (plan.types == 0))  # topic ended at once
    escaped = float(usage(model, {}, dataclasses.replace(out, plan=ended)).detach())
    assert escaped >= full - 1e-6 and escaped >= math.log(8) / 2
    with pytest.raises(ConfigError, match="planner.quota: total or per-type"):
        concept.config.resolve(pe_config(quota="types"))


@pytest.fixture(scope="module")
def pe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pe") / "pe"
    concept.save(concept.build(pe_config()), out)
    return out


def small(**kw):
    base = dict(steps=4, seq_len=24, batch=2, eval_every=2, eval_batches=1, checkpoint_every=2, log_every=2, warmup=1,
                task="continue", context_len=12, lora=concept.lora.LoraSettings(rank=2))
    base.update(kw)
    return TrainConfig(**base)


def test_training_logs_each_objective_and_resumes_exactly(pe_run, tmp_path):
    full = Trainer.start(pe_run, tmp_path / "full", small())
    full.train()
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "commitment", "eos", "quota", "plan_len", "plan_len/topic", "plan_per_token", "eos_bias"):
        assert key in rows[0], key
    assert "nll_nothing" in rows[1]["eval"] and "plan_len" in rows[1]["eval"]
    interrupted_at_three(pe_run, tmp_path / "part", small()).train()  # Ctrl-C after step 3, then --resume
    again = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    assert again[-1]["eos_bias"] == rows[-1]["eos_bias"]
    loaded = concept.load(tmp_path / "full")
    assert isinstance(loaded, PlannerExecutorModel) and (loaded.task, loaded.context_len) == ("continue", 12)
    assert float(loaded.eos_bias.value) == pytest.approx(rows[-1]["eos_bias"])


def test_per_type_quota_trains_logs_each_bias_and_resumes_exactly(tmp_path):
    source = tmp_path / "pe"
    concept.save(concept.build(pe_config(quota="per-type")), source)
    full = Trainer.start(source, tmp_path / "full", small(usage_weight=0.1))
    assert not any("planner.quota=per-type" in n for n in full.notes)
    full.train()
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert {"eos_bias/topic", "eos_bias/gist", "plan_usage"} <= set(rows[0])
    interrupted_at_three(source, tmp_path / "part", small(usage_weight=0.1)).train()
    again = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["eos_bias/topic"], r["eos_bias/gist"]) for r in again] == \
        [(r["loss"], r["eos_bias/topic"], r["eos_bias/gist"]) for r in rows]
    loaded = concept.load(tmp_path / "full")
    assert loaded.eos_bias.value.tolist() == pytest.approx([rows[-1]["eos_bias/topic"], rows[-1]["eos_bias/gist"]])
    total = Trainer.start(pe_run_source(tmp_path), tmp_path / "total", small(usage_weight=0.1, steps=1))
    assert any("planner.quota=per-type" in n for n in total.notes)  # the usage term can be escaped: said so


def pe_run_source(tmp_path):
    out = tmp_path / "pe-total"
    concept.save(concept.build(pe_config()), out)
    return out


@pytest.mark.parametrize("types, message", [
    ([], "non-empty list"),
    ([{"name": "a", "size": 8, "max_len": 2}, {"name": "a", "size": 8, "max_len": 2}], "duplicate type name"),
    ([{"name": "a", "size": 1, "max_len": 2}], "at least 2 concept ids"),
    ([{"name": "a", "size": 8, "max_len": 0}], "at least 1 concept per type"),
])
def test_bad_types_are_refused_before_building(types, message):
    with pytest.raises(ConfigError, match=message):
        concept.config.resolve(pe_config(types=types))


def test_every_config_problem_at_once():
    cfg = pe_config(types=[{"name": "a", "size": 1, "max_len": 0}], budget=-1)
    cfg.position_scheme = ComponentRef("time")
    with pytest.raises(ConfigError) as err:
        concept.config.resolve(cfg)
    text = str(err.value)
    assert "size" in text and "max_len" in text and "budget" in text and "per-type" in text
    streaming = BuildConfig(sections={"planner": {"types": TYPES}})
    with pytest.raises(ConfigError, match="--family planner-executor"):
        concept.config.resolve(streaming)
    with pytest.raises(ConfigError, match="family"):
        concept.config.resolve(BuildConfig(family="planer-executor"))


def test_training_options_of_the_other_family_are_refused(pe_run, tmp_path):
    with pytest.raises(ConfigError, match="context-len"):
        Trainer.start(pe_run, tmp_path / "a", small(context_len=24))  # = seq_len: nothing left to predict
    with pytest.raises(ConfigError, match="placement"):
        Trainer.start(pe_run, tmp_path / "b", small(placement=1.0))
    streaming = tmp_path / "s"
    concept.save(concept.build(BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 3, "hidden": 32, "heads": 2,
                                                                                 "kv_heads": 1}), split="1,1,1")), streaming)
    with pytest.raises(ConfigError, match="planner-executor runs"):
        Trainer.start(streaming, tmp_path / "c", small())
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_codebook_vocabularies_plan_and_decode_exactly():
    """The typed vocabularies reuse the vocabulary plugins: `codebook` too (its NULL logit is <EOS>)."""
    cfg = pe_config()
    cfg.vocabulary = ComponentRef("codebook", {"code_dim": 8})
    m = randomize_new_modules(concept.build(cfg)).eval()
    assert [v.size for v in m.vocabularies] == [8, 16] and type(m.vocabularies[0]).__name__ == "CodebookVocabulary"
    with torch.no_grad():
        out = m.generate([[3, 1, 4, 1, 5]], max_new_tokens=4, output_logits=True)
        plan = Plan.from_rows([[(i, c) for i, p in enumerate(out.plans[0]) for c in p["ids"]]], (8, 16))
        y = torch.tensor(out.tokens)
        tf = m.executor(plan, y, torch.ones_like(y, dtype=torch.bool))
    assert torch.allclose(out.logits[0], tf[0], atol=1e-5)
