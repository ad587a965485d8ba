"""Training objectives (concept.objectives), the distillation teacher (concept.teacher), the ratio
curriculum and the training options that go with them."""
import copy
import json
from types import SimpleNamespace

import pytest
import torch

import concept
from concept.dense import DenseModel
from concept.errors import ConfigError
from concept.lora import LoraSettings, add_lora
from concept.objectives import AlignObjective, DistillObjective, next_token_pairs
from concept.teacher import adapters_disabled, teacher_forward, tuner_layers
from concept.streaming.ratio import scheduled_ratio
from concept.training import TrainConfig, Trainer
from tests.conftest import tiny_config
from tests.test_training import built, corpus, losses, small  # noqa: F401  (fixtures)


def with_lora(model, rank=2, random_b=False, seed=0):
    add_lora(model.backbone, LoraSettings(rank=rank))
    if random_b:  # LoRA B starts at zero (the adapter is the identity): move it so the student differs
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.backbone.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def batch(B=2, T=16, seed=0, pad=0, docs=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[0, -pad:] = 0  # right padding on the first row
    doc = torch.zeros(B, T, dtype=torch.long)
    if docs:
        doc[:, T // 2:] = 1  # two packed documents per row
    return {"input_ids": ids, "attention_mask": mask, "document_ids": doc}


# -- the ratio curriculum ----------------------------------------------------------------------

def test_curriculum_schedule_is_linear_in_tokens_per_concept():
    f = lambda s: scheduled_ratio(s, steps=100, target=0.25, start=1.0, warmup=0.4)  # noqa: E731
    assert f(0) == 1.0  # the start
    assert 1 / f(20) == pytest.approx((1 / 1.0 + 1 / 0.25) / 2)  # half way: k = 2.5 tokens per concept (not r = 0.625)
    assert 1 / f(10) == pytest.approx(1.75)
    assert f(40) == 0.25 and f(41) == 0.25 and f(99) == 0.25  # reached at 40% of the steps, then held
    assert all(f(s) >= f(s + 1) for s in range(99))  # monotone
    assert scheduled_ratio(0, 100, 0.25, start=1.0, warmup=0.0) == 0.25  # off: the target from step 0
    assert scheduled_ratio(0, 100, 0.25, start=0.5, warmup=1.0) == 0.5
    assert 1 / scheduled_ratio(50, 100, 0.25, start=0.5, warmup=1.0) == pytest.approx(3.0)


# -- the teacher ---------------------------------------------------------------------------------

def test_teacher_equals_the_plain_backbone_forward():
    model = concept.build(tiny_config())
    plain = copy.deepcopy(model.backbone)  # the HF model before any adapter
    with_lora(model, random_b=True)
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = plain(x, output_hidden_states=True)
        adapted = model.backbone(x).logits
    t = teacher_forward(model, x, needs={"logits", "deep_input", "final"})
    torch.testing.assert_close(t.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert t.at == sum(model.split[:2])
    torch.testing.assert_close(t.deep_input, ref.hidden_states[t.at], rtol=1e-5, atol=1e-5)  # input of layer Ls+Lm
    torch.testing.assert_close(model.backbone.model.norm(t.final), ref.hidden_states[-1], rtol=1e-5, atol=1e-5)
    assert (adapted - ref.logits).abs().max() > 1e-2  # negative control: with the adapters on it differs
    only = teacher_forward(model, x, needs={"deep_input"})  # alignment at the deep input: stops at layer Ls+Lm
    assert only.logits is None and only.final is None and torch.equal(only.deep_input, t.deep_input)
    assert not t.logits.requires_grad
    # padding and packed documents: the teacher uses the dense model's masks
    b = batch(pad=3, docs=True)
    dense = DenseModel(model.backbone)
    with torch.no_grad(), adapters_disabled(model.backbone):
        expected = dense(b["input_ids"], b["attention_mask"], document_ids=b["document_ids"]).logits
    got = teacher_forward(model, b["input_ids"], b["attention_mask"], b["document_ids"]).logits
    valid = b["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=0, atol=0)


@pytest.mark.parametrize("trainable", [True, False])
def test_adapters_disabled_restores_adapters_even_on_exception(trainable):
    model = with_lora(concept.build(tiny_config()), random_b=True)
    layers = tuner_layers(model.backbone)
    assert layers
    lora = [p for n, p in model.backbone.named_parameters() if "lora_" in n]
    for p in lora:
        p.requires_grad_(trainable)  # False: --train-only new (frozen adapters must stay frozen)
    x = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        before = model.backbone(x).logits
    with pytest.raises(RuntimeError, match="boom"):
        with adapters_disabled(model.backbone):
            assert all(layer.disable_adapters for layer in layers)
            raise RuntimeError("boom")
    assert not any(layer.disable_adapters for layer in layers)
    assert all(p.requires_grad == trainable for p in lora)
    with torch.no_grad():
        torch.testing.assert_close(model.backbone(x).logits, before, rtol=0, atol=0)


# -- distillation and alignment ------------------------------------------------------------------

def test_distill_kl_is_zero_when_the_student_is_the_teacher():
    model = concept.build(tiny_config())
    dense = DenseModel(with_lora(model).backbone)  # LoRA at init: B = 0, the student is the teacher
    b = batch(pad=2, docs=True)
    kd = DistillObjective(weight=1.0, temperature=2.0)
    out = dense(b["input_ids"], b["attention_mask"], b["input_ids"], b["document_ids"])
    teacher = teacher_forward(dense, b["input_ids"], b["attention_mask"], b["document_ids"])
    assert kd(dense, b, out, teacher).item() == pytest.approx(0.0, abs=1e-6)
    moved = DenseModel(with_lora(concept.build(tiny_config()), random_b=True).backbone)  # negative control
    out = moved(b["input_ids"], b["attention_mask"], b["input_ids"], b["document_ids"])
    value = kd(moved, b, out, teacher_forward(moved, b["input_ids"], b["attention_mask"], b["document_ids"]))
    assert value.item() > 1e-3 and value.requires_grad
    # by hand: weight * T^2 * mean over the CE's pairs of KL(p_teacher || p_student) at temperature T
    pair = next_token_pairs(b["attention_mask"].bool(), b["document_ids"])
    t = torch.log_softmax(teacher.logits[:, :-1][pair] / 2, -1)
    s = torch.log_softmax(out.logits[:, :-1][pair] / 2, -1)
    manual = 4 * (t.exp() * (t - s)).sum(-1).mean()
    assert value.item() == pytest.approx(manual.item(), rel=1e-5)
    assert int(pair.sum()) == 2 * 15 - 2 - 2  # padding and the document boundary drop their pairs


def test_align_distances():
    t = torch.randn(2, 6, 8)
    keep = torch.zeros(2, 6, dtype=torch.bool)
    keep[:, ::3] = True
    b = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "attention_mask": torch.ones(2, 6)}
    teacher = SimpleNamespace(deep_input=t, final=t)

    def out(x):
        return SimpleNamespace(deep_input=x, hidden=x, keep=keep, logits=x)

    mse, cos = AlignObjective(2.0, "deep-input", "mse"), AlignObjective(1.0, "final", "cosine")
    assert mse(None, b, out(t.clone()), teacher).item() == pytest.approx(0.0, abs=1e-7)
    assert mse(None, b, out(torch.zeros_like(t)), teacher).item() == pytest.approx(2.0)  # scale-free: zeros cost 1
    assert cos(None, b, out(3 * t), teacher).item() == pytest.approx(0.0, abs=1e-6)  # cosine ignores scale
    assert cos(None, b, out(-t), teacher).item() == pytest.approx(2.0, abs=1e-6)
    # deep-input compares tail positions only: a difference at concept positions costs nothing
    moved = t.clone()
    moved[keep] += 5.0
    assert mse(None, b, out(moved), teacher).item() == pytest.approx(0.0, abs=1e-7)
    assert AlignObjective(1.0, "final", "mse")(None, b, out(moved), teacher).item() > 0.1
    assert mse.teacher_needs == {"deep_input"} and cos.teacher_needs == {"final"}


def test_streaming_deep_input_alignment_trains_what_feeds_the_tail():
    model = with_lora(concept.build(tiny_config()))
    model.train()
    b = batch()
    keep = torch.zeros(2, 16, dtype=torch.bool)
    keep[:, 2::3] = True  # a concept every third token: the rest are tail tokens
    out = model(b["input_ids"], b["attention_mask"], keep=keep, labels=b["input_ids"], document_ids=b["document_ids"])
    assert torch.equal(out.keep, keep)
    teacher = teacher_forward(model, b["input_ids"], b["attention_mask"], b["document_ids"], needs={"deep_input"})
    value = AlignObjective(1.0)(model, b, out, teacher)
    assert value.item() > 0 and value.requires_grad
    value.backward()  # the tail states come from the shallow stack: its adapters get the gradient
    grads = {n: p.grad for n, p in model.backbone.named_parameters() if "lora_B" in n}
    shallow = [g for n, g in grads.items() if ".layers.0." in n or ".layers.1." in n]
    deep = [g for n, g in grads.items() if ".layers.4." in n or ".layers.5." in n]
    assert any(g is not None and g.abs().sum() > 0 for g in shallow)
    assert all(g is None or g.abs().sum() == 0 for g in deep)  # negative control: the deep stack is not on the path


# -- in the trainer -------------------------------------------------------------------------------

def interrupted_at_three(source, out, config):
    """Start a run, stop it with Ctrl-C after step 3 (the checkpoint is written on the way out) and
    return the trainer that resumes it."""
    first = Trainer.start(source, out, config)

    def interrupt_at_three(row):
        if row["step"] == 3:
            first.loop.on_sigint(None, None)

    with pytest.raises(KeyboardInterrupt):
        first.train(progress=interrupt_at_three)
    return Trainer.resume(out)


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_metrics_name_each_objective(built, corpus, tmp_path):  # noqa: F811
    cfg = small(data=str(corpus), steps=2, grad_accum=2, usage_weight=0.1, distill=0.5, distill_temperature=2.0,
                align=0.3, eval_every=100, checkpoint_every=100, tau_start=2.0, tau_end=1.5)
    trainer = Trainer.start(built, tmp_path / "run", cfg)
    # the sampler's temperature schedule and the ratio controller first: composed like the objectives, but they
    # add no term to the loss
    assert [o.name for o in trainer.objectives] == ["temperature", "ratio_control", "ratio_loss", "usage_kl",
                                                    "distill_kl", "align"]
    assert [o.adds_term for o in trainer.objectives] == [False, False, True, True, True, True]
    built_tau = trainer.model.sampler.tau  # (the build's: not a value of the schedule, so a missing one fails)
    trainer.train()
    # the temperature: linear from --tau-start at step 0 to --tau-end at the last step (the step-wise reference)
    assert [r["tau"] for r in rows(tmp_path / "run")] == [2.0 + (1.5 - 2.0) * s / (2 - 1) for s in range(2)]
    assert built_tau not in (2.0, 1.5)
    for r in rows(tmp_path / "run"):
        for key in ("loss", "total_loss", "ratio_loss", "usage_kl", "distill_kl", "align", "teacher_s",
                    "teacher_fraction", "target_ratio", "ratio"):
            assert key in r, key
        assert r["total_loss"] == pytest.approx(r["loss"] + r["ratio_loss"] + r["usage_kl"] + r["distill_kl"] + r["align"],
                                                rel=1e-5)
        assert r["distill_kl"] > 0 and r["align"] > 0 and 0 < r["teacher_fraction"] < 1
        assert "ratio_control" not in r  # a controller logs what it acts on (ratio, null_bias), not a term
    plain = Trainer.start(built, tmp_path / "plain", small(data=str(corpus), steps=1, ratio_control="pi",
                                                          eval_every=100))
    # nothing configured: the ratio controller alone, no term, no teacher
    assert [o.name for o in plain.objectives] == ["temperature", "ratio_control"] and not plain.teacher_needs
    plain.train()
    assert not {"distill_kl", "align", "teacher_s", "ratio_loss", "usage_kl"} & set(rows(tmp_path / "plain")[0])


def test_dense_baseline_with_distillation_starts_at_zero_kl(built, corpus, tmp_path):  # noqa: F811
    trainer = Trainer.start(built, tmp_path / "dense", small(data=str(corpus), steps=2, baseline="dense", distill=1.0,
                                                            lr=5e-2, eval_every=100))
    trainer.train()
    first, second = rows(tmp_path / "dense")
    assert first["distill_kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA at init: the student is the teacher
    assert second["distill_kl"] > 1e-6  # after one update it is not


def test_exact_resume_with_curriculum_and_distillation(built, corpus, tmp_path):  # noqa: F811
    def cfg():
        return small(data=str(corpus), ratio_warmup=0.5, ratio_start=1.0, target_ratio=0.25, distill=1.0,
                     distill_temperature=1.5, align=0.1, align_loss="cosine", eval_every=100, log_every=100)

    straight = Trainer.start(built, tmp_path / "straight", cfg())
    straight.train()
    targets = [r["target_ratio"] for r in rows(tmp_path / "straight")]
    assert targets == pytest.approx([1.0, 1 / 2.0, 1 / 3.0, 0.25, 0.25, 0.25])  # 6 steps, warm-up over 3
    again = interrupted_at_three(built, tmp_path / "resumed", cfg())
    assert again.config.ratio_warmup == 0.5 and again.config.distill == 1.0  # round trip through train.json
    again.train()
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    for key in ("loss", "distill_kl", "align", "target_ratio", "ratio", "null_bias"):
        assert [r[key] for r in a] == [r[key] for r in b], key  # bit for bit
    model = concept.load(tmp_path / "resumed")
    assert float(model.length_policy.target_ratio) == pytest.approx(0.25)  # saved with the final target


def test_train_only_new_keeps_the_adapters_frozen(built, corpus, tmp_path):  # noqa: F811
    cfg = small(data=str(corpus), steps=2, train_only="new", align=1.0, ce_weight=0.0, eval_every=100)
    trainer = Trainer.start(built, tmp_path / "run", cfg)
    assert "lora" not in [g["name"] for g in trainer.optimizer.param_groups]
    lora = {n: p.detach().clone() for n, p in trainer.model.backbone.named_parameters() if "lora_" in n}
    modules = {k: v.clone() for k, v in trainer.model.new_state_dict().items()}
    trainer.train()
    after = dict(trainer.model.backbone.named_parameters())
    assert lora and all(torch.equal(after[n], v) and not after[n].requires_grad for n, v in lora.items())
    assert any(not torch.equal(modules[k], v) for k, v in trainer.model.new_state_dict().items())
    assert all(r["loss"] > 0 and r["total_loss"] == pytest.approx(r["align"] + r.get("ratio_loss", 0), rel=1e-5)
               for r in rows(tmp_path / "run"))
    # a second stage from the first: everything trains, starting from its weights
    second = Trainer.start(tmp_path / "run", tmp_path / "stage2", small(data=str(corpus), steps=1, distill=1.0))
    assert "lora" in [g["name"] for g in second.optimizer.param_groups]


BAD = [
    (dict(ratio_warmup=1.5), "ratio-warmup"),
    (dict(ratio_warmup=-0.1), "ratio-warmup"),
    (dict(ratio_start=0.0), "ratio-start"),
    (dict(ratio_start=1.2), "ratio-start"),
    (dict(ratio_start=0.2, target_ratio=0.25, ratio_warmup=0.5), "below it"),
    (dict(distill=-1.0), "distill: must be >= 0"),
    (dict(distill=float("nan")), "distill: must be a finite number"),
    (dict(align=-0.5), "align: must be >= 0"),
    (dict(distill_temperature=0.0), "distill-temperature"),
    (dict(ce_weight=0.0), "nothing to train"),
    (dict(align=1.0, align_at="middle"), "align-at"),
    (dict(align=1.0, align_loss="l1"), "align-loss"),
    (dict(baseline="dense", align=1.0), "no deep stack"),
    (dict(baseline="pruned", align=1.0, align_at="deep-input"), "no deep stack"),
    (dict(baseline="dense", train_only="new"), "no new modules"),
    (dict(train_only="some"), "train-only"),
    (dict(baseline="sparse"), "baseline: dense or pruned"),
    (dict(prune_layers="1:3"), "only for --baseline pruned"),
    (dict(baseline="pruned", prune_layers="2:9"), "the backbone has 4 layers"),
    (dict(baseline="pruned", prune_layers="0:4"), "keep at least one"),
    (dict(baseline="pruned", prune_layers="3:1"), "START < STOP"),
    (dict(baseline="pruned", prune_layers="middle"), "START:STOP"),
]


@pytest.mark.parametrize("options,message", BAD, ids=[f"{k}" for k, _ in BAD])
def test_bad_recipe_input_fails_before_anything_is_written(built, corpus, tmp_path, options, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        Trainer.start(built, tmp_path / "out", small(data=str(corpus), **options))
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "precious.txt").write_text("x")
    with pytest.raises(ConfigError, match=message):  # even --force replaces nothing
        Trainer.start(built, tmp_path / "kept", small(data=str(corpus), **options), force=True)
    assert (tmp_path / "kept" / "precious.txt").read_text() == "x"


def test_allowed_recipes_validate():
    for options in (dict(baseline="dense", distill=1.0), dict(baseline="pruned", distill=1.0, align=1.0, align_at="final"),
                    dict(ce_weight=0.0, distill=1.0), dict(ratio_start=0.5, ratio_warmup=1.0, target_ratio=0.5)):
        assert TrainConfig(**options).validate(num_layers=4) == [], options


def test_train_json_round_trip_and_old_files():
    cfg = TrainConfig(distill=0.5, distill_temperature=2.0, align=0.1, align_at="final", align_loss="cosine",
                      train_only="new", ratio_start=0.5, ratio_warmup=0.3, baseline=None, ce_weight=0.5)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    pruned = TrainConfig(baseline="pruned", prune_layers="1:3")
    assert TrainConfig.from_dict(pruned.to_dict()) == pruned
    old = {k: v for k, v in TrainConfig().to_dict().items()
           if k not in {"distill", "distill_temperature", "align", "align_at", "align_loss", "train_only", "ratio_start",
                        "ratio_warmup", "prune_layers", "ce_weight"}}
    assert TrainConfig.from_dict({**old, "baseline": True}).baseline == "dense"  # train.json before `pruned` existed
    loaded = TrainConfig.from_dict({**old, "baseline": False})
    assert loaded.baseline is None and loaded.distill == 0.0 and loaded.ratio_warmup == 0.0 and loaded.train_only == "all"
    assert TrainConfig(baseline=True).baseline == "dense"  # the Python API too
