"""Running the frontier: build, train (skip, resume) and evaluate each scheduled run, caching the
evaluations in the run folders."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

from ... import fs, run_files
from ...backbone import decoder
from ...builder import build as build_model
from ...builder import read_run, save
from ...config import BuildConfig
from ...diagnostics import evaluate_folder as eval_one
from ...errors import RunFolderError
from ...flops import Shape, ideal_ratio, pruned_flops
from ...scoring import Scorer
from ...training import Trainer
from .reporting import summarise, write_json
from .scheduling import BUILDS, FrontierSpec, ScheduledRun, describe_kind, run_state

EVAL_FILE = "frontier-eval.json"
TASKS_FILE = "frontier-tasks.json"  # a run's lm-eval task metrics, cached like EVAL_FILE


def _ensure_build(folder: Path, build: BuildConfig, log) -> Path:
    """The untrained model a run starts from (one per split), built once."""
    try:
        if read_run(folder)["config"] == build.to_dict():
            return folder
    except RunFolderError:
        pass
    log("building", f"{folder} ...")
    save(build_model(build), folder, force=True)
    return folder


# -- running ---------------------------------------------------------------------------------
def _eval_key(spec: FrontierSpec, step: int) -> dict:
    return {"step": step, "domains": [[d.label, d.source] for d in spec.domains], "batches": spec.eval_batches,
            "batch": spec.eval_batch, "seq_len": spec.seq_len, "controls": spec.controls, "dtype": spec.train.dtype}


def _finite(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def evaluate_run(folder: Path, run: ScheduledRun, spec: FrontierSpec) -> dict:
    """Per domain: bits/token, realised ratio, ΔNLL controls and the FLOP ratio to dense. The held-out
    batches are exactly those of ``concept eval RUN --data SOURCE --eval-batches N --batch B --seq-len T``."""
    model, out = None, {}
    T = spec.seq_len
    for d in spec.domains:
        model, _, _, r = eval_one(folder, d.source, T, spec.eval_batches, spec.eval_batch, spec.controls, None,
                                  None, spec.train.device, model, dtype=spec.train.dtype)  # (as the runs trained)
        if run.kind == "streaming":
            realised = _finite(r.get("ratio"))
            flop = ideal_ratio(model, realised, T).ratio if realised is not None else None
        elif run.kind == "pruned":
            shape = Shape.from_hf_config(model.backbone.config)
            flop = pruned_flops(shape, len(model.layers), T) / pruned_flops(shape, len(decoder(model.backbone).layers), T)
        else:
            flop = 1.0
        out[d.label] = {"bits_per_token": _finite(r.get("bits_per_token")), "nll": _finite(r.get("nll")),
                        "tokens": r.get("tokens"), "ratio": _finite(r.get("ratio")),
                        "delta_nll_shuffle": _finite(r.get("delta_nll_shuffle")),
                        "delta_nll_random": _finite(r.get("delta_nll_random")),
                        "delta_nll_codes_shuffled": _finite(r.get("delta_nll_codes_shuffled")),
                        "delta_nll_codes_zero": _finite(r.get("delta_nll_codes_zero")),
                        "gate_norm": _finite(r.get("gate_norm")), "flop_ratio": flop}
    return out


def _tasks_key(spec: FrontierSpec, step: int) -> dict:
    return {"step": step, "tasks": list(spec.tasks), "limit": spec.tasks_limit, "include_path": list(spec.include_path),
            "dtype": spec.train.dtype}


def evaluate_tasks(folder: Path, spec: FrontierSpec, log) -> dict:
    """The run's lm-eval task metrics (``concept eval RUN --tasks ...``), cached in its TASKS_FILE for this step."""
    # lazy: lm-eval is the optional `eval` extra; a frontier without --tasks must not need it
    from .. import harness

    key = _tasks_key(spec, (run_files.checkpoint_state(folder) or {}).get("step"))
    cache = folder / TASKS_FILE
    cached = _cached(cache, key, "tasks")
    if cached is not None:
        return cached
    log("evaluating", f"{folder.name} on tasks {', '.join(spec.tasks)} (lm-eval) ...")
    manager = harness.resolve_tasks(list(spec.tasks), spec.include_path)
    scorer = Scorer.from_run(folder, spec.train.device, spec.eval_batch, dtype=spec.train.dtype)
    tasks = harness.evaluate_tasks(scorer, list(spec.tasks), manager, spec.tasks_limit)
    write_json(cache, {"key": key, "tasks": tasks})
    return tasks


def _cached(file: Path, key: dict, field: str) -> dict | None:
    """``field`` of the cache file written for ``key`` (an object), or None: no cache, another key, or a damaged
    file (it is only a cache: the value is computed again and the file rewritten)."""
    try:
        saved = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
    except (OSError, ValueError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None
    value = saved.get(field) if isinstance(saved, dict) and saved.get("key") == key else None
    return value if isinstance(value, dict) else None


def run(spec: FrontierSpec, planned: list[ScheduledRun], out: str | os.PathLike, force: bool = False,
        train: Callable | None = None, log: Callable[[str, str], None] | None = None) -> dict:
    """Train what is missing (skip complete runs, resume interrupted ones), evaluate every run, and
    return the frontier (``rows`` + ``best``; see :func:`summarise`). ``train(trainer)`` runs a
    trainer (default ``trainer.train()``); ``log(verb, detail)`` receives progress lines."""
    out = Path(out)
    log = log or (lambda verb, detail="": None)
    train = train or (lambda trainer: trainer.train())
    out.parent.mkdir(parents=True, exist_ok=True)
    with fs.Lock(out):  # one frontier writes OUT at a time (each run it trains also holds the run's own lock)
        rows = [_run_one(spec, r, out / r.name, f"[{i}/{len(planned)}] {r.name}", force, train, log)
                for i, r in enumerate(planned, 1)]
    return summarise(spec, planned, rows)


def _run_one(spec: FrontierSpec, r: ScheduledRun, folder: Path, tag: str, force: bool, train, log) -> dict:
    """Train (or skip, or resume) one run of the frontier and evaluate it: its row."""
    out = folder.parent
    state = run_state(folder, r)
    for note in r.notes:
        log("note:", f"{r.name}: {note}")
    action = state["status"]
    if action == "complete":
        log("skipping", f"{tag}: complete (step {state['step']})")
    elif action == "resume":
        log("resuming", f"{tag} from step {state['step']} ...")
        trainer = Trainer.resume(folder, device=r.train.device)  # (holds the run's lock)
        (folder / EVAL_FILE).unlink(missing_ok=True)  # evaluated weights are about to change
        (folder / TASKS_FILE).unlink(missing_ok=True)
        _train(trainer, train, log, r.name)
    else:
        if action in ("differs", "foreign", "damaged", "restart"):
            if action != "restart" and not force:  # (schedule() refuses these first)
                raise RunFolderError(f"{folder} holds another run; pass --force to replace it")
            log("replacing" if action != "restart" else "restarting",
                f"{folder}" + (" (no checkpoint was written)" if action == "restart" else "")
                + " once the new run has finished")
        source = _ensure_build(out / BUILDS / r.build_name, r.build, log)
        log("training", f"{tag} ({r.kind}: {describe_kind(r)}) ...")
        trainer = Trainer.start(source, folder, r.train, force=True)  # replaces `folder` only when trained
        _train(trainer, train, log, r.name)
    return _row(r, folder, spec, action, log)


def _train(trainer, train, log, name) -> None:
    for note in trainer.notes:
        log("note:", f"{name}: {note}")
    noted = len(trainer.notes)
    train(trainer)
    for note in trainer.notes[noted:]:
        log("note:", f"{name}: {note}")


def _row(r: ScheduledRun, folder: Path, spec: FrontierSpec, action: str, log=lambda verb, detail: None) -> dict:
    step = (run_files.checkpoint_state(folder) or {}).get("step")
    key = _eval_key(spec, step)
    cache = folder / EVAL_FILE
    cached = _cached(cache, key, "domains")
    if cached is not None and not all(isinstance(cached.get(d.label), dict) for d in spec.domains):
        cached = None
    if cached is None:
        log("evaluating", f"{r.name} on {', '.join(d.source for d in spec.domains)} ...")
    domains_ = cached if cached is not None else evaluate_run(folder, r, spec)
    if cached is None:
        write_json(cache, {"key": key, "domains": domains_})
    row = {**r.describe(), "path": str(folder), "step": step,
           "trained": {"complete": "skipped", "resume": "resumed"}.get(action, "trained"), "domains": domains_}
    if spec.tasks:
        row["tasks"] = evaluate_tasks(folder, spec, log)
    return row
