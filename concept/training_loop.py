"""The training loop of a run (``Trainer.train``): the evaluation and checkpoint cadence, reading the step log one
step late, Ctrl-C (alone: stop after the step; several ranks: agreed with the step log), the metrics and the
trackers (``--report-to``), and publishing or discarding the run folder at the end."""
from __future__ import annotations

import math
import signal
from typing import Callable

from . import tracking
from .distributed import Dist
from .train_step import StepRunner
from .training_run import RunFolder


def finite(value):
    """Strict JSON: NaN / inf (e.g. a diagnostic with no concept in the batch) become null."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TrainingLoop:
    """Runs a run's steps to ``config.steps``. ``queue_step``, ``save``, ``evaluate`` (None: no held-out data),
    ``skip_error``, ``record`` and ``plot`` are the trainer's; the steps themselves are the ``runner``'s."""

    def __init__(self, config, runner: StepRunner, run: RunFolder, dist: Dist, objectives: list, *,
                 queue_step: Callable[[], None], save: Callable[[], None], evaluate: Callable[[], dict] | None,
                 skip_error: Callable, autocast: Callable, record: Callable[[str | None], dict],
                 plot: Callable[[], object]):
        self.config, self.runner, self.run, self.dist, self.objectives = config, runner, run, dist, objectives
        self.queue_step, self.save, self.evaluate, self.skip_error = queue_step, save, evaluate, skip_error
        self.autocast, self.record, self.plot = autocast, record, plot
        self.last_row: dict = {}
        self.trackers: list = []  # --report-to: opened by train()
        self.stopping = False  # a Ctrl-C alone stops after the step (several ranks: ``stop``, agreed)

    @property
    def stop(self) -> bool:
        """Stop after this step: a Ctrl-C (alone), or one any rank saw, read back with the step log."""
        return self.stopping or self.runner.stop_agreed

    def on_sigint(self, signum, frame):
        if self.runner.interrupted:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.runner.interrupted = True
        self.stopping = self.stopping or self.dist.world_size == 1  # several ranks agree on it with the step log

    def log(self, row: dict) -> None:
        if self.dist.is_main:
            self.run.append_metrics(finite(row))
            for tracker in self.trackers:
                tracker.log(row["step"], row)

    def train(self, progress=None) -> dict:
        """Run until ``config.steps``; returns the final held-out evaluation. A run replacing an existing folder
        (``start(force=True)``) publishes only here, once every step is trained; anything that stops it before (an
        error, Ctrl-C) discards it and leaves the old folder as it was."""
        try:
            if self.dist.is_main and tracking.names(self.config.report_to):
                self.trackers = tracking.open_trackers(self.config.report_to, self.run.out,
                                                       self.record(self.run.source_run), self.run.name,
                                                       self.runner.step + 1)
            try:
                self.loop(progress)
            finally:
                for tracker in self.trackers:
                    tracker.close()
                self.trackers = []
            if self.dist.is_main:
                self.plot()
            if self.stop:
                raise self.run.interrupted(self.runner.step)
            self.run.publish(self.dist)  # every step trained: a new run replacing a folder replaces it now
        except BaseException:
            self.run.discard(self.dist)  # an unfinished replacement: the old folder stays
            raise
        finally:
            self.run.release()
        if self.last_row:
            return self.last_row.get("eval", {})
        return self.run.metrics()[-1].get("eval", {}) if self.dist.is_main and self.run.metrics() else {}

    def loop(self, progress) -> None:
        """Queue the steps; read their logs one step late (at step k + 1 the values of the steps up to k, every
        ``log_every`` steps, so the device always has the next step queued while the host waits), and all of
        them before an evaluation, a checkpoint and the end (a skipped step is never saved over)."""
        cfg, runner = self.config, self.runner
        previous = signal.signal(signal.SIGINT, self.on_sigint)
        try:
            while runner.step < cfg.steps and not self.stop:
                self.queue_step()
                last = runner.step == cfg.steps
                evaluate = self.evaluate is not None and (runner.step % cfg.eval_every == 0 or last)
                save = runner.step % cfg.checkpoint_every == 0 or last or self.stop
                if evaluate or save or runner.acting_on_host:
                    rows = runner.read_log()
                elif (runner.step - 1) % cfg.log_every == 0:
                    rows = runner.read_log(keep=1)
                else:
                    continue
                self.handle_rows(rows, evaluate, progress)
                if self.stop and not save:  # a Ctrl-C while the rows were handled: the rest, then a checkpoint
                    self.handle_rows(runner.read_log(), False, progress)
                    save = True
                if save:
                    self.save()
        finally:
            signal.signal(signal.SIGINT, previous)

    def handle_rows(self, rows: list[dict], evaluate: bool, progress) -> None:
        """The steps' rows read back: a skipped step stops the run; the last step's final objectives, the
        evaluation, the log line and the progress callback."""
        for row in rows:
            if row.get("skipped"):
                self.log(row)
                raise self.skip_error(row)
            if row["step"] == self.config.steps:
                with self.autocast():
                    for objective in self.objectives:  # e.g. the ratio controller's final calibration
                        row.update(objective.finish(self.runner.context()))
            if evaluate and row["step"] == self.runner.step:
                row["eval"] = self.evaluate()
            self.log(row)
            self.last_row = row
            if progress is not None:
                progress(row)
