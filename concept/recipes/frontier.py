"""The quality / compute frontier: held-out bits per token against FLOPs, streaming vs baselines.

One set of runs, all trained with the same recipe and budget and evaluated on the same held-out
batches of several domains (code and prose by default):

* **streaming** models over splits x target ratios (``s4-22-4_r0.25``);
* for each streaming point the **FLOP-matched pruned baseline** (``concept train --baseline
  pruned``: the backbone minus the block of middle layers whose forward FLOPs match the
  streaming model's ideal at the target ratio and training length); points that remove the same
  block share one run (``pruned-L14-skip4-19``: 14 layers kept, layers 4..19 skipped);
* the **dense** baseline, once.

::

    spec = FrontierSpec(build=BuildConfig(), splits=["4,22,4", "10,10,10"], ratios=[0.5, 0.25],
                        train=TrainConfig(steps=30, seq_len=128, batch=4), domains=domains(["stdlib", "pydoc"]))
    planned = plan(spec, "runs/frontier")           # validates everything first: one ConfigError
    result = run(spec, planned, "runs/frontier")    # trains what is missing, evaluates every run
    write(result, "runs/frontier")                  # frontier.json, frontier.md, frontier.png

Run folders live in ``OUT/NAME``; the built (untrained) models they start from in
``OUT/builds/SPLIT``. A run is **complete** when its ``train.json`` holds the planned recipe and its
checkpoint is at the planned step count: a rerun skips it (and reuses its cached evaluation,
``frontier-eval.json``, when the evaluation settings are the same), resumes a run interrupted after
a checkpoint, and refuses a run trained with another recipe (``force=True`` retrains it).

FLOP ratios to dense are ideal forward FLOPs (``concept.flops``) at the evaluation length: for a
streaming run at the ratio it realised on that domain (``ideal_ratio``); for a pruned run its kept
layers over all layers (``pruned_flops``); dense = 1. The **best** streaming point is the one with
the lowest mean bits/token over the domains among those at <= ``max_flops`` on every domain.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import fs, run_files
from ..backbone import decoder
from ..baselines import prune_plan
from ..builder import build as build_model
from ..builder import build_backbone, read_run, save
from ..config import BuildConfig, _coerce, _unknown_msg, parse_value, resolve
from ..data import CORPORA, builtin_corpus, local_path, stored_source
from ..diagnostics import evaluate_folder as eval_one
from ..errors import ConceptError, ConfigError, RunFolderError
from ..flops import Shape, ideal_ratio, pruned_flops
from ..scoring import Scorer
from ..train_config import LoraSettings, TrainConfig
from ..training import DERIVED, Trainer

BUILDS = "builds"
EVAL_FILE = "frontier-eval.json"
TASKS_FILE = "frontier-tasks.json"  # a run's lm-eval task metrics, cached like EVAL_FILE
BEGIN, END = "<!-- frontier:begin -->", "<!-- frontier:end -->"
KINDS = ("streaming", "pruned", "dense")
DOMAIN_LABELS = {"stdlib": "code", "code": "code", "pydoc": "prose", "prose": "prose"}
# set per run by the frontier itself, never by --train-set
OWNED = ("target_ratio", "baseline", "prune_layers")
# do not change what a run learns: a run trained with other values is still complete
NOT_RECIPE = {"device", "eval_every", "checkpoint_every", "log_every", "eval_batches"}
# no effect on a dense or pruned baseline (no concepts, no new modules)
STREAMING_ONLY = {"target_ratio", "ratio_start", "ratio_warmup", "ratio_control", "ratio_loss_weight", "usage_weight",
                  "revive_after", "kmeans_init", "pi_ki", "calibration_batches", "tau_start", "tau_end", "lr_new", "placement"}


# -- the specification ----------------------------------------------------------------------
@dataclass
class Domain:
    label: str  # column name: "code", "prose", ...
    source: str  # what `concept eval --data` takes: a built-in corpus (its held-out split) or a path (read whole)


@dataclass
class FrontierSpec:
    build: BuildConfig  # the streaming builds' config; each split overrides its ``split``
    splits: list[str]
    ratios: list[float]
    train: "object"  # concept.training.TrainConfig: the shared recipe (target_ratio / baseline set per run)
    domains: list[Domain]
    eval_batches: int = 8
    eval_batch: int = 4
    eval_seq_len: int | None = None  # default: the training seq_len
    controls: bool = True  # the ΔNLL shuffled / random passes
    max_flops: float = 0.6
    baselines: tuple[str, ...] = ("pruned", "dense")  # which baselines to train with the streaming runs
    tasks: tuple[str, ...] = ()  # lm-eval tasks every run is also evaluated on (concept.recipes.harness)
    tasks_limit: int | None = None  # at most this many examples per task
    include_path: tuple[str, ...] = ()  # folders of the user's own task YAMLs

    @property
    def seq_len(self) -> int:
        return self.eval_seq_len or self.train.seq_len


@dataclass
class PlannedRun:
    name: str
    kind: str  # streaming | pruned | dense
    build_name: str  # OUT/builds/<build_name>: the folder the run starts from
    build: BuildConfig
    train: "object"  # TrainConfig
    split: tuple[int, int, int] | None = None  # streaming: its split
    target_ratio: float | None = None  # streaming: its target
    planned_flop_ratio: float = 1.0  # streaming: ideal at the target ratio; pruned: kept layers / dense
    removed: tuple[int, int] | None = None  # pruned: layers [start, stop) skipped
    kept_layers: int | None = None
    matches: list[str] = field(default_factory=list)  # pruned: the streaming runs it is FLOP-matched to
    pruned: str | None = None  # streaming: the name of its pruned baseline run
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        return {"run": self.name, "kind": self.kind, "split": _split_text(self.split), "target_ratio": self.target_ratio,
                "planned_flop_ratio": self.planned_flop_ratio, "build": self.build_name,
                "removed": list(self.removed) if self.removed else None, "kept_layers": self.kept_layers,
                "matches": self.matches, "pruned_baseline": self.pruned, "notes": self.notes}


def describe_kind(r: "PlannedRun") -> str:
    """E.g. ``split 4,22,4, target ratio 0.25`` / ``layers 7..22 removed, 14 kept``."""
    if r.kind == "streaming":
        return f"split {_split_text(r.split)}, target ratio {r.target_ratio:g}"
    if r.kind == "pruned":
        a, b = r.removed
        return f"layer{'s' * (b - a > 1)} {a}{f'..{b - 1}' if b - a > 1 else ''} removed, {r.kept_layers} kept"
    return "the backbone + LoRA"


def _split_text(split) -> str | None:
    return ",".join(map(str, split)) if split else None


def split_name(split: tuple[int, int, int]) -> str:
    return "s" + "-".join(map(str, split))


def run_name(split: tuple[int, int, int], ratio: float) -> str:
    return f"{split_name(split)}_r{ratio:g}"


def pruned_name(kept: int, removed: tuple[int, int]) -> str:
    """``pruned-L14-skip4-19``: 14 layers kept, layers 4..19 skipped (stable whatever else is planned)."""
    a, b = removed
    return f"pruned-L{kept}-skip{a}" + (f"-{b - 1}" if b - a > 1 else "")


# -- parsing the command's inputs ------------------------------------------------------------
def parse_splits(text: str) -> tuple[list[str], list[str]]:
    """``"4,22,4;6,18,6"`` -> (["4,22,4", "6,18,6"], problems)."""
    splits = [s.strip() for s in str(text or "").split(";") if s.strip()]
    if not splits:
        return [], [f"--splits: give at least one split, e.g. \"4,22,4;6,18,6\" (got {text!r})"]
    return list(dict.fromkeys(splits)), []


def parse_ratios(text: str) -> tuple[list[float], list[str]]:
    """``"0.5,0.25"`` -> ([0.5, 0.25], problems); every ratio in (0, 1)."""
    items = [s.strip() for s in str(text or "").split(",") if s.strip()]
    if not items:
        return [], [f"--ratios: give at least one target ratio in (0, 1), e.g. 0.5,0.25 (got {text!r})"]
    ratios, problems = [], []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            problems.append(f"--ratios: {item!r} is not a number")
            continue
        if not 0 < value < 1:
            problems.append(f"--ratios: a target ratio (concepts per token) must be in (0, 1), got {item}")
        else:
            ratios.append(value)
    return list(dict.fromkeys(ratios)), problems


def domains(sources: list[str]) -> tuple[list[Domain], list[str]]:
    """``--eval-data`` values (``SOURCE`` or ``LABEL=SOURCE``) -> domains, checked: a built-in corpus
    (stdlib/code, pydoc/prose) or an existing file or folder."""
    out, problems, labels = [], [], set()
    for item in sources:
        label, source = None, item
        if "=" in item and not os.path.exists(item):
            label, source = (s.strip() for s in item.split("=", 1))
            if not label or not source:
                problems.append(f"--eval-data {item!r}: write SOURCE or LABEL=SOURCE")
                continue
        try:
            corpus = builtin_corpus(source)
        except ConceptError as exc:
            problems.append(str(exc))
            continue
        if corpus is None and not os.path.exists(source):
            problems.append(f"--eval-data {source}: neither a built-in corpus ({', '.join(CORPORA)}) nor an existing "
                            f"file or folder")
            continue
        label = label or DOMAIN_LABELS.get(source) or Path(source).stem or source
        base, n = label, 2
        while label in labels:
            label, n = f"{base}{n}", n + 1
        labels.add(label)
        out.append(Domain(label, source))
    if not sources:
        problems.append("--eval-data: give at least one held-out source (e.g. stdlib, pydoc)")
    return out, problems


def train_overrides(config, items: list[str]):
    """Apply ``KEY=VALUE`` strings (TrainConfig field names, dashes allowed; ``lora.rank=4``) to a copy
    of ``config``; values are parsed as JSON when possible and coerced to the field's type."""
    config = copy.deepcopy(config)
    hints = typing.get_type_hints(TrainConfig)
    lora_hints = typing.get_type_hints(LoraSettings)
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "lora"]
    lora_fields = [f.name for f in dataclasses.fields(LoraSettings)]
    problems = []
    for item in items:
        if "=" not in item:
            problems.append(f"--train-set {item!r}: expected KEY=VALUE, e.g. distill=1.0")
            continue
        key, raw = item.split("=", 1)
        key = key.strip().replace("-", "_")
        target, name, types, allowed = config, key, hints, fields
        if key.startswith("lora."):
            target, name, types, allowed = config.lora, key[5:], lora_hints, lora_fields
        if name in OWNED and target is config:
            problems.append(f"--train-set {key}: set by the frontier for each run (use --ratios for the target ratios)")
            continue
        if name not in allowed:
            problems.append(_unknown_msg("--train-set key", key, fields + [f"lora.{f}" for f in lora_fields]))
            continue
        try:
            setattr(target, name, _coerce(parse_value(raw), types[name]))
        except ValueError as exc:
            problems.append(f"--train-set {key}: {exc}")
    if problems:
        raise ConfigError(problems)
    return config


# -- planning --------------------------------------------------------------------------------
def _hf_config(plan, cache: dict):
    """The backbone's HF config (for FLOP counts): from the plugin without weights when it can, else loaded."""
    key = json.dumps(dataclasses.asdict(plan.config.backbone), sort_keys=True, default=str)
    if key not in cache:
        bb = plan.components["backbone"]
        make = getattr(bb.cls, "hf_config", None)
        if callable(make):
            cache[key] = make(bb.config)
        else:
            cache[key] = build_backbone(plan).model.config
    return cache[key]


def plan(spec: FrontierSpec, out: str | os.PathLike | None = None, force: bool = False) -> list[PlannedRun]:
    """Every run of the frontier, validated up front (one ``ConfigError`` listing every problem:
    splits that do not fit the backbone, bad training options, existing runs with another recipe
    unless ``force``). Loads at most the backbone's config (or, without a cheap one, the backbone)."""
    problems = []
    if not spec.splits:
        problems.append("--splits: give at least one split, e.g. \"4,22,4;6,18,6\"")
    if not spec.ratios:
        problems.append("--ratios: give at least one target ratio in (0, 1)")
    problems += [f"--ratios: a target ratio must be in (0, 1), got {r}" for r in spec.ratios if not 0 < r < 1]
    if not spec.domains:
        problems.append("--eval-data: give at least one held-out source")
    for name in ("eval_batches", "eval_batch"):
        if getattr(spec, name) < 1:
            problems.append(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(spec, name)}")
    if spec.eval_seq_len is not None and spec.eval_seq_len < 2:
        problems.append(f"--eval-seq-len: must be >= 2, got {spec.eval_seq_len}")
    problems += [f"--baselines: {b!r} is not a baseline; choose from pruned, dense (or none)"
                 for b in spec.baselines if b not in ("pruned", "dense")]
    if not spec.max_flops > 0:
        problems.append(f"--max-flops: a FLOP ratio to dense, > 0, got {spec.max_flops}")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        problems.append(f"--output {out}: exists and is not a folder; the frontier writes a folder of runs there")
    elif out is not None and Path(out).is_symlink() and not Path(out).exists():
        problems.append(f"--output {out}: a symbolic link to {os.readlink(out)}, which does not exist (or loops); remove "
                        f"the link or choose another --output")
    data_path = local_path(spec.train.data)
    if out is not None and data_path is not None and fs.contains(Path(out), data_path):
        problems.append(f"--output {out}: holds the training data {spec.train.data}; choose an --output of its own")
    if spec.build.family != "streaming":
        problems.append(f"--config: the frontier trains streaming models over splits x ratios; this config is a "
                        f"{spec.build.family} build (evaluate it with `concept train` and `concept eval`)")
    plans = {}  # split text -> resolved build plan
    for text in spec.splits if spec.build.family == "streaming" else ():
        cfg = copy.deepcopy(spec.build)
        cfg.split = text
        try:
            plans[text] = resolve(cfg)
        except ConfigError as exc:
            problems += exc.problems  # (a split that does not fit the backbone names itself)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))

    runs: list[PlannedRun] = []
    seen_splits = {}
    hf_cache = {}
    pruned: dict[tuple[int, int], PlannedRun] = {}
    for text, p in plans.items():
        split = tuple(p.split)
        if split in seen_splits:  # e.g. "auto" and the counts it resolves to
            continue
        build = copy.deepcopy(p.config)
        build.split = _split_text(split)  # normalised, so a rerun compares equal
        seen_splits[split] = (split_name(split), build, p)
    for split, (bname, build, p) in seen_splits.items():
        hf = _hf_config(p, hf_cache)
        for ratio in spec.ratios:
            train = copy.deepcopy(spec.train)
            train.target_ratio, train.baseline, train.prune_layers = ratio, None, None
            prune = prune_plan(train, p, hf)
            run = PlannedRun(run_name(split, ratio), "streaming", bname, build, train, split=split, target_ratio=ratio,
                             planned_flop_ratio=prune.target_flop_ratio)
            runs.append(run)
            if "pruned" not in spec.baselines:
                continue
            if prune.kept >= prune.num_layers:
                run.notes.append(f"no pruned baseline: at {prune.target_flop_ratio:.3f}x dense FLOPs even removing no "
                                 f"layer is closest (the concept head and embedding cost the rest)")
                continue
            block = tuple(prune.removed)
            if block not in pruned:
                ptrain = copy.deepcopy(spec.train)
                ptrain.target_ratio, ptrain.baseline = ratio, "pruned"
                ptrain.prune_layers = f"{block[0]}:{block[1]}"
                pruned[block] = PlannedRun("", "pruned", bname, build, ptrain, planned_flop_ratio=prune.flop_ratio,
                                           removed=block, kept_layers=prune.kept)
                if not prune.met:
                    pruned[block].notes.append(f"whole layers cannot reach {run.name}'s {prune.target_flop_ratio:.3f}x "
                                               f"dense FLOPs; {prune.kept} kept layers give {prune.flop_ratio:.3f}x")
            pruned[block].matches.append(run.name)
    for block, prun in pruned.items():
        prun.name = pruned_name(prun.kept_layers, block)
        for r in runs:
            if r.name in prun.matches:
                r.pruned = prun.name
    first = next(iter(seen_splits.values()))
    dtrain = copy.deepcopy(spec.train)
    dtrain.baseline, dtrain.prune_layers = "dense", None
    runs += list(pruned.values())
    if "dense" in spec.baselines:
        runs.append(PlannedRun("dense", "dense", first[0], first[1], dtrain, planned_flop_ratio=1.0))
    for r in runs:
        if r.kind != "streaming" and r.train.align and r.train.align_at == "deep-input":
            r.train.align = 0.0  # (the trainer refuses it: a baseline has no deep stack)
            r.notes.append("--align at deep-input does not apply to a baseline (no deep stack): trained without it")

    for r in runs:  # the training options, against each build (all problems at once)
        try:
            Trainer.check(r.train, r.build)
        except ConfigError as exc:
            problems += exc.problems
        except ConceptError as exc:  # e.g. --device cuda without CUDA
            problems.append(str(exc))
    if out is not None and not problems:
        for r in runs:
            state = run_state(Path(out) / r.name, r)
            if state["status"] == "differs" and not force:
                problems.append(f"{Path(out) / r.name} was trained with another recipe ({'; '.join(state['differences'])}); "
                                f"pass --force to retrain it, or choose another --output")
            elif state["status"] in ("foreign", "damaged") and not fs.is_run_folder(Path(out) / r.name):
                problems.append(f"{Path(out) / r.name} exists and is not a run folder ({state['detail']}); the frontier "
                                f"replaces only run folders: move it away, or choose another --output")
            elif state["status"] == "damaged" and not force:  # one line: the file, what is wrong, what to do
                raise run_files.RunFileError(f"{state['detail']}; or pass --force to train the frontier's run {r.name} again")
            elif state["status"] == "foreign" and not force:
                problems.append(f"{Path(out) / r.name} exists and is not a run of this frontier ({state['detail']}); "
                                f"pass --force to replace it, or choose another --output")
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    return runs


# -- run folders: complete, resumable, or trained with another recipe ------------------------------
def recipe(train: dict, kind: str) -> dict:
    """What a run learns from: the training config minus logging / device (and, for a baseline, the
    streaming-only options, which do nothing there)."""
    saved = {k: v for k, v in train.items() if k not in DERIVED}
    d = TrainConfig.from_dict(saved).to_dict()
    d["data"] = stored_source(d["data"])  # the same data however it is spelled (runs store it absolute)
    drop = NOT_RECIPE | (STREAMING_ONLY if kind != "streaming" else set())
    return {k: v for k, v in d.items() if k not in drop}


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: trained with {json.dumps(a, default=str)}, planned {json.dumps(b, default=str)}")
    return out


def run_state(folder: Path, run: PlannedRun) -> dict:
    """``{"status": ...}``: new | complete | resume (``step``) | restart (no checkpoint yet) |
    differs (``differences``) | foreign (``detail``)."""
    folder = Path(folder)
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return {"status": "new"}
    if not folder.is_dir():
        return {"status": "foreign", "detail": "not a folder"}
    try:
        record, saved = run_files.check_files(folder)  # every file a re-run trusts (a cached evaluation too)
        built = record["config"]
        meta = run_files.checkpoint_state(folder)
    except run_files.RunFileError as exc:
        return {"status": "damaged", "detail": str(exc)}
    except RunFolderError as exc:
        return {"status": "foreign", "detail": str(exc)}
    if saved is None:
        return {"status": "foreign", "detail": "no train.json"}
    kind = saved.get("baseline") or "streaming"
    if kind != run.kind:
        return {"status": "differs", "differences": [f"kind: trained as {kind}, planned {run.kind}"]}
    try:
        differences = _differences(recipe(saved, kind), recipe(run.train.to_dict(), run.kind))
    except TypeError as exc:  # a train.json from another version
        return {"status": "foreign", "detail": f"unreadable train.json ({exc})"}
    planned = run.build.to_dict()
    if run.kind == "streaming":
        differences += [f"build {d}" for d in _differences(built, planned)]
    else:  # a baseline only uses the backbone
        differences += [f"build {d}" for d in _differences({"backbone": built.get("backbone")},
                                                           {"backbone": planned["backbone"]})]
    if differences:
        return {"status": "differs", "differences": differences}
    if meta is None:
        return {"status": "restart"}
    if meta["step"] >= run.train.steps:
        return {"status": "complete", "step": meta["step"]}
    return {"status": "resume", "step": meta["step"]}


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
            "batch": spec.eval_batch, "seq_len": spec.seq_len, "controls": spec.controls}


def _finite(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def evaluate_run(folder: Path, run: PlannedRun, spec: FrontierSpec) -> dict:
    """Per domain: bits/token, realised ratio, ΔNLL controls and the FLOP ratio to dense. The held-out
    batches are exactly those of ``concept eval RUN --data SOURCE --eval-batches N --batch B --seq-len T``."""
    model, out = None, {}
    T = spec.seq_len
    for d in spec.domains:
        model, _, _, r = eval_one(folder, d.source, T, spec.eval_batches, spec.eval_batch, spec.controls, None,
                                  None, spec.train.device, model)
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
    return {"step": step, "tasks": list(spec.tasks), "limit": spec.tasks_limit, "include_path": list(spec.include_path)}


def evaluate_tasks(folder: Path, spec: FrontierSpec, log) -> dict:
    """The run's lm-eval task metrics (``concept eval RUN --tasks ...``), cached in its TASKS_FILE for this step."""
    # lazy: lm-eval is the optional `eval` extra; a frontier without --tasks must not need it
    from . import harness

    key = _tasks_key(spec, (run_files.checkpoint_state(folder) or {}).get("step"))
    cache = folder / TASKS_FILE
    cached = _cached(cache, key, "tasks")
    if cached is not None:
        return cached
    log("evaluating", f"{folder.name} on tasks {', '.join(spec.tasks)} (lm-eval) ...")
    manager = harness.resolve_tasks(list(spec.tasks), spec.include_path)
    scorer = Scorer.from_run(folder, spec.train.device, spec.eval_batch)
    tasks = harness.evaluate_tasks(scorer, list(spec.tasks), manager, spec.tasks_limit)
    _write_json(cache, {"key": key, "tasks": tasks})
    return tasks


def task_metrics(result: dict) -> list[tuple[str, str]]:
    """(task, metric) pairs of the frontier's task columns: each task's ``acc`` (else its first metric)."""
    pairs = {}
    for row in result["rows"]:
        for task, metrics in (row.get("tasks") or {}).items():
            names = [m for m in metrics if m != "samples"]
            if names and task not in pairs:
                pairs[task] = "acc" if "acc" in names else names[0]
    return list(pairs.items())


def _cached(file: Path, key: dict, field: str) -> dict | None:
    """``field`` of the cache file written for ``key`` (an object), or None: no cache, another key, or a damaged
    file (it is only a cache: the value is computed again and the file rewritten)."""
    try:
        saved = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
    except (OSError, ValueError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None
    value = saved.get(field) if isinstance(saved, dict) and saved.get("key") == key else None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, data) -> None:
    fs.write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def run(spec: FrontierSpec, planned: list[PlannedRun], out: str | os.PathLike, force: bool = False,
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


def _run_one(spec: FrontierSpec, r: PlannedRun, folder: Path, tag: str, force: bool, train, log) -> dict:
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
            if action != "restart" and not force:  # (plan() refuses these first)
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


def _row(r: PlannedRun, folder: Path, spec: FrontierSpec, action: str, log=lambda verb, detail: None) -> dict:
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
        _write_json(cache, {"key": key, "domains": domains_})
    row = {**r.describe(), "path": str(folder), "step": step,
           "trained": {"complete": "skipped", "resume": "resumed"}.get(action, "trained"), "domains": domains_}
    if spec.tasks:
        row["tasks"] = evaluate_tasks(folder, spec, log)
    return row


def summarise(spec: FrontierSpec, planned: list[PlannedRun], rows: list[dict]) -> dict:
    """Add the gaps to dense and to the matched pruned baseline, the FLOP ratio used to rank
    (the largest over the domains) and the best streaming point at <= ``spec.max_flops``."""
    labels = [d.label for d in spec.domains]
    by_name = {row["run"]: row for row in rows}
    dense = next((row for row in rows if row["kind"] == "dense"), None)
    for row in rows:
        for label in labels:
            m = row["domains"][label]
            base = dense["domains"][label]["bits_per_token"] if dense else None
            bits = m["bits_per_token"]
            m["gap_bits"] = bits - base if bits is not None and base is not None else None
            m["gap_pct"] = 100 * m["gap_bits"] / base if m["gap_bits"] is not None and base else None
            pruned = by_name.get(row.get("pruned_baseline") or "")
            pbits = pruned["domains"][label]["bits_per_token"] if pruned else None
            m["vs_pruned_bits"] = bits - pbits if bits is not None and pbits is not None else None
        flops = [row["domains"][label]["flop_ratio"] for label in labels]
        bits = [row["domains"][label]["bits_per_token"] for label in labels]
        row["flop_ratio"] = max(flops) if None not in flops else None
        row["mean_bits"] = sum(bits) / len(bits) if None not in bits else None
    eligible = [row for row in rows if row["kind"] == "streaming" and row["flop_ratio"] is not None
                and row["mean_bits"] is not None and row["flop_ratio"] <= spec.max_flops]
    best = min(eligible, key=lambda row: row["mean_bits"]) if eligible else None
    return {
        "domains": [dataclasses.asdict(d) for d in spec.domains],
        "max_flops": spec.max_flops,
        "best": None if best is None else {"run": best["run"], "split": best["split"],
                                           "target_ratio": best["target_ratio"], "flop_ratio": best["flop_ratio"],
                                           "mean_bits": best["mean_bits"]},
        "recipe": spec.train.to_dict(),
        "build": spec.build.to_dict(),
        "eval": {"batches": spec.eval_batches, "batch": spec.eval_batch, "seq_len": spec.seq_len,
                 "controls": spec.controls, "tasks": list(spec.tasks), "tasks_limit": spec.tasks_limit},
        "rows": rows,
    }


# -- reports ---------------------------------------------------------------------------------
def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def best_line(result: dict) -> str:
    best, cap = result["best"], result["max_flops"]
    if best is None:
        return f"No streaming point at ≤ {cap:g}× dense FLOPs on every domain."
    return (f"Best streaming point at ≤ {cap:g}× dense FLOPs: **{best['run']}** (split {best['split']}, target ratio "
            f"{best['target_ratio']:g}): {best['flop_ratio']:.3f}× dense FLOPs, mean {best['mean_bits']:.3f} bits/token "
            f"over {', '.join(d['label'] for d in result['domains'])}.")


def table_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the frontier table: one row per run: kind, split, target ratio, FLOP ratio,
    then per domain bits/token, realised ratio, ΔNLL(shuffled), ΔNLL with the discrete codes shuffled
    and removed, the gap to dense (bits and %) and the difference to the matched pruned baseline, then
    the identity start's gate RMS (a property of the model, not of a domain)."""
    labels = [d["label"] for d in result["domains"]]
    each = lambda what: [f"{what} {label}" for label in labels]  # noqa: E731
    tasks = task_metrics(result)
    head = (["run", "kind", "split", "target ratio", f"FLOP ratio ({' / '.join(labels)})"] + each("bits")
            + each("ratio") + each("ΔNLL shuffle") + each("ΔNLL codes") + each("ΔNLL codes removed")
            + each("gap to dense") + each("vs pruned") + ["gate RMS"]
            + [f"{metric} {task}" for task, metric in tasks])
    rows = []
    for row in result["rows"]:
        ms = [row["domains"][label] for label in labels]
        flops = [m["flop_ratio"] for m in ms]
        flop = _f(flops[0], ".3f") if len(set(flops)) == 1 else " / ".join(_f(x, ".3f") for x in flops)
        gap = lambda m: "–" if m["gap_bits"] is None else (  # noqa: E731
            f"{m['gap_bits']:+.2f} ({_f(m['gap_pct'], '+.0f')}%)" if row["kind"] != "dense" else "0")
        rows.append([row["run"], row["kind"], row["split"] or "–", _f(row["target_ratio"], "g"), flop]
                    + [_f(m["bits_per_token"], ".3f") for m in ms]
                    + [_f(m["ratio"], ".3f") for m in ms]
                    + [_f(m["delta_nll_shuffle"], "+.3f") for m in ms]
                    + [_f(m.get("delta_nll_codes_shuffled"), "+.3f") for m in ms]
                    + [_f(m.get("delta_nll_codes_zero"), "+.3f") for m in ms]
                    + [gap(m) for m in ms]
                    + [_f(m["vs_pruned_bits"], "+.2f") for m in ms]
                    + [_f(ms[0].get("gate_norm") if ms else None, ".3f")]
                    + [_task_cell((row.get("tasks") or {}).get(task, {}).get(metric)) for task, metric in tasks])
    return head, rows


def _task_cell(m: dict | None) -> str:
    if m is None:
        return "–"
    return f"{m['value']:.3f}" + (f" ± {m['stderr']:.3f}" if m.get("stderr") is not None else "")


def markdown_table(result: dict) -> str:
    head, rows = table_cells(result)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def report_block(result: dict, image: str) -> str:
    """The table, the image link, the best point and the command (frontier.md and --update-doc)."""
    ev = result["eval"]
    domains_ = ", ".join(f"{d['label']} = `{d['source']}`" for d in result["domains"])
    parts = [f"![held-out bits/token against FLOP ratio to dense]({image})", "",
             markdown_table(result), "",
             best_line(result), "",
             f"Held-out: {domains_}; {ev['batches']} × {ev['batch']} × {ev['seq_len']} tokens per domain. FLOP ratio: "
             f"ideal forward FLOPs at length {ev['seq_len']} over dense (streaming: at the ratio realised on each domain). "
             f"gap to dense: bits/token minus dense's (and %); vs pruned: minus the FLOP-matched pruned baseline's "
             f"(negative = the streaming model is better). ΔNLL in nats: shuffle, the concepts' whole inputs permuted across "
             f"the batch; codes, only their discrete codes (each concept keeps its own continuous part); codes removed, "
             f"the discrete embedding taken out of each concept's input (its continuous part kept). gate RMS: the identity "
             f"start's gate on the discrete embedding (– without one); docs/diagnostics.md says what healthy readings are."]
    if task_metrics(result):
        limit = result["eval"].get("tasks_limit")
        parts += ["", f"Task columns: lm-evaluation-harness metric ± one standard error on "
                      f"{f'the first {limit}' if limit else 'all'} examples of each task "
                      f"(`--tasks {','.join(result['eval']['tasks'])}`); `frontier-tasks.png` draws them against FLOPs."]
    notes = [f"- {row['run']}: {n}" for row in result["rows"] for n in row.get("notes", [])]
    if notes:
        parts += ["", *notes]
    if result.get("command"):
        parts += ["", "```", result["command"], "```"]
    return "\n".join(parts)


def _save(fig, path: Path) -> Path:
    """Write a matplotlib figure as PNG atomically, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fs.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path


def plot(result: dict, path: Path) -> Path:
    """One panel per domain: x = FLOP ratio to dense, y = held-out bits/token; streaming points
    coloured by split (a line joins a split's ratios), marker by target ratio; pruned baselines
    as grey crosses; dense as a horizontal line (and a star at x = 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows, labels = result["rows"], [d["label"] for d in result["domains"]]
    splits = list(dict.fromkeys(r["split"] for r in rows if r["kind"] == "streaming"))
    ratios = list(dict.fromkeys(r["target_ratio"] for r in rows if r["kind"] == "streaming"))
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(splits)}
    markers = {r: "osD^vPh*"[i % 8] for i, r in enumerate(ratios)}
    fig, axes = plt.subplots(1, len(labels), figsize=(6.2 * len(labels), 4.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        def xy(row):
            m = row["domains"][label]
            return m["flop_ratio"], m["bits_per_token"]

        for s in splits:
            pts = sorted((xy(r) for r in rows if r["kind"] == "streaming" and r["split"] == s and None not in xy(r)))
            if len(pts) > 1:
                ax.plot(*zip(*pts), color=colours[s], lw=1, alpha=0.5)
        for r in rows:
            x, y = xy(r)
            if x is None or y is None:
                continue
            if r["kind"] == "streaming":
                ax.scatter(x, y, color=colours[r["split"]], marker=markers[r["target_ratio"]], s=55, zorder=3)
                ax.annotate(r["split"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
            elif r["kind"] == "pruned":
                ax.scatter(x, y, color="0.35", marker="X", s=60, zorder=3)
                ax.annotate(r["run"], (x, y), textcoords="offset points", xytext=(5, -10), fontsize=7, color="0.35")
            else:
                ax.axhline(y, color="k", ls="--", lw=1)
                ax.scatter(1.0, y, color="k", marker="*", s=120, zorder=3)
        ax.axvline(result["max_flops"], color="0.6", ls=":", lw=1)
        ax.set_title(f"held-out: {label}")
        ax.set_xlabel("FLOP ratio to dense (ideal forward)")
        ax.set_ylabel("bits / token")
        ax.grid(alpha=0.3)
    handles = ([Line2D([], [], color=colours[s], marker="o", ls="-", label=f"split {s}") for s in splits]
               + [Line2D([], [], color="0.2", marker=markers[r], ls="", label=f"target ratio {r:g}") for r in ratios]
               + [Line2D([], [], color="0.35", marker="X", ls="", label="pruned (FLOP-matched)"),
                  Line2D([], [], color="k", marker="*", ls="--", label="dense"),
                  Line2D([], [], color="0.6", ls=":", label=f"{result['max_flops']:g}x dense FLOPs")])
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    return _save(fig, path)


def plot_tasks(result: dict, path: Path) -> Path:
    """One panel per task: x = FLOP ratio to dense (the largest over the domains), y = its accuracy with
    one standard error; streaming points by split, pruned baselines as grey crosses, dense as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = task_metrics(result)
    rows = result["rows"]
    splits = list(dict.fromkeys(r["split"] for r in rows if r["kind"] == "streaming"))
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(splits)}
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.2), squeeze=False)
    for ax, (task, metric) in zip(axes[0], tasks):
        for r in rows:
            m = (r.get("tasks") or {}).get(task, {}).get(metric)
            if m is None or r.get("flop_ratio") is None:
                continue
            err = m.get("stderr") or 0.0
            if r["kind"] == "dense":
                ax.axhline(m["value"], color="k", ls="--", lw=1)
                ax.errorbar(1.0, m["value"], yerr=err, color="k", marker="*", ms=11, capsize=3)
                continue
            style = dict(color=colours[r["split"]], marker="o") if r["kind"] == "streaming" else dict(color="0.35",
                                                                                                      marker="X")
            ax.errorbar(r["flop_ratio"], m["value"], yerr=err, ms=7, capsize=3, ls="", **style)
            ax.annotate(r["split"] if r["kind"] == "streaming" else r["run"], (r["flop_ratio"], m["value"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.set_title(f"{task} ({metric})")
        ax.set_xlabel("FLOP ratio to dense (ideal forward)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def write(result: dict, out: str | os.PathLike) -> dict[str, Path]:
    """``frontier.json`` (everything), ``frontier.md`` (the table), ``frontier.png`` (the plot) and, with
    tasks, ``frontier-tasks.png`` (accuracy against FLOP ratio)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "frontier.json", "md": out / "frontier.md", "png": out / "frontier.png"}
    if task_metrics(result):
        paths["tasks_png"] = plot_tasks(result, out / "frontier-tasks.png")
    plot(result, paths["png"])
    _write_json(paths["json"], result)
    fs.write_atomic(paths["md"], "# Frontier: held-out bits/token against FLOP ratio to dense\n\n"
                    + report_block(result, "frontier.png") + "\n")
    return paths


def check_doc(path: str | os.PathLike) -> str:
    """The text of ``path``, which must hold one ``<!-- frontier:begin -->`` ... ``<!-- frontier:end -->`` block."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConceptError(f"--update-doc {path}: no such file; create it with a line {BEGIN} and a line {END} "
                           f"where the frontier should go") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConceptError(f"--update-doc {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    begins, ends = text.count(BEGIN), text.count(END)
    if begins != 1 or ends != 1 or text.index(BEGIN) > text.index(END):
        found = f"found {begins} begin and {ends} end marker(s)" + (", end before begin" if begins == ends == 1 else "")
        raise ConceptError(f"--update-doc {path}: needs exactly one {BEGIN} line followed by one {END} line "
                           f"({found}); add them where the frontier should go and rerun")
    return text


def update_doc(path: str | os.PathLike, result: dict, png: str | os.PathLike) -> Path:
    """Replace the marked block of ``path`` with the table, the image (linked relative to the file)
    and the command; written atomically (a temporary file renamed over it), the rest untouched."""
    path = Path(path)
    text = check_doc(path)
    image = Path(os.path.relpath(Path(png).resolve(), path.resolve().parent)).as_posix()
    return fs.write_atomic(path.resolve(), fs.replace_marked(text, BEGIN, END, report_block(result, image)))
