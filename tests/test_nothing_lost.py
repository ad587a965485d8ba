"""Nothing written is ever lost: every writing command, with a fault injected at its k-th filesystem
write (an exception, a real SIGINT, a real SIGKILL), leaves every file that existed before
byte-identical, and its output either absent or complete (a run is complete when ``--resume``
carries it to the same weights as an uninterrupted run). ``make test`` tries a spread of write
points per command; ``make test-slow`` tries every one.

The negative control swaps the atomic publish for a naive one (remove the old folder, then rename the
new one in) and checks that the same harness catches it.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from concept import fs
from concept_cli.main import cli
from tests.faults import Injector, damaged, injected, leftovers, part, run_killed, snapshot
from tests.test_training import STDLIB

TINY = ["--backbone", "tiny-llama", "--split", "1,2,1", "--set", "backbone.layers=4", "--set", "backbone.hidden=32",
        "--set", "backbone.heads=2", "--set", "backbone.kv_heads=1", "--set", "vocabulary.size=32"]
RECIPE = ["--data", "CORPUS", "--seq-len", "32", "--batch", "2", "--lora-rank", "2", "--eval-batches", "1",
          "--eval-every", "100", "--checkpoint-every", "2", "--calibration-batches", "1", "--log-every", "1"]


def with_data(argv: list[str]) -> list[str]:
    """``argv`` with CORPUS replaced by the data file (one file outside every root: runs store it absolute)."""
    return [a.replace("CORPUS", str(CORPUS[0])) for a in argv]


def cli_run(root: Path, argv: list[str], injector: Injector | None = None):
    """``concept ARGV`` in-process with ``root`` as the working folder (faults from ``injector``)."""
    cwd = Path.cwd()
    import os

    argv = with_data(argv)
    os.chdir(root)
    try:
        if injector is None:
            return CliRunner().invoke(cli, argv, catch_exceptions=False)
        with injected(injector):
            return CliRunner().invoke(cli, argv, catch_exceptions=False)
    finally:
        os.chdir(cwd)


def weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = run / "checkpoint"
    state = json.loads((ckpt / "state.json").read_text())
    tensors = {f"{p.stem}/{k}": v for p in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(p).items()}
    return {"step": torch.tensor(state["step"]), **tensors}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class Scenario:
    name: str
    argv: list[str]
    output: str  # the folder the command writes, relative to the root
    complete: Callable[[Path, "Scenario"], list[str]]  # problems of an output left by a fault (it exists)
    in_place: bool = False  # the command continues `output` itself (--resume): its old files may change
    budget: tuple | None = None  # (error, sigint, sigkill) write points in `make test`, if not the default


def as_built(root: Path, sc: Scenario) -> list[str]:
    """A build is deterministic: complete = byte-identical to the reference build."""
    got = part(snapshot(root), sc.output)
    return [] if got == REFERENCE[sc.name] else [f"{sc.output} is neither the old folder nor the finished build"]


def as_exported(root: Path, sc: Scenario) -> list[str]:
    got = part(snapshot(root), sc.output)
    ref = REFERENCE[sc.name]
    weights_ok = all(got.get(k) == v for k, v in ref.items() if k.endswith(".safetensors"))
    return [] if got.keys() == ref.keys() and weights_ok else [f"{sc.output} is a partial export"]


def trains_to_the_reference(root: Path, sc: Scenario) -> list[str]:
    """A run left by a fault is complete if it is the finished run, or if --resume finishes it exactly."""
    out = root / sc.output
    if not (out / "checkpoint" / "state.json").is_file() or json.loads(
            (out / "checkpoint" / "state.json").read_text())["step"] < STEPS:
        r = cli_run(root, ["train", sc.output, "--resume", "--steps", str(STEPS)])
        if r.exit_code != 0:
            return [f"{sc.output} does not resume: {r.output[-300:]}"]
    return [] if same_weights(weights(out), REFERENCE[sc.name]) else [f"{sc.output} differs from an uninterrupted run"]


def reruns_to_the_reference(root: Path, sc: Scenario) -> list[str]:
    """A frontier left by a fault is complete if the same command then finishes it with the same table."""
    r = cli_run(root, [*sc.argv, "--json"])
    if r.exit_code != 0:
        return [f"the frontier does not continue: {r.output[-300:]}"]
    bits = {row["run"]: row["mean_bits"] for row in json.loads(r.stdout)["rows"]}
    return [] if bits == REFERENCE[sc.name] else [f"the continued frontier differs: {bits} != {REFERENCE[sc.name]}"]


STEPS = 3
FRONTIER = ["frontier", "--backbone", "tiny-llama", "--build-set", "backbone.layers=4", "--build-set",
            "backbone.hidden=32", "--build-set", "backbone.heads=2", "--build-set", "backbone.kv_heads=1",
            "--build-set", "vocabulary.size=32", "--splits", "1,2,1", "--baselines", "none", "--steps", "2",
            "--seq-len", "16", "--batch", "2", "--lora-rank", "2", "--train-set", "calibration_batches=1",
            "--train-set", "eval_batches=1", "--eval-batches", "1", "--eval-batch", "2", "--data", "CORPUS",
            "--eval-data", "code=CORPUS", "--no-controls", "--out", "fr"]
SCENARIOS = [
    Scenario("build", ["build", *TINY, "--seed", "1", "--calibration-data", "CORPUS", "--calibration-batches",
                       "1", "-o", "b_old", "--force"], "b_old", as_built),
    Scenario("train", ["train", "src", *RECIPE, "--steps", str(STEPS), "--out", "t_new"], "t_new",
             trains_to_the_reference),
    Scenario("train-force", ["train", "src", *RECIPE, "--steps", str(STEPS), "--out", "t_old", "--force"], "t_old",
             trains_to_the_reference),
    Scenario("resume", ["train", "half", "--resume", "--steps", str(STEPS)], "half", trains_to_the_reference,
             in_place=True),
    Scenario("export", ["export", "t_old", "--out", "e_old", "--force"], "e_old", as_exported),
    Scenario("frontier", [*FRONTIER, "--ratios", "0.5,0.25"], "fr", reruns_to_the_reference, in_place=True,
             budget=(0, 0, 0)),  # `make test-slow` only: a frontier trains and evaluates (its runs are `train`s)
]
REFERENCE: dict[str, dict] = {}
CORPUS: list[Path] = []
TRIED: list[tuple] = []  # (scenario, action, write) of every injection, for the reliability report


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """The files every scenario starts from: data, a build, trained runs, an export, an older build."""
    root = tmp_path_factory.mktemp("template")
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py", "fnmatch.py", "glob.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    CORPUS[:] = [tmp_path_factory.mktemp("data") / "corpus.jsonl"]  # (runs store their data path absolute)
    CORPUS[0].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for argv in (["build", *TINY, "-o", "src"], ["build", *TINY, "--seed", "2", "-o", "b_old"],
                 ["train", "src", *RECIPE, "--steps", "2", "--out", "t_old"],
                 ["train", "src", *RECIPE, "--steps", "2", "--out", "half"],
                 ["export", "t_old", "--out", "e_old"]):
        r = cli_run(root, argv)
        assert r.exit_code == 0, r.output
    for sc in SCENARIOS:
        if sc.name != "frontier":
            reference_output(root, sc, tmp_path_factory)
    return root


def reference_output(root: Path, sc: Scenario, tmp_path_factory) -> None:
    """What the command writes without a fault (on a copy of ``root``), for its completeness check."""
    ref = tmp_path_factory.mktemp(f"ref-{sc.name}")
    shutil.copytree(root, ref, dirs_exist_ok=True)
    r = cli_run(ref, sc.argv)
    assert r.exit_code == 0, r.output
    REFERENCE[sc.name] = (weights(ref / sc.output) if sc.complete is trains_to_the_reference else
                          {row["run"]: row["mean_bits"] for row in
                           json.loads((ref / sc.output / "frontier.json").read_text())["rows"]}
                          if sc.complete is reruns_to_the_reference else part(snapshot(ref), sc.output))


@pytest.fixture(scope="module")
def with_frontier(template, tmp_path_factory):
    """The template plus an earlier frontier (one point) that the frontier scenario extends."""
    r = cli_run(template, [*FRONTIER, "--ratios", "0.5"])
    assert r.exit_code == 0, r.output
    reference_output(template, next(sc for sc in SCENARIOS if sc.name == "frontier"), tmp_path_factory)
    return template


def writes(template: Path, sc: Scenario, tmp: Path) -> list[tuple]:
    """The command's writes under its root, in order (a clean run)."""
    root = fresh(template, tmp / "count")
    injector = Injector(root)
    r = cli_run(root, sc.argv, injector)
    assert r.exit_code == 0, r.output
    return injector.log


def fresh(template: Path, root: Path) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)
    return root.resolve()


def inject(template: Path, sc: Scenario, root: Path, at: int, action: str) -> list[str]:
    """Run the scenario with ``action`` at write ``at``; the problems found (empty: nothing lost)."""
    root = fresh(template, root)
    before = snapshot(root)
    if action == "sigkill":
        code = run_killed(root, at, with_data(sc.argv))
        assert code != 0 or at > 10**6, f"the child did not die at write {at}"
    else:
        r = cli_run(root, sc.argv, Injector(root, at, action))
        code = r.exit_code
        if action == "sigint" and code not in (0, 130):
            return [f"Ctrl-C exited {code}, not 130: {r.output[-300:]}"]
    after = snapshot(root)
    problems = [f"changed or lost: {rel}" for rel in damaged(before, after, sc.output)]
    problems += [f"left behind: {rel}" for rel in leftovers(after, before, sc.output)]
    old, new = part(before, sc.output), part(after, sc.output)
    if (root / sc.output).exists() and new != old:  # not the old folder: the new one, complete
        problems += sc.complete(root, sc)
    elif not (root / sc.output).exists() and old:
        problems.append(f"{sc.output} existed and is gone")
    if staged_left(root) and not problems:  # a killed writer's staging folder is swept by its next run
        r = cli_run(root, sc.argv)
        if r.exit_code != 0 or staged_left(root):
            problems.append(f"the next run after a kill did not recover: {r.output[-300:]}")
    return problems


def staged_left(root: Path) -> bool:
    return any(p.is_dir() and p.name.endswith(fs.STAGING_SUFFIX) for p in root.iterdir())


def spread(log: list[tuple], budget: int | None, output: str) -> list[int]:
    """Write points to try: all of them (budget None), else the renames that publish ``output`` (and its
    checkpoints) plus an even spread of ``budget`` points, the first and the last included."""
    n = len(log)
    if budget is None:
        return list(range(1, n + 1))
    publish = [k for k, what, rel in log if what in ("rename", "replace") and rel.split("/")[0] == output]
    even = {1 + round(i * (n - 1) / max(1, budget - 1)) for i in range(budget)}
    return sorted(set(publish[-1:]) | even)


def sweep(template, tmp_path, budget_error, budget_sigint, budget_kill):
    failures = {}
    for sc in SCENARIOS:
        budgets = sc.budget if sc.budget and budget_error is not None else (budget_error, budget_sigint, budget_kill)
        if budgets == (0, 0, 0):
            continue
        log = writes(template, sc, tmp_path)
        assert log, f"{sc.name}: no write was seen"
        for action, budget in zip(("error", "sigint", "sigkill"), budgets):
            if budget == 0:
                continue
            points = spread(log, budget, sc.output)
            if action == "sigkill" and budget is not None:  # a child process each: the last publish, the middle
                publish = [k for k in points if log[k - 1][1] in ("rename", "replace")]
                points = list(dict.fromkeys([*publish[-1:], len(log) // 2]))[:budget]
            for at in points:
                TRIED.append((sc.name, action, at))
                problems = inject(template, sc, tmp_path / "work", at, action)
                if problems:
                    failures[f"{sc.name} {action} at write {at} ({log[at - 1][1]} {log[at - 1][2]})"] = problems
    return failures


def test_every_writing_command_survives_faults(template, tmp_path):
    failures = sweep(template, tmp_path, budget_error=3, budget_sigint=2, budget_kill=1)
    assert not failures, json.dumps(failures, indent=1)


@pytest.mark.slow
def test_every_writing_command_survives_a_fault_at_every_write(with_frontier, tmp_path):
    failures = sweep(with_frontier, tmp_path, budget_error=None, budget_sigint=None, budget_kill=None)
    assert not failures, json.dumps(failures, indent=1)


def naive_replace(new: Path, dest: Path) -> None:
    """What the harness must catch: the old folder removed before the new one is in place."""
    if dest.exists():
        shutil.rmtree(dest)
    import os

    os.rename(new, dest)


def test_negative_control_a_naive_publish_is_caught(template, tmp_path, monkeypatch):
    monkeypatch.setattr(fs, "replace_dir", naive_replace)
    sc = SCENARIOS[0]  # build --force over an older build
    log = writes(template, sc, tmp_path)
    renames = [k for k, what, rel in log if what == "rename" and rel == sc.output]
    assert renames, log
    problems = inject(template, sc, tmp_path / "work", renames[-1], "error")
    assert any("is gone" in p for p in problems), problems


def test_a_cache_is_filled_once_whole_or_not_at_all(tmp_path):
    """fs.fill_cache (the converted-backbone cache): a failure leaves no folder and no temporary one; a
    success publishes the whole folder; a folder another process published meanwhile is kept."""
    cache = tmp_path / "cache" / "model"

    def fails(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fs.fill_cache(cache, fails)
    assert not cache.exists() and list(cache.parent.iterdir()) == []

    def write(tmp):
        (tmp / "config.json").write_text("{}")
        (tmp / "model.bin").write_bytes(b"weights")

    assert fs.fill_cache(cache, write) == cache
    assert sorted(p.name for p in cache.iterdir()) == ["config.json", "model.bin"]

    def someone_else_first(tmp):
        (tmp / "config.json").write_text('{"mine": true}')

    fs.fill_cache(cache, someone_else_first)  # the published folder stays as it was
    assert (cache / "config.json").read_text() == "{}" and [p.name for p in cache.parent.iterdir()] == ["model"]
