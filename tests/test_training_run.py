"""The run folder a Trainer holds (concept.training_run.RunFolder): its records and its lock, without a model
(the trainer's own behaviour around it: tests/test_training.py, tests/test_writes.py, tests/test_cli_train.py)."""
from __future__ import annotations

import json

from concept import fs
from concept.builder import TRAIN_FILE
from concept.training_run import METRICS, RunFolder


def rows_of(*steps):
    return [(json.dumps({"step": s, "loss": 1.0}), {"step": s, "loss": 1.0}) for s in steps]


def test_resume_keeps_the_metrics_up_to_the_checkpoint_and_rewrites_only_a_changed_file(tmp_path):
    run = RunFolder(tmp_path)
    kept = "".join(line + "\n" for line, _ in rows_of(1, 2, 3))
    (tmp_path / METRICS).write_text(kept + json.dumps({"step": 4, "loss": 1.0}) + "\n")
    run.commit_resume(rows_of(1, 2, 3, 4), step=3)
    assert (tmp_path / METRICS).read_text() == kept
    assert [r["step"] for r in run.metrics()] == [1, 2, 3]
    before = (tmp_path / METRICS).stat().st_mtime_ns
    run.commit_resume(rows_of(1, 2, 3), step=3)  # nothing to drop: the file is not written again
    assert (tmp_path / METRICS).stat().st_mtime_ns == before


def test_records_and_the_lock(tmp_path):
    run = RunFolder(tmp_path)
    run.write_record({"steps": 3, "source": "runs/m1"}, "runs/m1")
    assert json.loads((tmp_path / TRAIN_FILE).read_text())["steps"] == 3 and run.source_run == "runs/m1"
    run.append_metrics({"step": 1})
    assert run.metrics() == [{"step": 1}]
    run.lock = fs.Lock(tmp_path).acquire()
    run.release()
    assert run.lock is None
    fs.Lock(tmp_path).acquire().release()  # released: another writer may take it
    assert "checkpoint saved in" in str(run.interrupted(5))
