"""Experiment trackers for ``concept train --report-to`` (transformers' convention): each logged metrics row
(what ``metrics.jsonl`` gets) also goes to TensorBoard, Weights & Biases, MLflow or a plain CSV file.

One module per backend, each a :class:`Tracker`; the optional package is imported only when its tracker opens,
and a missing one is a problem naming its extra (:func:`problems`, checked before anything is written).

Standard library only here.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Protocol

# --report-to NAME -> (the module that imports it, the extra that installs it); csv needs nothing
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class Tracker(Protocol):
    def log(self, step: int, row: dict) -> None:
        """One metrics row (as written to metrics.jsonl) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and release (the end of ``train``, also after an error)."""


NAMES = ("none", "csv", "tensorboard", "wandb", "mlflow")


def names(report_to: str) -> list[str]:
    """The trackers of ``--report-to``: one name or several, comma-separated (``tensorboard,csv``)."""
    return [n for n in (part.strip() for part in str(report_to).split(",")) if n and n != "none"]


def problems(report_to: str) -> list[str]:
    """Why ``--report-to`` cannot run here ([] if it can): an unknown name, or a tracker's package is missing."""
    found = []
    for name in names(report_to):
        if name not in NAMES:
            found.append(f"report-to: {name!r} is not a tracker; one or more of {', '.join(NAMES)}, comma-separated")
            continue
        module, extra = PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            found.append(f"report-to {name}: the {module} package is not installed: pip install 'concept[{extra}]'")
    return found


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics row, nested keys joined by ``/`` (``eval/nll``); lists, strings, None,
    NaN and booleans left out."""
    found = {}
    for key, value in row.items():
        if isinstance(value, dict):
            found.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            found[f"{prefix}{key}"] = float(value)
    return found


def open_trackers(report_to: str, out: Path, config: dict, run_name: str, first_step: int) -> list[Tracker]:
    """The trackers ``--report-to`` names, each open (:func:`open_tracker`)."""
    opened = []
    try:
        for name in names(report_to):
            opened.append(open_tracker(name, out, config, run_name, first_step))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened


def open_tracker(name: str, out: Path, config: dict, run_name: str, first_step: int) -> Tracker:
    """The tracker ``name``, logging for the run folder ``out``; ``config`` is train.json's content,
    ``first_step`` the step of the first row this run will log (a resumed run's earlier rows are in
    metrics.jsonl already)."""
    if name == "csv":
        # lazy: the backend's module (and its optional package) loads only when its tracker opens
        from .csv_log import CSVTracker

        return CSVTracker(out)
    if name == "tensorboard":
        # lazy: the backend's module (and its optional package) loads only when its tracker opens
        from .tensorboard_log import TensorBoardTracker

        return TensorBoardTracker(out, config, first_step)
    if name == "wandb":
        # lazy: the backend's module (and its optional package) loads only when its tracker opens
        from .wandb_log import WandbTracker

        return WandbTracker(out, config, run_name)
    if name == "mlflow":
        # lazy: the backend's module (and its optional package) loads only when its tracker opens
        from .mlflow_log import MLflowTracker

        return MLflowTracker(config, run_name)
    raise ValueError(f"unknown tracker {name!r}")
