"""A training run's folder: setting up a new run (checked, staged beside ``out``, published), resuming one
(the saved config reconciled with the options given, what was logged after the checkpoint dropped), its
records (train.json, metrics.jsonl) and its lock.

:class:`RunFolder` is what a ``Trainer`` holds; :func:`start` and :func:`resume` are ``Trainer.start`` and
``Trainer.resume`` (they take the trainer class, so this module never imports ``concept.training``).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from . import checkpoint, data, families, fs, options, run_files
from .builder import PEFT_ADAPTER_DIR, RUN_FILE, TRAIN_FILE, backbone_folder, read_run, read_train
from .config import BuildConfig, resolve
from .migrate import FORMAT_VERSION, migrate_run
from .distributed import Dist
from .errors import ConfigError, RunFolderError
from .lora import peft_adapter_state
from .train_config import BASELINES, LoraSettings

if TYPE_CHECKING:  # (composed when asked for: importing this module imports no family)
    from .train_config import TrainConfig

METRICS = "metrics.jsonl"
# train.json keys that record what a run resolved to, beside the TrainConfig fields
# ("pruned": an older baseline run's block, which its build holds today: concept.migrate)
DERIVED = run_files.TRAIN_DERIVED
DATA_FIELDS = {"data", "text_field", "encoding_errors", "data_split", "streaming"}  # --resume may point at other data (with a note)


class RunFolder:
    """The folder a trainer writes (``out``: while a run replaces an existing folder, its staging folder),
    its lock and what train.json records."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.name = self.out.name  # the run's name (``out`` may still be its staging folder)
        self.staging: fs.Staging | None = None  # set while the run replaces an existing folder (``start(force=True)``)
        self.lock: fs.Lock | None = None  # the run's lock while a trainer writes it in place (``train`` releases it)
        self.record_pending, self.record_source = False, None  # resume: train.json comes with the first new checkpoint
        self.source_run: str | None = None  # the run it trains from, as train.json records it

    def write_record(self, record: dict, source: str | None) -> None:
        """train.json (``record``: its content), replaced atomically (a reader never sees it half-written). An
        older baseline run's concept.json is written in today's format first (``concept.migrate``): today's
        train.json no longer says which baseline it was."""
        self.source_run = source
        file = self.out / RUN_FILE
        written = json.loads(file.read_text()) if file.is_file() else None  # (a run folder has one)
        today = migrate_run(written, run_files.unchecked_train(self.out)) if written is not None else None
        family = today["config"].get("family") if today is not None else None
        if family in BASELINES and family != (written.get("config") or {}).get("family"):
            fs.write_atomic(file, json.dumps(today, indent=2, sort_keys=True))
        fs.write_atomic(self.out / TRAIN_FILE, json.dumps(record, indent=2))

    def append_metrics(self, row: dict) -> None:
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(row) + "\n")

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / METRICS).read_text().splitlines() if line.strip()]

    def commit_resume(self, rows: list[tuple[str, dict]], step: int) -> None:
        """Drop the metrics logged after the checkpoint (``rows``: metrics.jsonl, checked): the resumed run logs
        those steps again. Written only when that changes the file."""
        text = "".join(line + "\n" for line, row in rows if row["step"] <= step)  # (a torn last line is dropped)
        file = self.out / METRICS
        if not file.is_file() or file.read_bytes() != text.encode():
            fs.write_atomic(file, text)

    def interrupted(self, step: int) -> KeyboardInterrupt:
        """What a Ctrl-C at ``step`` says (a replacement is discarded, a run in place keeps its checkpoint)."""
        if self.staging is not None:
            return KeyboardInterrupt(f"interrupted at step {step}; {self.staging.dest} is unchanged (--force "
                                     f"replaces it only once training finishes) and the new run was discarded")
        return KeyboardInterrupt(f"interrupted at step {step}; checkpoint saved in {self.out}")

    def publish(self, dist: Dist) -> None:
        """Every step trained: a run replacing an existing folder replaces it now."""
        if self.staging is not None:
            dist.on_main(self.staging.publish)
            self.out, self.staging = self.staging.dest, None

    def discard(self, dist: Dist) -> None:
        """An unfinished replacement: the old folder stays, the new run goes."""
        if self.staging is not None and dist.is_main:
            self.staging.discard()

    def release(self) -> None:
        """Release the run's lock (``Trainer.train`` does when it ends)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# -- a new run ---------------------------------------------------------------------------------------
def start(make, source: str | Path, out: str | Path, config: TrainConfig, force: bool = False,
          dist: Dist | None = None):
    """``Trainer.start``: ``make`` is the trainer class (``make(folder, config, build_config, resume, dist)``)."""
    source, out, dist = Path(source), Path(out), dist or Dist()
    record, trained = run_files.check_files(source)  # every file of the source, before anything is written
    plan = run_files.plan_of(record, source)  # (a source whose record cannot be built: one line naming it)
    check_source_lora(source, trained, config)
    build_config, notes = BuildConfig.from_dict(record["config"]), []
    config = dataclasses.replace(config, data=data.stored_source(config.data),  # resumable from any folder
                                 eval_data=data.stored_source(config.eval_data))
    if config.baseline:  # a run of the baseline's family, its build derived from the source's
        problems = config.validate(plan.backbone_info.max_positions, plan.backbone_info.num_layers)
        if problems:
            raise ConfigError(problems)
        build_config, config, notes = families.family(config.baseline).derive(config, record["config"], plan)
    make.check(config, build_config, dist)  # bad options fail before anything is written
    if out.exists() and out.resolve() == source.resolve() and read_train(out) is not None:
        raise RunFolderError(f"{out} is already a training run; use --resume, or pass another -o/--output")
    fs.check_target(out, force, {"source run": source, "training data": data.local_path(config.data),
                                 "backbone": backbone_folder(record["config"])})
    replace = out.exists() and any(out.iterdir())
    swept = dist.on_main(checkpoint.sweep_if_free, source)  # what a killed writer left in the source
    staging = fs.Staging(out, replace=force)
    dist.on_main(staging.open)
    try:
        with fs.disk_errors(out, "; nothing was written" + (f" ({out} is unchanged)" if replace else "")):
            dist.on_main(prepare, source, staging.path, build_config if config.baseline else None)
            with run_files.copied_from(staging.path, source):  # a damaged weights file is named in the source
                trainer = make(staging.path, config, build_config, resume=False, dist=dist)
            dist.on_main(fs.check_space, out, 2 * trainer.checkpoint_state.size(), "training (two checkpoints)")
            dist.on_main(trainer._record, str(source.resolve()))
        trainer.run.name = out.name
        trainer.notes[:0] = notes
        if staging.swept:
            trainer.notes.append(f"removed {staging.path}, left by an earlier run into {out} that was killed")
        if swept:
            trainer.notes.append(f"removed {', '.join(swept)} from {source}, left by a writer that was killed")
        if replace:  # the old folder stays until training has finished (Trainer.train publishes)
            trainer.run.staging = staging
        else:  # published now; the run is trained in place, still under its lock
            dist.on_main(staging.publish, keep_lock=True)
            trainer.run.lock, staging.lock = staging.lock, None
            trainer.run.out = out
    except BaseException:
        if dist.is_main:  # nothing half-set-up is left behind, and `out` was never touched
            staging.discard()
        raise
    return trainer


def check_source_lora(source: Path, trained: dict | None, config: TrainConfig) -> None:
    """A run trained from a trained run continues its LoRA adapters: the same rank and targets."""
    if not trained or config.baseline:
        return
    saved = LoraSettings(**trained["lora"])
    if (saved.rank, tuple(saved.targets)) != (config.lora.rank, tuple(config.lora.targets)):
        raise ConfigError([f"lora: {source} was trained with --lora-rank {saved.rank} --lora-targets "
                           f"{saved.targets}, and a run trained from it continues those adapters; pass them "
                           f"(or train from its build, {trained.get('source') or 'the run it was trained from'})"])


def prepare(source: Path, out: Path, derived: BuildConfig | None = None) -> None:
    """Fill the empty staging folder ``out``: the source's record, weights, modules and adapters; with a
    ``derived`` build (a baseline's), its record instead of the source's, and none of the source's modules."""
    for name in ("modules.safetensors", "backbone.safetensors"):
        if (source / name).is_file() and not (derived is not None and name == "modules.safetensors"):
            shutil.copy2(source / name, out / name)
    record = {k: v for k, v in read_run(source).items() if k != "export"}  # an export's ./backbone made absolute
    if derived is not None:
        record = {"format": FORMAT_VERSION, "config": derived.to_dict(), "plan": resolve(derived).describe()}
    (out / RUN_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    from safetensors.torch import save_file

    for stem in ("modules", "adapter") if derived is None else ("adapter",):  # continue from a trained model's
        state = checkpoint.read_tensors(source, stem)
        if state is None and stem == "adapter":  # an export: its adapters as a peft folder

            state = peft_adapter_state(source / PEFT_ADAPTER_DIR)
        if state:
            save_file(state, out / f"{stem}.safetensors")
    (out / METRICS).write_text("")


# -- resuming ---------------------------------------------------------------------------------------
def resume(make, out: str | Path, dist: Dist | None = None, accept_data_change: bool = False,
           **overrides):
    """``Trainer.resume``: ``make`` is the trainer class (``make(folder, config, build_config, resume, dist)``)."""
    out, dist = Path(out), dist or Dist()
    read_run(out)  # a clear error for anything that is not a run folder, before its lock is made
    lock = fs.Lock(out)
    dist.on_main(lock.acquire)
    try:
        swept = dist.on_main(checkpoint.sweep, out)
        record, config, source, changed = resumed_config(out, dist.world_size, overrides)
        checkpoint.check_intact(out, f"start a new run from {source or 'its source'} instead of --resume")
        run_files.check_files(out)  # every file a reader trusts, as the readers check it
        meta = checkpoint.check_origin(out, record["config"], backbone_folder(record["config"]))
        checkpoint.verify(out)
        rows = checkpoint.read_metrics(out)
        trainer = make(out, config, BuildConfig.from_dict(record["config"]), resume=meta is not None, dist=dist)
        if swept:
            trainer.notes.append(f"removed {', '.join(swept)} from {out}, left by a writer that was killed")
        if meta is None:
            trainer.notes.append(f"{out} has no checkpoint yet (stopped before its first one): training starts "
                                 f"again from step 0")
        trainer.notes += data_change_notes(meta, changed, accept_data_change, trainer.data_fingerprint,
                                           trainer.step, trainer.config.data)
        dist.on_main(fs.check_space, out, trainer.checkpoint_state.size(), "the next checkpoint", " and resume again")
        dist.on_main(trainer.run.commit_resume, rows, trainer.step)
        trainer.run.record_pending, trainer.run.record_source = True, source
        trainer.run.source_run = source
        trainer.run.lock = lock
    except BaseException:
        lock.release()
        raise
    return trainer


def data_change_notes(meta: dict | None, changed: list[str], accepted: bool, data_fingerprint: str, step: int,
                      data_source: str | None) -> list[str]:
    """How the data differs from what the checkpoint (``meta``: its state.json) was trained on: another --data
    (``changed``: a note), or the same --data whose documents changed (a warning, unless ``accepted``)."""
    recorded = ((meta or {}).get("fingerprints") or {}).get("data")
    same = recorded is None or recorded == data_fingerprint
    lost = f"training continues at step {step} on the new data, so it no longer reproduces an uninterrupted run"
    if changed:
        return [f"the data changed ({'; '.join(changed)}): " + (
            lost if not same or recorded is None else
            "its documents are the same as before, so the run still reproduces an uninterrupted one")]
    if not same and accepted:
        return [f"the data {data_source or '(default corpus)'} changed since the checkpoint at step {step} "
                f"(accepted with --accept-data-change): {lost}"]
    if not same:
        return [f"warning: the documents of --data {data_source or '(default corpus)'} changed since the checkpoint "
                f"at step {step} was written: {lost}; restore the data to continue exactly, or pass "
                f"--accept-data-change to accept the change"]
    return []


def resumed_config(out: Path, world_size: int, overrides: dict) -> tuple[dict, TrainConfig, str | None, list]:
    """What ``resume`` would continue, read and checked without loading anything: (the run record, the
    config with ``overrides`` applied, the source run, the data options that changed). Raises the
    errors ``resume`` raises for a folder that is not a run or options that conflict with it."""
    out = Path(out)
    record = read_run(out)
    saved = read_train(out)
    if saved is None and not (out / TRAIN_FILE).is_file():
        raise RunFolderError(f"{out} is not a training run (no {TRAIN_FILE}); start one with `concept train SOURCE -o DIR`")
    if record.get("export"):
        raise RunFolderError(f"{out} is an export (a published model), not a training run to continue; train on from "
                             f"it in a new run: `concept train {out} -o DIR`")
    source, before, config = saved_config(out, saved)
    unknown = [k for k in overrides if k.split(".")[0] not in type(config).__dataclass_fields__]
    if unknown:  # (the Python API: e.g. another family's option)
        raise ConfigError([f"{k.replace('_', '-')}: a {record['config'].get('family')} run has no such training "
                           f"option" for k in unknown])
    overrides = dict(overrides)
    if "data" in overrides:
        overrides["data"] = data.stored_source(overrides["data"])
    if overrides.get("eval_data") is not None:
        overrides["eval_data"] = data.stored_source(overrides["eval_data"])
    changeable = {"steps", "eval_every", "checkpoint_every", "log_every", "report_to", "device", "batch",
                  "grad_accum", "eval_data",  # (eval_data: what the periodic evaluation reads, not what trains)
                  "lora.kernel"}  # (how the adapters compute: a run trained with Triton's kernels resumes without)

    def saved_value(key):
        return getattr(config.lora, key[5:]) if key.startswith("lora.") else getattr(config, key)

    def same(key, value):  # (both data sources stored alike: data.stored_source, concept.migrate)
        return value == saved_value(key)

    conflicts = [f"{k}: the run was trained with {saved_value(k)!r}, you passed {v!r}"
                 for k, v in overrides.items() if k not in changeable | DATA_FIELDS and not same(k, v)]
    if conflicts:
        raise ConfigError(["--resume continues the saved configuration; these differ:", *conflicts])
    changed = [f"{k} {saved_value(k)!r} -> {v!r}" for k, v in overrides.items() if k in DATA_FIELDS and not same(k, v)]
    global_batch = config.batch * config.grad_accum * before
    for k, v in overrides.items():
        if k.startswith("lora."):
            setattr(config.lora, k[5:], v)
        else:
            setattr(config, k, v)
    if config.batch * config.grad_accum * world_size != global_batch:
        fit_global_batch(config, global_batch, before, world_size, set(overrides))
    return record, config, source, changed


def saved_config(out: Path, saved) -> tuple[str | None, int, TrainConfig]:
    """train.json's (source run, number of processes, config), checked for what resume reads: an object
    whose fields are the run's training options (the core's and its family's: ``run_files.train_config_of``), each of
    its type (nothing is written before this)."""
    file = out / TRAIN_FILE
    fix = "restore it from a copy of the run, or start a new run instead of --resume (`concept train SOURCE -o DIR`)"
    if not isinstance(saved, dict):
        raise checkpoint.damaged(file, f"expected a JSON object, got {json.dumps(saved)[:40]}", fix)
    saved = dict(saved)
    source = saved.pop("source", None)
    distributed = saved.get("distributed") or {}
    before = distributed.get("world_size", 1) if isinstance(distributed, dict) else None
    if not isinstance(source, (str, type(None))) or not checkpoint.whole(before, 1):
        raise checkpoint.damaged(file, "its source or distributed.world_size has the wrong type", fix)
    for key in DERIVED[1:]:  # not config fields
        saved.pop(key, None)
    try:
        config = run_files.train_config_of(out).from_dict(saved)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise checkpoint.damaged(file, f"not a training config: {exc}", fix) from None
    wrong = options.mistyped(config) + [f"lora.{name}" for name in options.mistyped(config.lora)]
    if wrong:
        raise checkpoint.damaged(file, f"wrong type of {', '.join(wrong)}", fix)
    return source, before, config


def fit_global_batch(config: TrainConfig, global_batch: int, before: int, world: int, given: set) -> None:
    """Resuming on another number of processes: keep the global batch, by the accumulation when the
    user did not choose --batch / --grad-accum; anything else is an error that says what to pass."""
    was = f"the run's global batch is {global_batch} rows per step ({before} process{'es' if before > 1 else ''})"
    if not given & {"batch", "grad_accum"} and global_batch % (config.batch * world) == 0:
        config.grad_accum = global_batch // (config.batch * world)
        return
    if global_batch % world:
        raise ConfigError([f"{world} processes do not divide the global batch: {was}; resume on a number of "
                           f"processes that divides {global_batch}"])
    per_rank = global_batch // world
    raise ConfigError([f"resuming with a different global batch: {was}, but --batch {config.batch} x "
                       f"{world} process{'es' if world > 1 else ''} x --grad-accum {config.grad_accum} = "
                       f"{config.batch * world * config.grad_accum}; pass --batch and --grad-accum whose "
                       f"product is {per_rank}"])
