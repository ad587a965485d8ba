"""Issue 41, bug 2: one broken third-party family (its module fails to import, or its class fails to start)
broke every command (`concept train --help`, a streaming `build`, `train`, `generate`), and a family whose
module imports torch made `concept train --help` import it (0.5 s -> 3.8 s). Now only the commands that use
such a family fail, with one line naming its package and the error. The distribution is laid out on
``sys.path`` as pip leaves one (``tests/test_plugin_checks.py`` does the same).

Negative control (without the fix, run on this file): a family whose ``__init__`` raises made every command
end in its ``RuntimeError`` traceback (``concept.families.family`` instantiated it uncaught, and
``TrainConfig`` / ``--help`` instantiate every family); ``train --help`` imported the torch-importing family;
``build --family broken`` printed a two-line ``invalid config (1 problem)``. Reading and resolving a streaming run
imports no other family (before the build sections, ``concept.migrate`` and ``resolve`` imported every one).

`concept train RUN` composes its options from the core and RUN's family only (read from concept.json; issue 41
item 1) and a streaming `build` from the library's families: neither imports the torch-importing family (before,
`build --dry-run` and `train RUN` imported every installed family); a run of that family does (the control)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from concept_cli.main import cli
from tests.test_cli_train import FAST, TINY
from tests.test_training import corpus  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILY = '''
from concept.contracts import Family as Base


class Family(Base):  # a minimal family: its name and build
    name = "{name}"

    def __init__(self):
        {init}

    def build(self, plan, loaded):
        return None
'''
ENTRY_POINTS = """[concept.families]
broken = broken_family:Family
unstartable = unstartable_family:Family
heavy = heavy_family:Family
"""


def lay_out(site):
    (site / "broken_family.py").write_text("import not_installed_anywhere_xyz\n")
    (site / "unstartable_family.py").write_text(FAMILY.format(name="unstartable",
                                                              init='raise RuntimeError("needs a licence key")'))
    (site / "heavy_family.py").write_text("import torch  # at module level\n" + FAMILY.format(name="heavy", init="pass"))
    info = site / "bad_families-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-families\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    site = lay_out(tmp_path_factory.mktemp("site"))
    from concept import families, registry, train_config
    from concept_cli.build_cmd import build
    from concept_cli.train_cmd import train

    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(site))
    for module, name, fresh in ((registry, "_REGISTRIES", {}), (families, "_INSTANCES", {}),
                                (families, "BROKEN", {}), (train_config, "_COMPOSED", {}), (build, "made", {}),
                                (train, "made", {})):
        mp.setattr(module, name, fresh, raising=False)  # (raising: the negative control runs without some)
    yield site
    mp.undo()
    sys.modules.pop("heavy_family", None)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_error_line(result, *parts):
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # (status lines aside)
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    assert result.stderr.rstrip("\n").endswith(lines[0]), result.stderr  # nothing after it
    for part in parts:
        assert part in lines[0], lines[0]


def test_help_and_streaming_build_train_generate_still_work(installed, corpus, tmp_path):  # noqa: F811
    sys.modules.pop("heavy_family", None)  # (imported by `plugins list --check`, if that ran first)
    helped = invoke("train", "--help")
    assert helped.exit_code == 0 and "--steps" in helped.stdout and "--task" in helped.stdout, helped.output
    assert "heavy_family" not in sys.modules  # --help imports no third-party family
    assert invoke("build", "--help").exit_code == 0 and "heavy_family" not in sys.modules
    assert invoke("build", *TINY, "--dry-run").exit_code == 0
    assert "heavy_family" not in sys.modules  # a streaming build imports the library's families only
    built, trained = tmp_path / "m", tmp_path / "m-train"
    assert invoke("build", *TINY, "-o", built).exit_code == 0
    # reading and resolving the streaming run imports no other family (its config names its own section only)
    from concept import families, registry, run_files

    def forget_the_families():
        sys.modules.pop("heavy_family", None)
        registry._REGISTRIES.clear()  # (the fixture's fresh ones)
        families._INSTANCES.clear()

    forget_the_families()
    run_files.plan_of(run_files.read_run(built), built)
    assert "heavy_family" not in sys.modules
    families.sections()  # negative control: every family's sections import every family
    assert "heavy_family" in sys.modules
    forget_the_families()
    r = invoke("train", built, "--data", corpus, "--steps", 2, *FAST, "--out", trained)
    assert r.exit_code == 0, r.output
    assert "heavy_family" not in sys.modules  # `concept train RUN`: the core's options and the run's family's
    r = invoke("generate", trained, "--prompt", "def f(x):", "--max-new-tokens", 4)
    assert r.exit_code == 0, r.output
    assert "heavy_family" not in sys.modules
    its_familys_options_only(built)


def its_familys_options_only(run):
    """`concept train RUN` composes its options from the core and RUN's family (read from concept.json, no family
    imported): `train RUN --help` lists that family's; another family's option is refused naming its owner
    (before anything loads); a run of the torch-importing family imports it (the control: RUN is read)."""
    helped = invoke("train", run, "--help")
    assert helped.exit_code == 0 and "--target-ratio" in helped.stdout and "--tau-start" in helped.stdout
    assert "--commitment" not in helped.stdout and "planner-executor family" not in helped.stdout, helped.stdout
    assert "heavy_family" not in sys.modules
    r = invoke("train", run, "--task", "continue", "--steps", 1)
    assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert "--task: only for planner-executor runs (`concept build --family planner-executor`); the run is a " \
           "streaming run" in r.stderr and "Traceback" not in r.output, r.output
    r = invoke("train", run, "--no-such-option", "1")  # no family's: click's own message
    assert r.exit_code == 2 and "No such option '--no-such-option'" in r.output, r.output
    record = json.loads((run / "concept.json").read_text())
    record["config"] = {k: v for k, v in record["config"].items() if k != "streaming"} | {"family": "heavy"}
    (run / "concept.json").write_text(json.dumps(record))
    helped = invoke("train", run, "--help")
    assert helped.exit_code == 0 and "--steps" in helped.stdout and "--ratio-control" not in helped.stdout
    assert "heavy_family" in sys.modules  # (negative control: the run's family is what is read)


@pytest.mark.parametrize("name, problem", [
    ("broken", "failed to import: ModuleNotFoundError: No module named 'not_installed_anywhere_xyz'"),
    ("unstartable", "failed to start: RuntimeError: needs a licence key")])
def test_a_command_that_selects_it_gets_one_line(installed, tmp_path, name, problem):
    r = invoke("build", "--family", name, *TINY[:2], "-o", tmp_path / "x")
    one_error_line(r, f"family plugin '{name}' from bad-families==0.1", problem, "fix or uninstall bad-families")
    assert not (tmp_path / "x").exists()
    run = tmp_path / "streaming"  # a run folder recorded as built by that family
    assert invoke("build", *TINY, "-o", run).exit_code == 0
    record = json.loads((run / "concept.json").read_text())
    record["config"]["family"] = name
    (run / "concept.json").write_text(json.dumps(record))
    for command in (["train", run, "--steps", 1], ["generate", run, "--prompt", "x"], ["inspect", run]):
        one_error_line(invoke(*command), f"family plugin '{name}'", problem)


def test_plugins_list_check_shows_each_with_its_error_on_one_line(installed):
    r = invoke("plugins", "list", "--check", "--kind", "family", "--json")
    assert r.exit_code == 1, r.output
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["heavy"]["status"] == rows["streaming"]["status"] == rows["planner-executor"]["status"] == "ok"
    for name, problem in (("broken", "ModuleNotFoundError"), ("unstartable", "failed to start: RuntimeError")):
        assert rows[name]["status"] == "error" and problem in rows[name]["detail"], rows[name]
        assert "bad-families==0.1" in rows[name]["detail"] and "\n" not in rows[name]["detail"]


SCRIPT = """
import sys
from concept_cli.main import cli
try:
    cli(["train", "--help"], standalone_mode=False)
finally:
    print("IMPORTED", "torch" in sys.modules, "heavy_family" in sys.modules, file=sys.stderr)
"""


def test_train_help_imports_neither_torch_nor_the_family(installed):
    """The torch-importing family costs `concept train --help` nothing: torch is not imported (measured with it
    installed: 3.8 s before, 0.4 s after; docs/plugins.md)."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "--steps" in done.stdout, done.stderr[-2000:]
    assert "IMPORTED False False" in done.stderr, done.stderr[-2000:]

