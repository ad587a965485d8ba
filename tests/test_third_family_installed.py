"""Issue 41, item 7: the third family (``tests/third_family.py``, soft-prompt tuning on ``concept.contracts.Family``)
installed from outside the library as a real distribution: a package folder with a pyproject declaring the
``concept.families`` entry point, ``pip install --no-deps --no-build-isolation --target`` into a temporary folder
put on ``sys.path`` (so its module is imported from the installed copy, not from ``tests/``). Through the library's
own commands and API it builds, trains, resumes exactly, evaluates, generates, inspects and exports, and no
streaming option appears in its run folders' JSON or in ``concept inspect``."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import concept
from concept.streaming.options import StreamingBuild, StreamingTraining
from concept.streaming.section import StreamingSection
from concept.training import Trainer
from concept_cli.main import cli
from tests.test_third_family import TINY_FLAGS, forget_family, small
from tests.test_training import corpus, losses  # noqa: F401  (corpus: a fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # ~50 s (pip, build, train x2, export);
# the in-process variant in the default suite: tests/test_third_family.py
HERE = Path(__file__).parent
PYPROJECT = """[build-system]
requires = ["setuptools>=70.1"]
build-backend = "setuptools.build_meta"

[project]
name = "soft-prompt-family"
version = "0.2.0"
requires-python = ">=3.10"
dependencies = ["torch"]

[tool.setuptools]
packages = ["soft_prompt_family"]

[project.entry-points."concept.families"]
soft-prompt = "soft_prompt_family:SoftPrompt"
"""
# every option name of the streaming family: its build section's (its section's name is not one: "streaming" is
# also the core's option of streamed training data), its own build and training options (those it shares with the
# planner-executor included)
STREAMING_NAMES = sorted({*StreamingSection.__dataclass_fields__,
                          *(f for f in StreamingBuild.__dataclass_fields__),
                          *(f for f in StreamingTraining.__dataclass_fields__)})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The family's package, pip-installed into a target folder on ``sys.path`` (the registry reads its entry point
    from the installed ``*.dist-info``)."""
    tmp = tmp_path_factory.mktemp("soft-prompt-dist")
    src, target = tmp / "src", tmp / "site"
    (src / "soft_prompt_family").mkdir(parents=True)
    shutil.copy(HERE / "third_family.py", src / "soft_prompt_family" / "__init__.py")
    (src / "pyproject.toml").write_text(PYPROJECT)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (target / "soft_prompt_family-0.2.0.dist-info" / "entry_points.txt").is_file()
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(target))
    forget_family("soft-prompt")  # (a copy loaded from tests/ earlier in this process)
    yield target
    mp.undo()
    sys.modules.pop("soft_prompt_family", None)
    forget_family("soft-prompt")


def invoke(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0 and result.exception is None, result.output
    return result


def streaming_names_in(text: str) -> list[str]:
    return [name for name in STREAMING_NAMES if re.search(rf'"{name}"', text)]


def test_installed_family_builds_trains_resumes_evaluates_generates_inspects_and_exports(site, corpus, tmp_path):  # noqa: F811
    listed = {row["name"]: row for row in json.loads(invoke("plugins", "list", "--kind", "family", "--json").stdout)}
    assert listed["soft-prompt"]["provider"] == "soft-prompt-family==0.2.0"

    built = tmp_path / "built"
    invoke("build", "--family", "soft-prompt", *TINY_FLAGS, "--set", "soft_prompt.length=3", "-o", built)
    model = concept.load(built)
    assert type(model).__module__ == "soft_prompt_family"  # the installed copy, not tests/third_family.py
    assert Path(sys.modules["soft_prompt_family"].__file__).is_relative_to(site)
    refused = CliRunner().invoke(cli, ["build", "--family", "soft-prompt", *TINY_FLAGS, "--length-policy", "fixed",
                                       "--dry-run"])
    assert refused.exit_code == 2 and "length-policy: the soft-prompt family does not read it" in refused.stderr

    straight = tmp_path / "straight"
    invoke("train", built, "--out", straight, "--data", corpus, "--steps", 4, "--seq-len", 32, "--batch", 2,
           "--lora-rank", 2, "--eval-every", 2, "--eval-batches", 1, "--checkpoint-every", 2, "--log-every", 2,
           "--warmup", 1, "--lr", 1e-2, "--lr-new", 1e-2)
    first = Trainer.start(built, tmp_path / "resumed", small(corpus))
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C after step 3: the checkpoint is written on the way out
        first.train(progress=lambda row: row["step"] == 3 and first.loop.on_sigint(None, None))
    invoke("train", tmp_path / "resumed", "--resume")
    assert losses(tmp_path / "resumed") == losses(straight)  # bit for bit

    evaluated = invoke("eval", straight, "--data", corpus, "--batches", 1, "--seq-len", 32, "--json").stdout
    assert '"nll"' in evaluated
    generated = invoke("generate", straight, "--prompt", "def f(x):", "--max-new-tokens", 4, "--json")
    assert generated.stdout.strip()
    shown = invoke("inspect", straight, "--json").stdout
    assert json.loads(shown)["soft prompt"]["vectors"] == 3
    exported = tmp_path / "exported"
    invoke("export", straight, "--out", exported)
    again = concept.load(exported)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, concept.load(straight)(ids).logits, atol=1e-5)

    # no streaming option in any JSON file of its run folders, nor in what `inspect` prints
    for folder in (built, straight, tmp_path / "resumed", exported):
        for file in folder.rglob("*.json"):
            if "backbone" not in file.relative_to(folder).parts:  # (the Hugging Face backbone folder's own config)
                assert streaming_names_in(file.read_text()) == [], file
    assert streaming_names_in(shown) == []
    streaming = tmp_path / "streaming"
    invoke("build", *TINY_FLAGS, "--no-calibrate", "-o", streaming)  # (negative control: the names are found)
    assert {"length_policy", "split", "concept_input"} <= set(streaming_names_in((streaming / "concept.json").read_text()))
