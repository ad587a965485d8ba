"""The dense and pruned baselines as families chosen at build time (``concept.baselines``, issue 41 item 3):
``concept build --family dense|pruned`` makes a run that builds, trains, resumes exactly, evaluates, generates
and inspects like any family's, with no streaming option in its folder or ``inspect``; a baseline run written
before they were families (train.json ``"baseline": "pruned"``, concept.json of the source's build) still loads,
evaluates, generates, exports and resumes (``concept.migrate``). Negative control: without the migration that
older folder loads as the streaming model it was derived from."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

import concept
from concept import fingerprint
from concept.dense import DenseModel
from concept.errors import ConceptError
from concept.training import Trainer
from concept_cli.main import cli
from tests.test_third_family import losses
from tests.test_third_family_installed import streaming_names_in
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--backbone", "tiny-llama", *(f for kv in ("layers=4", "hidden=32", "heads=2", "kv_heads=1", "intermediate=64")
                                      for f in ("--set", f"backbone.{kv}"))]
SECTIONS = {"pruned": ["--set", "pruned.layers=1:3"], "dense": ["--set", "dense.mtp_heads=2"]}


def invoke(*args, code: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def interrupted_then_resumed(built, out, config):
    """A run stopped by Ctrl-C at step 2 (its checkpoint written on the way out), then resumed to the end."""
    first = Trainer.start(built, out, config)
    with pytest.raises(KeyboardInterrupt):
        first.train(progress=lambda row: row["step"] == 2 and first.loop.on_sigint(None, None))
    Trainer.resume(out).train()


@pytest.mark.parametrize("name", ["pruned", pytest.param("dense", marks=pytest.mark.slow)])
def test_a_family_run_builds_trains_resumes_exactly_evaluates_generates_and_inspects(name, corpus, tmp_path):  # noqa: F811
    built = tmp_path / "built"
    invoke("build", "--family", name, *TINY, *SECTIONS[name], "-o", built)
    config = small(data=str(corpus), steps=4, eval_every=4, checkpoint_every=2, lr=1e-2)
    straight = Trainer.start(built, tmp_path / "straight", config)
    straight.train()
    interrupted_then_resumed(built, tmp_path / "resumed", config)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")  # bit for bit

    model = concept.load(tmp_path / "straight")
    assert isinstance(model, DenseModel) and model.removed == ((1, 3) if name == "pruned" else None)
    assert (model.mtp_heads is not None) == (name == "dense")
    prompts = [[5, 6, 7, 8], [9, 10]]
    for prompt, tokens in zip(prompts, model.generate(prompts, max_new_tokens=5).tokens):
        with torch.no_grad():  # cached decoding = teacher forcing (the pruned model skips the same layers)
            forced = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].argmax(-1)
        assert tokens == forced.tolist()
    evaluated = json.loads(invoke("eval", tmp_path / "straight", "--batches", 1, "--batch", 2, "--json").stdout)
    assert evaluated["model"] == name
    shown = invoke("inspect", tmp_path / "straight", "--json").stdout
    assert json.loads(shown)["baseline"]["removed_layers"] == ([1, 3] if name == "pruned" else None)
    for text in (shown, *(f.read_text() for run in (built, tmp_path / "straight") for f in run.rglob("*.json"))):
        # no streaming option written or shown (align_at: the dense family reads it too, for --align-at final)
        assert [n for n in streaming_names_in(text) if n != "align_at"] == []


def test_a_pruned_build_is_checked_with_the_fix(tmp_path):
    assert "pruned.layers: which layers to skip" in invoke("build", "--family", "pruned", *TINY, "--dry-run",
                                                            code=2).stderr
    r = invoke("build", "--family", "pruned", *TINY, "--set", "pruned.layers=0:4", "--dry-run", code=2)
    assert "pruned.layers 0:4: that removes all 4 layers; keep at least one" in r.stderr
    r = invoke("build", "--family", "dense", *TINY, "--set", "vocabulary.size=8", "--dry-run", code=2)
    assert "Traceback" not in r.output


def older_layout(new, old, source):
    """``new`` (a pruned run derived with --baseline) copied to ``old`` as a version before the baseline families
    wrote it: concept.json the source build's, its modules file the source's, train.json naming the baseline and
    its block, the checkpoint fingerprinting the source build."""
    shutil.copytree(new, old)
    record = json.loads((new / "concept.json").read_text())
    section = record["config"]["pruned"]
    source_record = json.loads((source / "concept.json").read_text())
    (old / "concept.json").write_text(json.dumps(source_record))
    shutil.copy(source / "modules.safetensors", old / "modules.safetensors")
    train = json.loads((new / "train.json").read_text())
    train.update(baseline="pruned", prune_layers="1:3", mtp_heads=0, target_ratio=0.25,
                 pruned={k: v for k, v in section["matched"].items() if k not in ("about",)})
    (old / "train.json").write_text(json.dumps(train))
    state = json.loads((old / "checkpoint" / "state.json").read_text())
    state["fingerprints"]["build"] = fingerprint.of_config(section["baseline_of"])
    (old / "checkpoint" / "state.json").write_text(json.dumps(state))


@pytest.fixture(scope="module")
def older(built, corpus, tmp_path_factory):  # noqa: F811
    """(a pruned run derived today, the same run as an older version wrote it)."""
    folder = tmp_path_factory.mktemp("older")
    new, old = folder / "new", folder / "old"
    Trainer.start(built, new, small(data=str(corpus), steps=2, baseline="pruned", prune_layers="1:3")).train()
    older_layout(new, old, built)
    assert json.loads((old / "concept.json").read_text())["config"]["family"] == "streaming"
    return new, old


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def test_an_older_baseline_run_loads_as_today_s(older, monkeypatch):
    new, old = older
    model = concept.load(old)
    assert isinstance(model, DenseModel) and model.removed == (1, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, concept.load(new)(IDS).logits, rtol=0, atol=0)
    # negative control: read without the migration, it is the streaming build it was derived from
    monkeypatch.setattr("concept.migrate._baseline_of", lambda train: None)
    try:
        loaded = concept.load(old)
    except ConceptError:  # (its files do not fit the streaming model)
        loaded = None
    assert not isinstance(loaded, DenseModel)


@pytest.mark.slow
def test_an_older_baseline_run_evaluates_generates_exports_and_resumes(older, tmp_path):
    new, old = older
    today = concept.load(new)
    assert json.loads(invoke("eval", old, "--batches", 1, "--batch", 2, "--json").stdout)["model"] == "pruned"
    invoke("generate", old, "--prompt", "def f(", "--max-new-tokens", 4)
    invoke("export", old, "-o", tmp_path / "exported")
    with torch.no_grad():
        torch.testing.assert_close(concept.load(tmp_path / "exported")(IDS).logits, today(IDS).logits, rtol=1e-5,
                                   atol=1e-5)
    for run in (new, old):
        Trainer.resume(run, steps=3).train()
    assert losses(old) == losses(new)
    # its train.json no longer names the baseline: its concept.json was written in today's format with it
    assert json.loads((old / "concept.json").read_text())["config"]["family"] == "pruned"
    with torch.no_grad():
        torch.testing.assert_close(concept.load(old)(IDS).logits, concept.load(new)(IDS).logits, rtol=0, atol=0)


def test_the_pruned_block_matches_what_the_source_family_says_its_model_costs():
    """``--baseline pruned``'s block comes from the source family's ``matched_flops`` (the streaming model's ideal
    FLOPs): the same block and target as ``concept.flops.matched_prune`` of that split. Negative control: a family
    without an operating point to match (the base's default) is refused with the fix."""
    from concept.baselines import prune_plan
    from concept.config import BuildConfig, ComponentRef
    from concept.contracts import Family
    from concept.flops import Shape, matched_prune
    from concept.train_config import TrainConfig
    from concept_plugins.backbones.tiny_llama import TinyConfig, TinyLlamaBackbone

    tiny = {"layers": 8, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64}
    plan = concept.resolve(BuildConfig(backbone=ComponentRef("tiny-llama", tiny), split="2,4,2",
                                       vocabulary=ComponentRef("embedding", {"size": 32})))
    config = TrainConfig(baseline="pruned", target_ratio=0.25, seq_len=256)
    prune, about = prune_plan(config, plan)
    shape = Shape.from_hf_config(TinyLlamaBackbone.hf_config(TinyConfig(**tiny)))
    expected = matched_prune(shape, (2, 4, 2), 33, 0.25, 256)  # 32 codes + NULL
    assert (prune.removed, prune.target_flop_ratio) == (expected.removed, pytest.approx(expected.target_flop_ratio))
    assert prune.removed[0] == 2 and "target ratio 0.25 (split 2,4,2)" in about
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(plan.family_object), "matched_flops", Family.matched_flops)
        with pytest.raises(ConceptError, match="choose the block with --prune-layers"):
            prune_plan(config, plan)


def test_every_built_model_names_its_family_the_baselines_too():
    """Every family's model carries ``family`` (``Family.build``'s contract), the dense and pruned baselines' too:
    ``family_of`` answers for each with no special case, and the core's decoding and compile check go through the
    family (``Dense.decoder``, ``Dense.compile_refusal``). A ``DenseModel`` made by hand names its family by the
    layers it runs. Negative control: a ``DenseModel`` without ``family`` (as before) is no family's."""
    from concept.compiled import compile_refusal
    from concept.config import BuildConfig, ComponentRef
    from concept.decoding import DenseDecoder
    from concept.families import family_of
    from concept.generation import GenerationSettings, _decoder

    from .test_planner_executor import pe_config

    backbone = ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64})
    configs = {"streaming": BuildConfig(backbone=backbone, split="1,2,1"), "planner-executor": pe_config(),
               "dense": BuildConfig(backbone=backbone, family="dense"),
               "pruned": BuildConfig(backbone=backbone, family="pruned", sections={"pruned": {"layers": [1, 3]}})}
    for name, config in configs.items():
        model = concept.build(config)
        assert model.family == name and family_of(model).name == name
    by_hand = {DenseModel(model.backbone): "dense", DenseModel(model.backbone, removed=(1, 3)): "pruned"}
    for dense, name in by_hand.items():
        assert family_of(dense).name == name and compile_refusal(dense) is None
        assert isinstance(_decoder(dense, GenerationSettings(), 4), DenseDecoder)
    with pytest.MonkeyPatch.context() as mp:  # negative control: a DenseModel without it, as before
        mp.delattr(DenseModel, "family")
        with pytest.raises(AttributeError, match="family"):
            family_of(DenseModel(model.backbone))
