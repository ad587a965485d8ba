"""LoRA adapters as standard peft adapter folders: ``PeftModel.from_pretrained`` on the plain transformers
backbone gives the trained baseline's logits."""
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

import concept
from concept import BuildConfig
from concept.builder import read_run
from concept.config import resolve
from concept.errors import ConceptError, RunFolderError
from concept.lora import (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, LoraSettings, add_lora, load_peft_adapter,
                          lora_state_dict, peft_adapter_state, save_peft_adapter)
from concept.training import Trainer
from tests.conftest import tiny_config
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)


def plain_backbone(run):
    """A fresh plain transformers model of the run's backbone (no concept attention routing, no LoRA)."""
    plan = resolve(BuildConfig.from_dict(read_run(run)["config"]))
    bb = plan.components["backbone"]
    model = bb.cls.load(bb.config).model
    if (run / "backbone.safetensors").is_file():  # random tiny backbones travel with the run
        model.load_state_dict(load_file(run / "backbone.safetensors"))
    return model.eval()


def lora_b_is_nonzero(backbone) -> bool:
    return any(float(v.abs().max()) > 0 for k, v in lora_state_dict(backbone).items() if "lora_B" in k)


@pytest.fixture(scope="module")
def dense_run(built, corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("peft") / "dense"
    Trainer.start(built, out, small(data=str(corpus), baseline="dense", steps=2, lr=1e-2, eval_every=2,
                                    checkpoint_every=2, lora=LoraSettings(rank=2, alpha=4))).train()
    return out


def test_trained_dense_baseline_equals_peft_on_the_plain_backbone(dense_run, tmp_path):
    dense = concept.load(dense_run)
    assert dense.family == "dense" and lora_b_is_nonzero(dense.backbone)  # training moved the adapters off zero
    folder = save_peft_adapter(dense.backbone, tmp_path / "adapter", base_model_name_or_path="tiny")
    assert {p.name for p in folder.iterdir()} >= {PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE}
    keys = list(load_file(folder / PEFT_WEIGHTS_FILE))
    assert keys and all(k.startswith("base_model.model.model.layers.") and ".default." not in k for k in keys)
    config = json.loads((folder / PEFT_CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["base_model_name_or_path"] == "tiny"
    assert config["task_type"] == "CAUSAL_LM" and config["target_modules"] == sorted(config["target_modules"])

    plain = plain_backbone(dense_run)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = plain(ids).logits
        peft_model = PeftModel.from_pretrained(plain, str(folder)).eval()
        assert type(peft_model).__name__ == "PeftModelForCausalLM"
        theirs = peft_model(ids).logits
        ours = dense(ids).logits
    assert (theirs - base).abs().max() > 1e-3  # the adapters matter: this is not the backbone alone
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-qwen2"])
def test_random_adapters_roundtrip_through_peft_and_back(backbone, tmp_path):
    """Nonzero (random) lora_B on every target, attention and MLP: peft on the plain backbone, and
    ``load_peft_adapter`` back into a concept backbone, both give the same logits."""
    from concept.dense import DenseModel

    model = concept.build(tiny_config(backbone=backbone))
    add_lora(model.backbone, LoraSettings(rank=3, alpha=6))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    dense = DenseModel(model.backbone).eval()
    folder = save_peft_adapter(model.backbone, tmp_path / "adapter")
    state, back = lora_state_dict(model.backbone), peft_adapter_state(folder)  # concept's own keys again
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)

    fresh = concept.build(tiny_config(backbone=backbone))  # same seed: the same random backbone
    plain = fresh.resolution.components["backbone"].cls.load(fresh.resolution.components["backbone"].config).model.eval()
    ids = torch.randint(0, 97, (2, 16), generator=g)
    with torch.no_grad():
        ours = dense(ids).logits
        theirs = PeftModel.from_pretrained(plain, str(folder)).eval()(ids).logits
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
        settings = load_peft_adapter(fresh.backbone, folder)
        assert (settings.rank, settings.alpha) == (3, 6.0)
        assert set(settings.targets.split(",")) == set(LoraSettings().targets.split(","))
        torch.testing.assert_close(DenseModel(fresh.backbone).eval()(ids).logits, ours, atol=0, rtol=0)
    trainable = [n for n, p in fresh.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_pruned_baseline_adapter_covers_the_kept_layers(built, corpus, tmp_path):  # noqa: F811
    run = tmp_path / "pruned"
    Trainer.start(built, run, small(data=str(corpus), baseline="pruned", prune_layers="1:3", steps=2, lr=1e-2,
                                    eval_every=2, checkpoint_every=2)).train()
    pruned = concept.load(run)
    assert pruned.removed == (1, 3) and lora_b_is_nonzero(pruned.backbone)
    folder = save_peft_adapter(pruned.backbone, tmp_path / "adapter", removed=pruned.removed)
    config = json.loads((folder / PEFT_CONFIG_FILE).read_text())
    assert config["layers_to_transform"] == [0, 3]
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in load_file(folder / PEFT_WEIGHTS_FILE)}
    assert layers == {0, 3}  # the removed layers' adapters (never trained) are left out

    peft_model = PeftModel.from_pretrained(plain_backbone(run), str(folder)).eval()
    inner = peft_model.base_model.model
    del inner.model.layers[1:3]  # the pruned baseline: the full backbone minus layers 1..2
    inner.config.num_hidden_layers = 2
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids, use_cache=False).logits, pruned(ids).logits, atol=1e-5, rtol=1e-5)


def test_bad_adapter_folders(tmp_path):
    model = concept.build(tiny_config())
    with pytest.raises(ConceptError, match="no LoRA adapters"):
        save_peft_adapter(model.backbone, tmp_path / "none")
    with pytest.raises(RunFolderError, match="not a peft adapter folder"):
        load_peft_adapter(model.backbone, tmp_path)
    other = concept.build(tiny_config(backbone="tiny-llama"))
    add_lora(other.backbone, LoraSettings(rank=2, targets="q_proj"))
    folder = save_peft_adapter(other.backbone, tmp_path / "a")
    config = json.loads((folder / PEFT_CONFIG_FILE).read_text())
    config["r"] = 5  # the weights say rank 2
    (folder / PEFT_CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(RunFolderError, match="does not fit"):
        load_peft_adapter(concept.build(tiny_config()).backbone, folder)


def test_a_run_with_only_a_peft_adapter_folder_loads_it(dense_run, tmp_path):
    """What a trainer may write next to its checkpoint (RUN/adapter/): concept.load reads it when the run
    has no adapter.safetensors (the checkpoint's, when present, stays the newest weights)."""
    import shutil

    from concept.builder import PEFT_ADAPTER_DIR

    model = concept.load(dense_run)
    copy = tmp_path / "run"
    shutil.copytree(dense_run, copy)
    save_peft_adapter(model.backbone, copy / PEFT_ADAPTER_DIR)
    again = concept.load(copy)  # checkpoint adapter (and the peft copy beside it)
    (copy / "checkpoint" / "adapter.safetensors").unlink()
    only_peft = concept.load(copy)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for other in (again, only_peft):
            torch.testing.assert_close(other(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_adapter_folder_is_replaced_whole_or_not_at_all(dense_run, tmp_path, monkeypatch):
    """Training leaves RUN/adapter/ as a peft folder; a write that fails midway (a full disk) keeps
    the previous folder as it was and leaves no temporary folder behind."""
    import safetensors.torch

    folder = dense_run / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = concept.build(tiny_config())
    add_lora(model.backbone, LoraSettings(rank=2))
    target = save_peft_adapter(model.backbone, tmp_path / "adapter")
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError):
        save_peft_adapter(model.backbone, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]
