"""Experiment tracking: `train --report-to`, what train.json records of the environment, and the progress that
`train` / `eval` print while they run."""
import csv
import io
import json
import subprocess
import sys
import types
from importlib.metadata import version

import pytest
import torch

from concept import tracking, versions
from tests.test_cli import fails
from tests.test_cli_train import FAST, run
from tests.test_cli_train import built  # noqa: F401  (fixture)
from tests.test_training import corpus  # noqa: F401  (fixture)


def metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def scalars_logged(out) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard event files of ``out`` read back: {tag: [(step, value)]}."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def csv_rows(out) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_tracked(built, corpus, out, *options):  # noqa: F811
    r = run("train", built, "--data", corpus, "--steps", 2, *FAST, "--eval-every", 2, "--checkpoint-every", 2,
            "--out", out, "--report-to", "tensorboard,csv", *options)
    assert r.exit_code == 0, r.output
    return r


def test_tensorboard_csv_versions_and_progress_lines(built, corpus, tmp_path):  # noqa: F811
    """The event file read back and metrics.csv hold every logged metric at its step; train.json names the
    versions and the commit; on a non-terminal stderr train and eval print a line every --log-every steps /
    batches."""
    out = tmp_path / "m-train"
    r = train_tracked(built, corpus, out, "--log-every", 1)
    lines = [line for line in r.stderr.splitlines() if line.startswith("train step")]
    assert [line.split()[2] for line in lines] == ["1/2", "2/2"], r.stderr
    assert "loss" in lines[0] and "tok/s" in lines[0] and "ETA" in lines[0]

    rows, logged, table = metrics(out), scalars_logged(out), csv_rows(out)
    assert [s for s, _ in logged["loss"]] == [1, 2]
    assert [v for _, v in logged["loss"]] == pytest.approx([row["loss"] for row in rows], rel=1e-6)
    assert logged["eval/nll"] == [(2, pytest.approx(rows[1]["eval"]["nll"], rel=1e-6))]
    assert "step" not in logged
    assert [int(float(t["step"])) for t in table] == [row["step"] for row in rows] == [1, 2]
    assert [float(t["loss"]) for t in table] == pytest.approx([row["loss"] for row in rows])
    assert table[0]["eval/nll"] == "" and float(table[1]["eval/nll"]) == pytest.approx(rows[1]["eval"]["nll"])

    record = json.loads((out / "train.json").read_text())
    assert record["report_to"] == "tensorboard,csv"
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["concept"] == version("concept")
    assert record["versions"]["transformers"] and record["versions"]["peft"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=versions.CHECKOUT, capture_output=True, text=True)
    if head.returncode == 0:  # the tests run from a checkout
        assert record["git_sha"].split("+")[0] == head.stdout.strip()

    r = run("eval", out, "--batches", 3, "--batch", 1, "--seq-len", 16, "--no-controls", "--log-every", 2)
    assert r.exit_code == 0, r.output
    assert [line.split()[3] for line in r.stderr.splitlines() if line.startswith("eval ")] == ["2/3", "3/3"], r.stderr


@pytest.mark.slow
def test_a_resume_logs_no_step_twice(built, corpus, tmp_path):  # noqa: F811
    """A run stopped after its checkpoint at step 2 had logged step 3: the resume drops it from metrics.jsonl,
    rebuilds metrics.csv from the kept rows and purges the TensorBoard events past the checkpoint."""
    out = tmp_path / "m-train"
    train_tracked(built, corpus, out)
    with open(out / "metrics.jsonl", "a") as f:  # what a run killed during step 4 leaves: a logged step 3
        f.write(json.dumps({**metrics(out)[-1], "step": 3, "loss": 99.0}) + "\n")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(out / "tensorboard")) as writer:
        writer.add_scalar("loss", 99.0, 3)
    assert (3, 99.0) in scalars_logged(out)["loss"]
    r = run("train", out, "--resume", "--steps", 4, "--log-every", 1)
    assert r.exit_code == 0, r.output
    assert [line.split()[2] for line in r.stderr.splitlines() if line.startswith("train step")] == ["3/4", "4/4"]
    rows, logged, table = metrics(out), scalars_logged(out), csv_rows(out)
    assert [row["step"] for row in rows] == [int(float(t["step"])) for t in table] == [1, 2, 3, 4]
    assert [s for s, _ in logged["loss"]] == [1, 2, 3, 4]
    assert 99.0 not in [float(t["loss"]) for t in table] + [v for _, v in logged["loss"]]


def test_a_missing_tracker_package_names_its_extra(built, corpus, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    for name in ("tensorboard", "wandb", "mlflow"):
        fails(run("train", built, "--data", corpus, "--steps", 2, *FAST, "--out", tmp_path / name, "--report-to",
                  name), 2, f"pip install 'concept[{name}]'")
        assert not (tmp_path / name).exists()
    assert tracking.problems("csv") == tracking.problems("none") == []
    fails(run("train", built, "--data", corpus, "--steps", 2, *FAST, "--out", tmp_path / "x", "--report-to",
              "csv,tensorbord"), 2, "'tensorbord' is not a tracker")


def test_wandb_and_mlflow_get_the_config_and_each_metric_at_its_step(monkeypatch, tmp_path):
    """Their clients' calls (stand-in modules: neither service is reachable here)."""
    calls = []
    fake_run = types.SimpleNamespace(log=lambda values, step: calls.append(("wandb.log", values, step)),
                                     finish=lambda: calls.append(("wandb.finish",)))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kw: calls.append(("wandb.init", kw)) or fake_run))
    monkeypatch.setitem(sys.modules, "mlflow", types.SimpleNamespace(
        start_run=lambda run_name: calls.append(("mlflow.start_run", run_name)),
        log_params=lambda params: calls.append(("mlflow.log_params", params)),
        log_metrics=lambda values, step: calls.append(("mlflow.log_metrics", values, step)),
        end_run=lambda: calls.append(("mlflow.end_run",))))
    row = {"step": 3, "loss": 2.5, "ratio": float("nan"), "eval": {"nll": 1.5}, "usage": [1, 2]}
    for tracker in tracking.open_trackers("wandb,mlflow", tmp_path, {"steps": 4, "lora": {"rank": 2}}, "m-train", 1):
        tracker.log(3, row)
        tracker.close()
    assert calls == [
        ("wandb.init", {"project": "concept", "name": "m-train", "dir": str(tmp_path),
                        "config": {"steps": 4, "lora": {"rank": 2}}}),
        ("mlflow.start_run", "m-train"), ("mlflow.log_params", {"steps": "4", "lora.rank": "2"}),
        ("wandb.log", {"loss": 2.5, "eval/nll": 1.5}, 3), ("wandb.finish",),
        ("mlflow.log_metrics", {"loss": 2.5, "eval/nll": 1.5}, 3), ("mlflow.end_run",)]


def test_git_sha_is_none_outside_a_checkout_and_never_fails(tmp_path, monkeypatch):
    assert versions.git_sha(tmp_path) is None
    (tmp_path / ".git").mkdir()  # looks like a checkout, but git cannot read it
    assert versions.git_sha(tmp_path) is None

    def broken(*args, **kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(versions.subprocess, "run", broken)
    assert versions.git_sha() is None
    assert versions.versions()["torch"] == torch.__version__


def test_eval_shows_a_progress_bar_on_a_terminal(monkeypatch):
    from concept_cli.eval_cmd import batch_progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    with batch_progress("runs/x", log_every=1) as progress:
        for done in range(4):
            progress(done, 3)
    shown = sys.stderr.getvalue()
    assert "eval" in shown and "3/3" in shown and "batch" not in shown  # the bar, not the plain lines
