"""The pruned FLOP-matched baseline: the dense backbone minus a contiguous block of middle layers
(``concept train --baseline pruned``)."""
import copy
import json

import pytest
import torch
from click.testing import CliRunner
from concept_cli.main import cli

import concept
from concept.baselines import describe_prune
from concept.dense import DenseModel
from concept.flops import (
    Shape,
    evenly_spaced_keep,
    forward_flops,
    matched_prune,
    pruned_flops,
)
from concept.training import Trainer
from tests.conftest import tiny_config
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)

SMOLLM2 = Shape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)


def test_pruned_flops_and_the_chosen_block():
    keep = evenly_spaced_keep(128, 0.25)
    full = forward_flops(SMOLLM2, (4, 22, 4), keep, 4097)
    assert pruned_flops(SMOLLM2, 30, 128) == pytest.approx(full.dense)  # all layers kept: the dense cost
    per_layer = pruned_flops(SMOLLM2, 11, 128) - pruned_flops(SMOLLM2, 10, 128)
    assert pruned_flops(SMOLLM2, 20, 128) - pruned_flops(SMOLLM2, 10, 128) == pytest.approx(10 * per_layer)  # linear
    plan = matched_prune(SMOLLM2, (4, 22, 4), 4097, 0.25, 128)
    # the closest whole number of layers to the streaming model's ideal FLOPs (brute force)
    best = min(range(1, 31), key=lambda n: abs(pruned_flops(SMOLLM2, n, 128) - full.concept))
    assert plan.kept == best == 14 and plan.met
    assert plan.removed == (4, 20)  # 16 layers from the start of the middle stack 4..25
    assert plan.target_flop_ratio == pytest.approx(full.ratio)
    assert plan.flop_ratio == pytest.approx(pruned_flops(SMOLLM2, 14, 128) / full.dense)
    assert abs(plan.flop_ratio - plan.target_flop_ratio) <= plan.layer_share / 2
    milder = matched_prune(SMOLLM2, (4, 22, 4), 4097, 0.5, 128)
    assert milder.kept > plan.kept and milder.removed[0] >= 4 and milder.removed[1] <= 26  # inside the middle stack
    by_hand = matched_prune(SMOLLM2, (4, 22, 4), 4097, 0.25, 128, removed=(10, 20))
    assert by_hand.removed == (10, 20) and by_hand.kept == 20
    assert by_hand.flop_ratio == pytest.approx(pruned_flops(SMOLLM2, 20, 128) / full.dense)


def test_a_target_whole_layers_cannot_reach_is_reported():
    tiny = Shape(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, vocab=256)
    # a concept head of 4097 classes on a 32-wide model costs more than the layers it saves
    plan = matched_prune(tiny, (1, 2, 1), 4097, 0.9, 32)
    assert plan.target_flop_ratio > 1 and plan.kept == 4 and plan.removed[0] == plan.removed[1] and not plan.met
    text = describe_prune(plan, "the streaming model's ideal")
    assert "cannot reach" in text and "4 kept" in text
    ok = matched_prune(tiny, (1, 2, 1), 33, 0.25, 32)
    assert ok.met and "cannot reach" not in describe_prune(ok, "the streaming model's ideal")


def test_pruned_model_equals_the_backbone_without_those_layers():
    model = concept.build(tiny_config())
    pruned = DenseModel(model.backbone, removed=(2, 4))
    assert pruned.family == "pruned" and len(pruned.layers) == 4 and DenseModel(model.backbone).family == "dense"
    reference = copy.deepcopy(model.backbone)
    del reference.model.layers[2:4]
    reference.config.num_hidden_layers = 4
    x = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(pruned(x).logits, reference(x, use_cache=False).logits, rtol=1e-5, atol=1e-5)
        assert (DenseModel(model.backbone)(x).logits - reference(x, use_cache=False).logits).abs().max() > 1e-3  # negative control
    assert len(model.backbone.model.layers) == 6  # the backbone keeps every layer (the teacher runs them)
    for removed in ((0, 2), (4, 6)):  # cached decoding = teacher forcing, whichever block is skipped
        p = DenseModel(model.backbone, removed=removed).eval()
        gen = p.generate(x, max_new_tokens=3, output_logits=True)
        n = len(gen.tokens[0])
        with torch.no_grad():
            forced = p(torch.cat([x[:1], torch.tensor([gen.tokens[0]])], dim=1)).logits[0, 9:9 + n]
        torch.testing.assert_close(gen.logits[0, :n], forced, rtol=1e-4, atol=1e-4)
    assert [layer.self_attn.layer_idx for layer in model.backbone.model.layers] == list(range(6))  # restored
    with pytest.raises(ValueError, match=r"removed layers \(3, 9\) are not a block of the backbone's 6 layers"):
        DenseModel(model.backbone, removed=(3, 9))


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_pruned_run_trains_loads_generates_and_evaluates(built, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "pruned"
    trainer = Trainer.start(built, out, small(data=str(corpus), steps=2, baseline="pruned", distill=1.0,
                                              align=0.5, align_at="final", lr=1e-2))
    assert any(n.startswith("pruned baseline: layers 1..2 removed") for n in trainer.notes), trainer.notes
    assert trainer.model.removed == (1, 3)
    frozen = [p for n, p in trainer.model.backbone.named_parameters() if "lora_" in n and ".layers.1." in n]
    assert frozen and not any(p.requires_grad for p in frozen)  # the skipped layers' adapters are not trained
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["distill_kl"] > 0  # the teacher runs all 4 layers, the student 2: they differ from step 1
    built_as = json.loads((out / "concept.json").read_text())["config"]  # a run of the pruned family
    assert built_as["family"] == "pruned" and built_as["pruned"]["layers"] == [1, 3]
    assert built_as["pruned"]["matched"]["kept_layers"] == 2 and 0 < built_as["pruned"]["matched"]["flop_ratio"] < 1
    assert built_as["pruned"]["baseline_of"] == concept.load(built).resolution.config.to_dict()
    assert not {"baseline", "pruned", "prune_layers", "target_ratio"} & set(json.loads((out / "train.json").read_text()))

    model = concept.load(out)
    assert isinstance(model, DenseModel) and model.family == "pruned" and model.removed == (1, 3)
    ids = torch.randint(0, 256, (1, 12))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer.model(ids).logits, rtol=0, atol=0)
    # cached decoding runs the same two layers: its logits are the teacher-forced ones
    gen = model.generate(ids, max_new_tokens=4, output_logits=True)
    n = len(gen.tokens[0])
    full = torch.cat([ids, torch.tensor([gen.tokens[0]])], dim=1)
    with torch.no_grad():
        forced = model(full).logits[0, 11:11 + n]
    torch.testing.assert_close(gen.logits[0, :n], forced, rtol=1e-4, atol=1e-4)
    assert len(model.backbone.model.layers) == 4  # restored after generation

    r = run("eval", out, built, "--batches", 1, "--batch", 2, "--no-controls")
    assert r.exit_code == 0, r.output
    assert "pruned" in r.stdout and "streaming" in r.stdout
    r = run("eval", out, "--batches", 1, "--batch", 2, "--json")
    assert json.loads(r.stdout)["model"] == "pruned"

    again = Trainer.resume(out, steps=3)  # resumes with the same block
    assert again.model.removed == (1, 3)


def test_cli_pruned_baseline_options(built, corpus, tmp_path):  # noqa: F811
    fast = ["--data", corpus, "--steps", 1, "--seq-len", 32, "--batch", 2, "--lora-rank", 2, "--eval-batches", 1]
    r = run("train", built, "--baseline", "pruned", "--prune-layers", "2:3", *fast, "--out", tmp_path / "p")
    assert r.exit_code == 0, r.output
    assert "layers 2..2 removed" in r.stderr and "set by --prune-layers" in r.stderr
    assert json.loads((tmp_path / "p" / "concept.json").read_text())["config"]["pruned"]["layers"] == [2, 3]
    r = run("train", built, "--baseline", *fast, "--out", tmp_path / "d")  # a bare --baseline is still dense
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "d" / "concept.json").read_text())["config"]["family"] == "dense"
    r = run("train", built, "--prune-layers", "1:2", *fast, "--out", tmp_path / "x")
    assert r.exit_code == 2 and "only for --baseline pruned" in r.stderr and not (tmp_path / "x").exists()
    r = run("train", built, "--baseline", "pruned", "--align", 1, *fast, "--out", tmp_path / "y")
    assert r.exit_code == 2 and "no deep stack" in r.stderr and not (tmp_path / "y").exists()
    r = run("train", built, "--ratio-warmup", 2, *fast, "--out", tmp_path / "z")
    assert r.exit_code == 2 and "ratio-warmup" in r.stderr and not (tmp_path / "z").exists()
