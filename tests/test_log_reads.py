"""Objectives that only log read nothing per step (issue 39): Hard-EM's E-step ratios (``log_stats``, worked out
when the step's log is read) and the k-means initialisation's report (host values returned by ``device_step``) no
longer make the trainer read every step's log (``after_step`` did). A planner run with both, ``--log-every 3``
over 6 steps, reads the log twice (at step 4, one step late, and at the end) and logs the same rows as the
reference (the two hooks as they were: ``after_step``, a read per step), which is the negative control."""
import json
import pathlib

import pytest
import torch

import concept
from benchmarks.step_syncs import CONTINUE, builds, corpus
from concept.codes import KMeansInit
from concept.planner.hard_em import HardEMObjective
from concept.syncs import HostSyncs
from concept.training import TrainConfig, Trainer

from .test_step_syncs import loop_counted

pytestmark = pytest.mark.usefixtures("one_thread")

TIMINGS = {"tokens_per_s", "estep_s"}  # (host clocks: differ between any two runs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("log-reads")
    corpus(folder)
    torch.manual_seed(0)
    concept.save(concept.build(builds()["planner"]), folder / "builds" / "planner")
    return folder


def run(folder, name, monkeypatch) -> tuple[HostSyncs, list[dict]]:
    """6 steps of the planner with Hard-EM and ``--kmeans-init 1``, ``--log-every 3``, through the training loop
    (its final checkpoint a declared point); returns the counter and the logged rows."""
    config = TrainConfig(**{**CONTINUE, "steps": 6, "batch": 2, "eval_every": 100, "checkpoint_every": 100,
                            "log_every": 3, "warmup": 1, "data": str(folder / "code.jsonl"),
                            "lora": concept.lora.LoraSettings(rank=2), "plan_training": "hard-em", "beam": 2,
                            "estep_every": 2, "kmeans_init": 1})
    torch.manual_seed(0)
    trainer = Trainer.start(folder / "builds" / "planner", folder / name, config, force=True)
    seen = loop_counted(trainer, monkeypatch)
    rows = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
    return seen, [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows if "step" in r]


def as_they_were(monkeypatch) -> None:
    """The reference: both objectives log through ``after_step`` (the trainer then reads every step's log)."""
    ratios = HardEMObjective.log_stats
    monkeypatch.setattr(HardEMObjective, "after_step", lambda self, model, means, totals: ratios(self, means, totals),
                        raising=False)
    monkeypatch.setattr(HardEMObjective, "log_stats", lambda self, means, totals: {})

    def report(self, model, means, totals):
        done, self.report = self.report, {}
        return done

    monkeypatch.setattr(KMeansInit, "after_step", report, raising=False)
    monkeypatch.setattr(KMeansInit, "device_step", lambda self, model, means, totals, skipped: {})


def test_log_only_objectives_read_the_log_every_log_every_steps(folder, monkeypatch):
    seen, rows = run(folder, "now", monkeypatch)
    reads = seen.declared["step log"]
    with monkeypatch.context() as m:
        as_they_were(m)
        before, reference = run(folder, "before", m)
    assert reads == 2 and before.declared["step log"] == 6  # negative control: the old hooks read every step
    assert seen.hidden == before.hidden == 0
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows == reference  # the same keys and values in every row
    assert rows[0]["kmeans_codes"] > 0 and "kmeans_codes" not in rows[1]  # logged once, with step 1
    assert all(r["estep_share"] == 1 and r["estep_margin"] >= 0 for r in rows)
    assert not any("flip_rate" in r for r in rows)  # absent where no cached plan was searched (old = 0): new rows
