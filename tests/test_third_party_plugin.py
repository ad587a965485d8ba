"""Third-party plugins are discovered through entry points, like any package from PyPI.

The fixture distributions under ``tests/fixtures/`` are installed with pip into temporary
``--target`` folders (offline: no index, no build isolation, no dependencies), and the
``concept`` CLI runs in fresh interpreters with that folder on ``PYTHONPATH`` (the real console
script once; otherwise a batch of invocations per interpreter, to pay the imports once):

* ``concept-fixture-plugin`` provides length policies ``every-other`` (works) and ``broken``
  (raises ImportError at import);
* ``concept-fixture-conflict`` provides a second ``null`` length policy (a name conflict).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
TINY = ["--backbone", "tiny-llama", "--split", "2,4,2"]
FIXTURE_DIST = "concept-fixture-plugin==0.1.0"
CONFLICT_DIST = "concept-fixture-conflict==0.1.0"


def _hand_install(src: Path, target: Path) -> None:
    """Fallback when pip cannot build offline (e.g. setuptools too old to build wheels without
    ``wheel``): lay the package out as pip would, with a .dist-info holding the entry points."""
    meta = tomllib.loads((src / "pyproject.toml").read_text())
    project = meta["project"]
    for package in meta["tool"]["setuptools"]["packages"]:
        shutil.copytree(src / package, target / package)
    info = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
        for group, eps in groups.items()))


def install(fixture: str, tmp: Path) -> Path:
    """Install a fixture distribution into ``tmp/site`` and return that folder."""
    src, target = tmp / "src", tmp / "site"
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(FIXTURES / fixture, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--target", str(target), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        warnings.warn(f"pip could not install {fixture} offline; installing it by hand instead:\n{done.stderr}")
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        _hand_install(src, target)
    assert any(target.glob("*.dist-info/entry_points.txt")), list(target.iterdir())
    return target


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    return install("concept-fixture-plugin", tmp_path_factory.mktemp("fixture-plugin"))


@pytest.fixture(scope="session")
def conflict_site(tmp_path_factory):
    return install("concept-fixture-conflict", tmp_path_factory.mktemp("fixture-conflict"))


def _env(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("COLUMNS", "200")
    return env


def concept_script(site: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """Run the installed ``concept`` console script (or ``python -m concept_cli``) with ``site`` importable."""
    script = Path(sys.executable).with_name("concept")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "concept_cli"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=300,
                          env=_env(site), cwd=cwd)


# Several CLI invocations in one fresh interpreter (each subprocess pays ~5 s of torch/transformers
# imports on a small CPU machine). Discovery is the same: only PYTHONPATH makes the fixture visible.
DRIVER = r"""
import json, sys
import torch
from click.testing import CliRunner
from concept_cli.main import cli

def load_check(path):
    import concept
    m = concept.load(path)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        out = m(ids, attention_mask=mask)
    every_other = (torch.arange(9) % 2 == 1).expand(2, 9)
    state, steps = m.length_policy.init_state(2, "cpu"), []
    for t in range(9):
        keep_t, state = m.length_policy.step(None, out.head_logits[:, t], state)
        steps.append(keep_t)
    return {"keep": out.keep.tolist(), "expected": (every_other & mask.bool()).tolist(),
            "step_agrees": bool(torch.equal(torch.stack(steps, 1), every_other)),
            "module": type(m.length_policy).__module__,
            "provider": m.resolution.components["length_policy"].provider.label}

results = []
for args in json.loads(sys.argv[1]):
    if args[0] == "load-check":
        results.append(load_check(args[1]))
        continue
    r = CliRunner().invoke(cli, args)
    crashed = r.exception is not None and not isinstance(r.exception, SystemExit)
    results.append({"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                    "crash": repr(r.exception) if crashed else None})
print(json.dumps(results))
"""


def run_cli_batch(site: Path, commands: list[list], cwd: Path) -> list[dict]:
    commands = [[str(a) for a in cmd] for cmd in commands]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                          timeout=600, env=_env(site), cwd=cwd)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for r in results:
        assert not r.get("crash"), r
        assert "Traceback" not in r.get("stderr", "") + r.get("stdout", ""), r
    return results


@pytest.fixture(scope="session")
def plugin_results(plugin_site, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fixture-runs")
    run = tmp / "run"
    names = ["list", "build", "inspect", "load", "misspelled", "broken"]
    results = run_cli_batch(plugin_site, [
        ["plugins", "list", "--json"],
        ["build", *TINY, "--length-policy", "every-other", "-o", run, "--json"],
        ["inspect", run, "--json"],
        ["load-check", run],
        ["build", *TINY, "--length-policy", "brokn", "-o", tmp / "misspelled"],
        ["build", *TINY, "--length-policy", "broken", "-o", tmp / "broken"],
    ], cwd=tmp)
    return dict(zip(names, results), tmp=tmp)


def rows_by_name(stdout: str, kind: str = "length_policy") -> dict:
    return {r["name"]: r for r in json.loads(stdout) if r["kind"] == kind}


def no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr + done.stdout, done.stderr


# -- the fixture plugin ----------------------------------------------------------------------

def test_list_shows_third_party_and_builtin_providers(plugin_results):
    done = plugin_results["list"]
    assert done["exit_code"] == 0, done["stderr"]
    rows = rows_by_name(done["stdout"])
    assert rows["every-other"]["provider"] == FIXTURE_DIST
    assert rows["every-other"]["target"] == "concept_fixture_plugin.every_other:EveryOtherPolicy"
    assert rows["broken"]["provider"] == FIXTURE_DIST
    assert rows["broken"]["status"] == "not checked"  # listing imports nothing, so it is not yet known broken
    assert rows["null"]["provider"] == "builtin"
    assert all(r["provider"] == "builtin" for r in json.loads(done["stdout"]) if r["kind"] != "length_policy")


def test_check_reports_the_broken_plugin(plugin_site, tmp_path):
    """Through the real console script: exit status 1, the broken plugin named with its distribution."""
    done = concept_script(plugin_site, "plugins", "list", "--check", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    no_traceback(done)
    rows = rows_by_name(done.stdout)
    assert rows["every-other"]["status"] == "ok"
    assert rows["null"]["status"] == "ok"
    broken = rows["broken"]
    assert broken["status"] == "error"
    for text in ("'broken'", FIXTURE_DIST, "ImportError", "not-installed-anywhere"):
        assert text in broken["detail"], broken["detail"]
    others = [r for r in json.loads(done.stdout) if r["name"] != "broken"]
    assert all(r["status"] == "ok" for r in others)
    assert "1 of" in done.stderr and "broken" in done.stderr


def test_build_inspect_and_load_with_the_third_party_policy(plugin_results):
    done = plugin_results["build"]
    assert done["exit_code"] == 0, done["stderr"]  # the broken plugin next to it does not matter
    built = json.loads(done["stdout"])
    policy = built["plan"]["components"]["length_policy"]
    assert policy["name"] == "every-other" and policy["provider"] == FIXTURE_DIST
    assert policy["target"] == "concept_fixture_plugin.every_other:EveryOtherPolicy"
    assert policy["params"] == {"phase": 1}
    assert (Path(built["path"]) / "concept.json").is_file()

    done = plugin_results["inspect"]
    assert done["exit_code"] == 0, done["stderr"]
    info = json.loads(done["stdout"])
    assert info["components"]["length_policy"]["provider"] == FIXTURE_DIST
    assert info["params"] == built["params"]

    load = plugin_results["load"]
    assert load["keep"] == load["expected"]  # a concept at every other token (t = 1, 3, 5, ...), none on padding
    assert load["step_agrees"]
    assert load["module"] == "concept_fixture_plugin.every_other" and load["provider"] == FIXTURE_DIST


def test_misspelled_plugin_suggests_the_name(plugin_results):
    done = plugin_results["misspelled"]
    assert done["exit_code"] == 2, done["stderr"]
    assert "Did you mean 'broken'?" in done["stderr"]
    assert "every-other" in done["stderr"]  # the available names
    assert done["stdout"] == "" and not (plugin_results["tmp"] / "misspelled").exists()


def test_broken_plugin_fails_with_its_import_error(plugin_results):
    done = plugin_results["broken"]
    assert done["exit_code"] == 1, done["stderr"]
    assert done["stderr"].startswith("error:")
    for text in ("'broken'", FIXTURE_DIST, "failed to import", "not-installed-anywhere"):
        assert text in done["stderr"], done["stderr"]
    assert done["stdout"] == "" and not (plugin_results["tmp"] / "broken").exists()


# -- a name conflict -------------------------------------------------------------------------

def test_conflict_is_reported_and_refused(conflict_site, tmp_path):
    check, build = run_cli_batch(conflict_site, [
        ["plugins", "list", "--check", "--json"],
        ["build", *TINY, "--length-policy", "null", "-o", tmp_path / "run"],
    ], cwd=tmp_path)
    assert check["exit_code"] == 1, check["stderr"]
    null = rows_by_name(check["stdout"])["null"]
    assert null["status"] == "conflict"
    for text in ("builtin", CONFLICT_DIST, "concept_fixture_conflict.null:NullPolicy",
                 "concept_plugins.length_policies.null:NullPolicy"):
        assert text in null["detail"], null["detail"]
    assert "builtin" in null["provider"] and CONFLICT_DIST in null["provider"]

    assert build["exit_code"] == 1, build["stderr"]
    for text in ("'null'", "more than one distribution", "builtin", CONFLICT_DIST):
        assert text in build["stderr"], build["stderr"]
    assert build["stdout"] == "" and not (tmp_path / "run").exists()
