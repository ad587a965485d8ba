"""The frontier's runs: the specification, the run names, :func:`schedule` (every run, validated up
front) and the state of a run folder against its scheduled recipe."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ... import fs, run_files
from ...baselines import REQUEST, prune_plan
from ...builder import build_backbone
from ...config import BuildConfig, _coerce, _unknown_msg, parse_value, resolve
from ...data import CORPORA, builtin_corpus, local_path, stored_source
from ...errors import ConceptError, ConfigError, RunFolderError
from ...train_config import LoraSettings, TrainConfig
from ...training import DERIVED, Trainer

BUILDS = "builds"
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
class ScheduledRun:
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


def describe_kind(r: "ScheduledRun") -> str:
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


def schedule(spec: FrontierSpec, out: str | os.PathLike | None = None, force: bool = False) -> list[ScheduledRun]:
    """Every run of the frontier, validated up front (one ``ConfigError`` listing every problem:
    splits that do not fit the backbone, bad training options, existing runs with another recipe
    unless ``force``). Loads at most the backbone's config (or, without a cheap one, the backbone)."""
    problems = _spec_problems(spec, out)
    resolved = {}  # split text -> its build resolution
    for text in spec.splits if spec.build.family == "streaming" else ():
        cfg = copy.deepcopy(spec.build)
        cfg.split = text
        try:
            resolved[text] = resolve(cfg)
        except ConfigError as exc:
            problems += exc.problems  # (a split that does not fit the backbone names itself)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    builds = _split_builds(resolved)
    runs, pruned = _streaming_runs(spec, builds)
    runs += list(pruned.values())
    if "dense" in spec.baselines:
        bname, build, _ = next(iter(builds.values()))
        dtrain = copy.deepcopy(spec.train)
        dtrain.baseline, dtrain.prune_layers = "dense", None
        runs.append(ScheduledRun("dense", "dense", bname, build, dtrain, planned_flop_ratio=1.0))
    for r in runs:
        if r.kind != "streaming" and r.train.align and r.train.align_at == "deep-input":
            r.train.align = 0.0  # (the trainer refuses it: a baseline has no deep stack)
            r.notes.append("--align at deep-input does not apply to a baseline (no deep stack): trained without it")
    problems = _training_problems(runs)
    if out is not None and not problems:
        problems = _folder_problems(runs, Path(out), force)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    return runs


def _spec_problems(spec: FrontierSpec, out) -> list[str]:
    """What is wrong with the specification and ``out``, before anything is resolved."""
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
    return problems


def _split_builds(resolved: dict) -> dict:
    """split (layer counts) -> (build name, build config with the split normalised, build resolution), one per
    distinct split (e.g. "auto" and the counts it resolves to are one)."""
    builds = {}
    for p in resolved.values():
        split = tuple(p.split)
        if split in builds:
            continue
        build = copy.deepcopy(p.config)
        build.split = _split_text(split)  # normalised, so a rerun compares equal
        builds[split] = (split_name(split), build, p)
    return builds


def _streaming_runs(spec: FrontierSpec, builds: dict) -> tuple[list[ScheduledRun], dict]:
    """The streaming runs (splits x ratios) and their FLOP-matched pruned baselines (one per removed block)."""
    runs: list[ScheduledRun] = []
    pruned: dict[tuple[int, int], ScheduledRun] = {}
    hf_cache = {}
    for split, (bname, build, p) in builds.items():
        hf = _hf_config(p, hf_cache)
        for ratio in spec.ratios:
            train = copy.deepcopy(spec.train)
            train.target_ratio, train.baseline, train.prune_layers = ratio, None, None
            prune, _ = prune_plan(train, p, hf)
            run = ScheduledRun(run_name(split, ratio), "streaming", bname, build, train, split=split,
                               target_ratio=ratio, planned_flop_ratio=prune.target_flop_ratio)
            runs.append(run)
            if "pruned" not in spec.baselines:
                continue
            if prune.kept >= prune.num_layers:
                run.notes.append(f"no pruned baseline: at {prune.target_flop_ratio:.3f}x dense FLOPs even removing no "
                                 f"layer is closest (the concept head and embedding cost the rest)")
                continue
            block = tuple(prune.removed)
            if block not in pruned:
                pruned[block] = _pruned_run(spec, ratio, bname, build, prune, run.name)
            pruned[block].matches.append(run.name)
    for block, prun in pruned.items():
        prun.name = pruned_name(prun.kept_layers, block)
        for r in runs:
            if r.name in prun.matches:
                r.pruned = prun.name
    return runs, pruned


def _pruned_run(spec: FrontierSpec, ratio: float, bname: str, build: BuildConfig, prune, matched: str) -> ScheduledRun:
    """The pruned baseline removing ``prune.removed`` (named once all its matches are known)."""
    block = tuple(prune.removed)
    ptrain = copy.deepcopy(spec.train)
    ptrain.target_ratio, ptrain.baseline = ratio, "pruned"
    ptrain.prune_layers = f"{block[0]}:{block[1]}"
    run = ScheduledRun("", "pruned", bname, build, ptrain, planned_flop_ratio=prune.flop_ratio, removed=block,
                       kept_layers=prune.kept)
    if not prune.met:
        run.notes.append(f"whole layers cannot reach {matched}'s {prune.target_flop_ratio:.3f}x "
                         f"dense FLOPs; {prune.kept} kept layers give {prune.flop_ratio:.3f}x")
    return run


def _training_problems(runs: list[ScheduledRun]) -> list[str]:
    """The training options, against each build (all problems at once)."""
    problems = []
    for r in runs:
        try:
            Trainer.check(r.train, r.build)
        except ConfigError as exc:
            problems += exc.problems
        except ConceptError as exc:  # e.g. --device cuda without CUDA
            problems.append(str(exc))
    return problems


def _folder_problems(runs: list[ScheduledRun], out: Path, force: bool) -> list[str]:
    """Runs in ``out`` that the frontier may not replace (another recipe, not a run folder) unless ``force``."""
    problems = []
    for r in runs:
        state = run_state(out / r.name, r)
        if state["status"] == "differs" and not force:
            problems.append(f"{out / r.name} was trained with another recipe ({'; '.join(state['differences'])}); "
                            f"pass --force to retrain it, or choose another --output")
        elif state["status"] in ("foreign", "damaged") and not fs.is_run_folder(out / r.name):
            problems.append(f"{out / r.name} exists and is not a run folder ({state['detail']}); the frontier "
                            f"replaces only run folders: move it away, or choose another --output")
        elif state["status"] == "damaged" and not force:  # one line: the file, what is wrong, what to do
            raise run_files.RunFileError(f"{state['detail']}; or pass --force to train the frontier's run {r.name} again")
        elif state["status"] == "foreign" and not force:
            problems.append(f"{out / r.name} exists and is not a run of this frontier ({state['detail']}); "
                            f"pass --force to replace it, or choose another --output")
    return problems


# -- run folders: complete, resumable, or trained with another recipe ------------------------------
def recipe(train: dict, kind: str) -> dict:
    """What a run learns from: the training config minus logging / device (and, for a baseline, the
    streaming-only options, which do nothing there)."""
    saved = {k: v for k, v in train.items() if k not in DERIVED}
    d = TrainConfig.from_dict(saved).to_dict()
    d["data"] = stored_source(d["data"])  # the same data however it is spelled (runs store it absolute)
    drop = NOT_RECIPE | set(REQUEST) | (STREAMING_ONLY if kind != "streaming" else set())  # (REQUEST: its build's)
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


def run_state(folder: Path, run: ScheduledRun) -> dict:
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
    kind = built["family"]  # (a baseline: the dense or pruned family)
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
