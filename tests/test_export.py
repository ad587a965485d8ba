"""`concept export`: a self-contained folder that loads in a fresh process, anywhere, and gives the run's
held-out NLL and logits (streaming model, merged or not; dense and pruned baselines); bad inputs."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import concept
from concept.errors import ConceptError, RunFolderError
from concept.export import export
from concept.training import Trainer
from concept_cli.main import cli
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)

IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5)).tolist()

# a fresh interpreter: load each exported folder, logits on IDS and the held-out NLL on the batches the
# run's own final evaluation used (its data's held-out split, eval_batches x batch x seq_len, seed 0)
FRESH = r"""
import json, sys, torch, concept
from concept import data
from concept.diagnostics import evaluate
spec = json.loads(sys.argv[1])
out = {}
for name, folder in spec["folders"].items():
    model = concept.load(folder)
    with torch.no_grad():
        o = model(torch.tensor(spec["ids"]))
    packed = data.PackedSequences(data.read_documents(spec["data"], "heldout"), data.tokenizer_for(model),
                                  spec["seq_len"], seed=0)
    ev = evaluate(model, (packed.batch(i, spec["batch"]) for i in range(spec["batches"])), controls=False)
    keep = getattr(o, "keep", None)
    out[name] = {"logits": o.logits.tolist(), "keep": None if keep is None else keep.tolist(), "nll": ev["nll"],
                 "kind": getattr(model, "kind", "streaming"), "backbone": model.resolution.config.backbone.params["path"],
                 "lora": sum("lora_" in n for n, _ in model.backbone.named_parameters())}
print(json.dumps(out))
"""


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def train(source, out, corpus, **kw):  # noqa: F811
    config = dict(data=str(corpus), steps=2, lr=1e-2, lr_new=1e-2, eval_every=2, checkpoint_every=2)
    config.update(kw)
    Trainer.start(source, out, small(**config)).train()
    return out


def last_eval(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("eval")][-1]["eval"]


@pytest.fixture(scope="module")
def trained(built, corpus, tmp_path_factory):  # noqa: F811
    return train(built, tmp_path_factory.mktemp("export") / "run", corpus)


@pytest.fixture(scope="module")
def baselines(built, corpus, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("baselines")
    return {"dense": train(built, folder / "dense", corpus, baseline="dense"),
            "pruned": train(built, folder / "pruned", corpus, baseline="pruned", prune_layers="1:2")}


def test_export_loads_in_a_fresh_process_with_the_runs_heldout_nll(trained, corpus, tmp_path):  # noqa: F811
    """The target: exported folders, moved away from a deleted run, load in a fresh process and give the
    run's held-out NLL (and logits); merged LoRA within fp32 rounding."""
    source = tmp_path / "run"  # a copy, deleted before the fresh process loads the exports
    shutil.copytree(trained, source)
    original = concept.load(source)
    with torch.no_grad():
        expected = original(torch.tensor(IDS))
    r = run("export", source, "--out", tmp_path / "exp", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)  # data on stdout, status on stderr
    assert "exported" in r.stderr and "checked" in r.stderr
    assert result["lora"] == "adapter" and result["kind"] == "streaming" and result["step"] == 2
    assert result["check"]["max_abs_diff"] == 0.0 and result["check"]["decisions_equal"]
    files = {f["path"] for f in result["files"]}
    assert {"README.md", "concept.json", "train.json", "modules.safetensors", "metrics.jsonl", "backbone/config.json",
            "backbone/model.safetensors", "adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= files
    r = run("export", source, "--out", tmp_path / "merged", "--merge-lora")
    assert r.exit_code == 0, r.output
    assert "exported" in r.stdout and "model.safetensors" in r.stdout and "peft" not in r.stdout
    assert not (tmp_path / "merged" / "adapter").exists()

    record = json.loads((tmp_path / "exp" / "concept.json").read_text())
    assert record["config"]["backbone"] == {"name": "hf", "params": {"path": "./backbone", "dtype": "float32"}}
    assert str(tmp_path) not in json.dumps(record["plan"])  # no absolute path into the temporary folder
    built_config = json.loads((source / "concept.json").read_text())["config"]
    assert {k: v for k, v in record["config"].items() if k != "backbone"} == \
        {k: v for k, v in built_config.items() if k != "backbone"}  # split and every component unchanged
    assert record["export"]["lora"] == "adapter" and record["export"]["backbone"] == built_config["backbone"]
    heldout = last_eval(source)
    card = (tmp_path / "exp" / "README.md").read_text()
    assert f"{heldout['nll']:.4f}" in card and "PeftModel.from_pretrained" in card and "concept.load" in card

    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(str(tmp_path / "exp"), moved / "exp")
    shutil.move(str(tmp_path / "merged"), moved / "merged")
    shutil.rmtree(source)  # the run folder is gone
    train_cfg = json.loads((moved / "exp" / "train.json").read_text())
    spec = {"folders": {"adapter": str(moved / "exp"), "merged": str(moved / "merged")}, "ids": IDS,
            "data": str(corpus), "seq_len": train_cfg["seq_len"], "batch": train_cfg["batch"],
            "batches": train_cfg["eval_batches"]}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(spec)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])

    exact = fresh["adapter"]
    assert exact["backbone"] == str((moved / "exp" / "backbone").resolve()) and exact["lora"] > 0
    assert exact["nll"] == pytest.approx(heldout["nll"], abs=1e-5)  # the run's own held-out number
    torch.testing.assert_close(torch.tensor(exact["logits"]), expected.logits, atol=1e-6, rtol=0)
    assert exact["keep"] == expected.keep.tolist()
    merged = fresh["merged"]
    assert merged["lora"] == 0  # the adapters live in the backbone's weights
    assert merged["nll"] == pytest.approx(heldout["nll"], abs=1e-4)
    assert merged["keep"] == expected.keep.tolist()
    torch.testing.assert_close(torch.tensor(merged["logits"]), expected.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "pruned"])
@pytest.mark.parametrize("merge", [False, True])
def test_baselines_export_and_reload(baselines, kind, merge, tmp_path):
    source = baselines[kind]
    model = concept.load(source)
    result = export(source, tmp_path / "exp", merge_lora=merge)
    assert result.kind == kind and result.lora == ("merged" if merge else "adapter") and not result.warnings
    again = concept.load(tmp_path / "exp")
    assert again.family == kind and model.removed == ((1, 2) if kind == "pruned" else None)
    assert again.removed is None and again.deleted == model.removed  # the export's backbone lacks the skipped layers
    built_as = json.loads((tmp_path / "exp" / "concept.json").read_text())["config"]
    assert built_as["family"] == kind  # (a run of the baseline's family)
    layers = json.loads((tmp_path / "exp" / "backbone" / "config.json").read_text())["num_hidden_layers"]
    assert layers == (3 if kind == "pruned" else 4) == len(again.layers)
    if kind == "pruned":
        assert built_as["pruned"]["deleted"] == [1, 2] and built_as["pruned"]["layers"] is None
        if not merge:  # the adapter is numbered for the kept layers, which are all the backbone has
            config = json.loads((tmp_path / "exp" / "adapter" / "adapter_config.json").read_text())
            assert config["layers_to_transform"] is None
            assert {int(k.split(".layers.")[1].split(".")[0]) for k in
                    load_file(tmp_path / "exp" / "adapter" / "adapter_model.safetensors")} == {0, 1, 2}
    assert not (tmp_path / "exp" / "modules.safetensors").exists()  # a baseline has no concept modules
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=1e-4 if merge else 0,
                                   rtol=1e-4 if merge else 0)
    merged_weights = load_file(tmp_path / "exp" / "backbone" / "model.safetensors")
    assert not any("lora_" in k or "base_layer" in k for k in merged_weights)  # a plain transformers checkpoint


def test_untrained_run_exports_with_a_warning(built, tmp_path):  # noqa: F811
    r = run("export", built, "--out", tmp_path / "exp")
    assert r.exit_code == 0, r.output
    assert "warning" in r.stderr and "never trained" in r.stderr
    assert "untrained" in r.stdout
    names = {p.name for p in (tmp_path / "exp").iterdir()}
    assert {"concept.json", "modules.safetensors", "backbone", "README.md"} <= names
    assert not {"adapter", "train.json"} & names
    umask = os.umask(0)
    os.umask(umask)
    assert all(p.stat().st_mode & 0o777 == (0o777 if p.is_dir() else 0o666) & ~umask  # not mkdtemp's / safetensors' 0600
               for p in [tmp_path / "exp", *(tmp_path / "exp").rglob("*")])
    r = run("build", "--config", tmp_path / "exp" / "concept.json", "--dry-run", "--json")  # its ./backbone is found
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["config"]["backbone"]["params"]["path"] == str((tmp_path / "exp" / "backbone").resolve())
    model, again = concept.load(built), concept.load(tmp_path / "exp")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    with pytest.warns(UserWarning, match="never trained"):  # the library warns through `warnings`
        export(built, tmp_path / "lib")


def test_bad_targets_and_atomic_replacement(trained, built, tmp_path, monkeypatch):  # noqa: F811
    target = tmp_path / "exp"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    for force in ([], ["--force"]):  # a folder that is not a run is never replaced, and --force is not suggested
        r = run("export", trained, "--out", target, *force)
        assert r.exit_code == 1 and "not a concept run folder" in r.stderr and "--force" not in r.stderr
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and r.stdout == ""
    (target / "concept.json").write_text("{}")  # a run folder (an older export, say): --force may replace it
    r = run("export", trained, "--out", target)
    assert r.exit_code == 1 and "not empty" in r.stderr and "--force" in r.stderr

    import concept.export as export_module

    def broken(*args, **kwargs):
        raise ConceptError("disk full (simulated)")

    monkeypatch.setattr(export_module, "model_card", broken)  # fails after the weights were written
    with pytest.raises(ConceptError, match="simulated"):
        export(trained, target, force=True)
    assert sorted(p.name for p in target.iterdir()) == ["concept.json", "keep.txt"]  # the old folder is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no half-written temporary folder left
    monkeypatch.undo()

    r = run("export", trained, "--out", target, "--force")
    assert r.exit_code == 0, r.output
    assert not (target / "keep.txt").exists() and (target / "concept.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]

    r = run("export", tmp_path / "nowhere", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "not a concept run folder" in r.stderr
    r = run("export", target / "backbone", "--out", tmp_path / "x")  # a folder, but no run
    assert r.exit_code == 1 and "not a concept run folder" in r.stderr
    for bad, message in ((trained, "is the run"), (trained.parent, "contains the run")):
        with pytest.raises(RunFolderError, match=message):
            export(trained, bad, force=True)
    (tmp_path / "file").write_text("")
    r = run("export", trained, "--out", tmp_path / "file")
    assert r.exit_code == 1 and "not a folder" in r.stderr
    assert not (tmp_path / "x").exists()
