"""Hugging Face interop: transformers classes in every export (``AutoModelForCausalLM`` with remote code gives
``concept.load``'s logits), ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` against a folder standing
in for the hub, hub ids in ``concept.load``, the model card's metadata, peft's ``AutoPeftModelForCausalLM`` on the
adapter, the pruned export loadable by plain transformers, component names and prompts as strings.

Every model here is made in memory (tiny random backbones, LoRA adapters made to count): no training."""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import concept
from concept import BuildConfig, ComponentRef
from concept.builder import build_backbone
from concept.dense import DenseModel
from concept.errors import ConceptError, ConfigError, RunFolderError
from concept.lora import LoraSettings, add_lora
from concept.tokens import tokenizer_for
from concept_cli.main import cli

from .conftest import mix_decisions, randomize_new_modules
from .test_planner_executor import built as planner_executor

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64}
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def with_lora(model):
    add_lora(model.backbone, LoraSettings(rank=2))
    with torch.no_grad():  # LoRA B starts at 0: make the adapters count
        for name, p in model.backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def streaming():
    torch.manual_seed(0)
    config = BuildConfig(backbone=ComponentRef("tiny-llama", TINY), split="1,2,1", attention=ComponentRef("sdpa"),
                         vocabulary=ComponentRef("embedding", {"size": 32}))
    return with_lora(mix_decisions(randomize_new_modules(concept.build(config))))


@pytest.fixture(scope="module")
def exported(streaming, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "streaming-export"
    result = streaming.save_pretrained(folder)
    return folder, result


def test_auto_model_opens_the_concept_model_with_its_logits(streaming, exported):
    folder, result = exported
    assert result.kind == "streaming" and result.lora == "adapter" and result.check["max_abs_diff"] == 0.0
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_concept.ConceptStreamingConfig",
                                  "AutoModelForCausalLM": "modeling_concept.ConceptStreamingForCausalLM"}
    assert config["concept_kind"] == "streaming" and config["num_hidden_layers"] == 4
    assert (folder / "modeling_concept.py").read_text() == (Path(concept.__file__).parent / "hf" / "modeling_concept.py").read_text()

    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(hf).__name__ == "ConceptStreamingForCausalLM"
    assert type(hf).__module__.startswith("transformers_modules.")  # the code shipped in the folder, not the library's
    assert AutoConfig.from_pretrained(folder, trust_remote_code=True).concept_kind == "streaming"
    expected = logits(concept.load(folder))
    torch.testing.assert_close(logits(hf), expected, atol=0, rtol=0)
    torch.testing.assert_close(expected, logits(streaming), atol=1e-6, rtol=0)  # and the model that was saved
    with torch.no_grad():
        out = hf(IDS, labels=IDS)
        assert torch.equal(out.keep, streaming(IDS).keep) and out.loss > 0
        torch.testing.assert_close(out.loss, streaming(IDS, labels=IDS).loss)
    assert hf.generate("def f(x):", max_new_tokens=6) == concept.generate(streaming, "def f(x):", max_new_tokens=6)
    sequences = hf.generate(IDS[:1, :5], max_new_tokens=3)
    assert sequences.shape == (1, 8) and torch.equal(sequences[:, :5], IDS[:1, :5])

    # negative controls: the plain backbone, or the export with one concept module changed, give other logits
    plain = AutoModelForCausalLM.from_pretrained(folder / "backbone")
    assert (logits(plain) - expected).abs().max() > 1e-2
    g = torch.Generator().manual_seed(1)
    modules = {k: v + torch.randn(v.shape, generator=g) for k, v in load_file(folder / "modules.safetensors").items()}
    broken = folder.parent / "broken"
    hf.save_pretrained(broken)  # (the wrapper writes an export folder too)
    save_file(modules, broken / "modules.safetensors")
    changed = logits(AutoModelForCausalLM.from_pretrained(broken, trust_remote_code=True))
    assert (changed - expected).abs().max() > 1e-3


def test_card_metadata_and_the_adapter_base(exported):
    folder, _ = exported
    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "text-generation" and card.data.license == "apache-2.0"
    assert card.data.base_model is None  # a randomly initialised backbone has none
    assert "trust_remote_code=True" in card.text and "concept.load" in card.text
    from transformers.dynamic_module_utils import get_imports

    # transformers checks these before running the folder's code: without `concept` it names the package to install
    assert "concept" in get_imports(folder / "modeling_concept.py")
    adapter = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((folder / "backbone").resolve())  # resolves: not "llama-tiny"
    assert concept.hub.provenance({"name": "smollm2", "params": {}}) == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}
    assert concept.hub.provenance({"name": "hf", "params": {"path": "org/model"}})["base_model"] == "org/model"


def test_planner_executor_through_transformers(tmp_path):
    model = planner_executor()
    model.save_pretrained(tmp_path / "pe")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "pe", trust_remote_code=True)
    assert type(hf).__name__ == "ConceptPlannerExecutorForCausalLM"
    torch.testing.assert_close(logits(hf), logits(model), atol=1e-6, rtol=0)
    with pytest.raises(ConceptError, match="holds a planner-executor model"):
        concept.ConceptModel.from_pretrained(tmp_path / "pe")


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A pruned baseline made in memory (layers 1..2 of 5 skipped) with LoRA, exported with the adapter and merged."""
    plan = concept.resolve(BuildConfig(backbone=ComponentRef("tiny-llama", {**TINY, "layers": 5}), split="1,3,1"))
    model = with_lora(DenseModel(build_backbone(plan).model, resolution=plan, removed=(1, 3)))
    folder = tmp_path_factory.mktemp("pruned")
    model.save_pretrained(folder / "adapter-export")
    model.save_pretrained(folder / "merged-export", merge_lora=True)
    return model, folder


def test_pruned_export_deletes_its_layers_and_loads_with_plain_transformers(pruned):
    from peft import AutoPeftModelForCausalLM

    model, folder = pruned
    expected = logits(model)
    for name in ("adapter-export", "merged-export"):
        config = json.loads((folder / name / "backbone" / "config.json").read_text())
        assert config["num_hidden_layers"] == 3
        assert len(load_file(folder / name / "backbone" / "model.safetensors")) < len(model.backbone.state_dict())
        again = concept.load(folder / name)
        assert again.family == "pruned" and again.deleted == (1, 3) and len(again.layers) == 3
        hf = AutoModelForCausalLM.from_pretrained(folder / name, trust_remote_code=True)
        assert type(hf).__name__ == "ConceptBaselineForCausalLM"
        torch.testing.assert_close(logits(hf), expected, atol=1e-5, rtol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged-export" / "backbone")  # plain transformers
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=1e-5)
    with_adapter = AutoPeftModelForCausalLM.from_pretrained(folder / "adapter-export" / "adapter")  # base by its path
    torch.testing.assert_close(logits(with_adapter), expected, atol=1e-5, rtol=1e-5)
    # negative control: the same weights with every layer run (what the export held before: layers kept)
    with torch.no_grad():
        full = model.backbone(IDS).logits
    assert (full - expected).abs().max() > 1e-2


def test_pruned_export_needs_three_layers(tmp_path):
    plan = concept.resolve(BuildConfig(backbone=ComponentRef("tiny-llama", TINY), split="1,2,1"))
    model = DenseModel(build_backbone(plan).model, resolution=plan, removed=(1, 3))
    with pytest.raises(ConceptError, match="keeps 2 of the backbone's 4 layers"):
        model.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()


# -- the hub, with a local folder standing in for it -------------------------------------------------
class FakeHub:
    """``HfApi.create_repo`` / ``create_commit`` writing into a Hugging Face cache folder (the layout
    ``snapshot_download`` reads offline: ``models--ORG--NAME/snapshots/SHA`` + ``refs/main``)."""

    def __init__(self, cache: Path):
        self.cache, self.commits = cache, []

    def install(self, monkeypatch):
        import huggingface_hub.constants as constants

        hub = self

        def create_repo(api, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def create_commit(api, repo_id, operations, commit_message=None, revision=None, **kwargs):
            sha = f"{len(hub.commits) + 1:040x}"
            repo = hub.cache / f"models--{repo_id.replace('/', '--')}"
            for op in operations:
                target = repo / "snapshots" / sha / op.path_in_repo
                target.parent.mkdir(parents=True, exist_ok=True)
                data = op.path_or_fileobj
                target.write_bytes(data if isinstance(data, bytes) else Path(data).read_bytes())
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / (revision or "main")).write_text(sha)
            hub.commits.append((repo_id, commit_message, sorted(op.path_in_repo for op in operations)))
            return type("CommitInfo", (), {"oid": sha, "commit_url": f"https://hub.invalid/{repo_id}/commit/{sha}"})()

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(self.cache))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # snapshot_download reads the cache only
        return self

    def files(self, repo_id: str) -> dict[str, bytes]:
        snapshot = next((self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots").iterdir())
        return {p.relative_to(snapshot).as_posix(): p.read_bytes() for p in snapshot.rglob("*") if p.is_file()}


def test_push_to_hub_and_load_the_hub_id(streaming, tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    dry = streaming.push_to_hub("org/tiny", dry_run=True)
    assert dry["dry_run"] and not hub.commits and dry["url"] is None
    pushed = streaming.push_to_hub("org/tiny", commit_message="first")
    assert hub.commits == [("org/tiny", "first", sorted(f["path"] for f in pushed["files"]))]
    assert [f["path"] for f in pushed["files"]] == [f["path"] for f in dry["files"]]
    files = hub.files("org/tiny")
    assert {"config.json", "concept.json", "modeling_concept.py", "configuration_concept.py", "README.md",
            "modules.safetensors", "backbone/model.safetensors", "adapter/adapter_config.json"} <= set(files)
    adapter = json.loads(files["adapter/adapter_config.json"])
    assert adapter["base_model_name_or_path"] is None and pushed["adapter_base"] is None  # no hub id; no local path
    assert str(tmp_path) not in files["concept.json"].decode()

    expected = logits(streaming)
    again = concept.load("org/tiny")  # snapshot_download from the (offline) cache
    torch.testing.assert_close(logits(again), expected, atol=1e-6, rtol=0)
    assert isinstance(concept.ConceptModel.from_pretrained("org/tiny"), concept.ConceptModel)
    hf = AutoModelForCausalLM.from_pretrained("org/tiny", trust_remote_code=True, cache_dir=str(tmp_path / "hub"))
    torch.testing.assert_close(logits(hf), expected, atol=1e-6, rtol=0)
    hf.push_to_hub("org/copy")  # the transformers class pushes an export folder too
    assert set(hub.files("org/copy")) == set(files)
    torch.testing.assert_close(logits(concept.load("org/copy")), expected, atol=1e-6, rtol=0)
    with pytest.raises(RunFolderError, match="org/absent is not a local folder.*hub failed"):
        concept.load("org/absent")


def test_export_push_to_hub_dry_run_lists_the_upload(tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    run = tmp_path / "run"
    concept.save(concept.build(BuildConfig(backbone=ComponentRef("tiny-llama", TINY), split="1,2,1")), run)
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "exp"), "--push-to-hub", "org/x",
                                 "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    push = json.loads(r.stdout)["push"]
    assert push["dry_run"] and push["repo"] == "org/x" and not hub.commits
    assert {f["path"] for f in push["files"]} == {p.relative_to(tmp_path / "exp").as_posix()
                                                  for p in (tmp_path / "exp").rglob("*") if p.is_file()}
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "exp"), "--force", "--push-to-hub", "org/x"])
    assert r.exit_code == 0, r.output
    assert "pushed" in r.stdout and hub.commits and hub.commits[0][0] == "org/x"
    r = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "other"), "--dry-run"])
    assert r.exit_code == 2 and "--dry-run" in r.stderr and "--push-to-hub" in r.stderr


# -- strings ----------------------------------------------------------------------------------------
def test_component_names_and_prompts_as_strings(streaming):
    named = BuildConfig(backbone="tiny-llama", split="2,4,2", attention="sdpa", length_policy="fixed")
    explicit = BuildConfig(backbone=ComponentRef("tiny-llama"), split="2,4,2", attention=ComponentRef("sdpa"),
                           length_policy=ComponentRef("fixed"))
    assert named.to_dict() == explicit.to_dict()
    assert isinstance(concept.build(named), concept.ConceptModel)
    with pytest.raises(ConfigError, match="backbone"):
        concept.resolve(BuildConfig(backbone="tiny-lama"))

    text = streaming.generate("def f(x):", max_new_tokens=5)
    ids = list("def f(x):".encode())
    out = streaming.generate([ids], max_new_tokens=5, tokenizer=tokenizer_for(streaming))  # (bytes: no tokenizer)
    assert isinstance(text, str) and text == out.texts[0] and len(out.tokens[0]) == 5
    assert concept.generate(streaming, ["def f(x):", "import os"], max_new_tokens=5) == [
        text, concept.generate(streaming, "import os", max_new_tokens=5)]
    with pytest.raises(ConceptError, match="empty"):
        streaming.generate("", max_new_tokens=2)


def test_config_json_names_the_modeling_class_of_each_kind():
    """hub names the modeling class (it does not import the modeling file): the name must be the class's."""
    from concept.hf.configuration_concept import CONFIG_CLASSES, ConceptConfig
    from concept.hf.modeling_concept import model_class

    for config in (*CONFIG_CLASSES, ConceptConfig):
        for kind in config.kinds or ("a-third-family",):
            assert concept.hub.model_class_name(config) == model_class(kind).__name__
