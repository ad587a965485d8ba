"""Checkpoints inside a run folder, written atomically and read back checked.

``RUN/checkpoint/`` holds everything needed to continue exactly: the new modules and LoRA
adapters (safetensors), optimizer and scheduler state, RNG states, the ratio controller and
the step (the data position is a pure function of the step). A new checkpoint is written to
a temporary folder and swapped in with renames, so a crash or a full disk while writing
leaves the previous checkpoint intact. ``state.json`` (written last) records the SHA-256 of
the weights and of ``trainer.pt`` and the fingerprints of what the run was trained from (``concept.fingerprint``):
reading a checkpoint checks both, so a damaged file or a checkpoint copied from another build is
one clear error instead of silently wrong weights. ``metrics.jsonl`` (the run's log, truncated
back to the checkpoint on resume) is read checked here too.

What a writer killed mid-write leaves inside a run (``.checkpoint-XXXX`` staging folders,
``.adapter.new-PID``, ``.NAME.XXXX.tmp`` files) is removed by :func:`sweep`, called by the next
command that holds the run's lock (``concept.fs.Lock``) or finds it free.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from . import fingerprint, fs
from .errors import RunFolderError
from .migrate import fingerprinted

CHECKPOINT = "checkpoint"
STATE_FILE = "state.json"
OBJECTS_FILE = "trainer.pt"
METRICS = "metrics.jsonl"
FIX = "restore the run from a copy, or train a new run from its source (`concept train SOURCE -o DIR`)"
# left inside a run by a writer killed mid-write: checkpoint staging (not the legacy .checkpoint-old), a peft
# adapter folder being swapped in (concept.lora), a file being replaced atomically (fs.write_atomic)
LEFTOVER = re.compile(r"^\.(checkpoint-(?!old$).+|.+\.new-\d+|.+\.tmp)$")


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_file(state: dict[str, torch.Tensor], path: Path) -> str:
    """Write a state dict as a safetensors file (flushed to disk; a failed write keeps its errno); returns its
    SHA-256."""
    return fs.write_file(path, safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in state.items()}))


def write(run: Path, tensors: dict[str, dict[str, torch.Tensor]], objects: dict, meta: dict,
          files: dict[str, bytes] | None = None) -> Path:
    """tensors: file stem -> state dict (safetensors); objects: torch.save'd; meta: state.json; files: name ->
    bytes, written as they are (e.g. an objective's state: a cache its objective checks itself, and rebuilds
    with a warning when damaged). ``state.json`` gets the SHA-256 of the weights and of ``trainer.pt``."""
    run = Path(run)
    tmp = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=run))
    try:
        digests = {}
        for name, data in (files or {}).items():
            fs.write_file(tmp / name, data)
        for stem, state in tensors.items():
            if state:
                digests[f"{stem}.safetensors"] = save_file(state, tmp / f"{stem}.safetensors")
        digests[OBJECTS_FILE] = fs.write_file(tmp / OBJECTS_FILE, lambda f: torch.save(objects, f))
        meta = {**meta, "sha256": digests}
        fs.write_file(tmp / STATE_FILE, json.dumps(meta, indent=2).encode())  # written last: marks the folder complete
        fs.publish_permissions(tmp)
        fs.replace_dir(tmp, run / CHECKPOINT)  # one atomic swap: the previous checkpoint until the new one is whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run / CHECKPOINT


def folder(run: Path) -> Path | None:
    """The newest complete checkpoint folder (``.checkpoint-old``: left by an interrupted swap of an older
    version, which renamed the previous checkpoint aside first)."""
    for name in (CHECKPOINT, f".{CHECKPOINT}-old"):
        path = Path(run) / name
        if (path / "state.json").is_file():
            return path
    return None


def check_intact(run: Path, fix: str) -> None:
    """Refuse a run whose ``checkpoint/`` folder exists but is incomplete (no ``state.json``), rather
    than take it for a run that was never checkpointed; ``fix`` says what to do instead."""
    if (Path(run) / CHECKPOINT).exists() and folder(run) is None:
        raise RunFolderError(f"{Path(run) / CHECKPOINT} is damaged (it has no state.json) and no earlier "
                             f"checkpoint is left; {fix}")


def damaged(file: Path, problem: str, fix: str = FIX) -> RunFolderError:
    return RunFolderError(f"{file} is damaged ({problem}); {fix}")


def whole(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def meta_problem(meta) -> str | None:
    """What is wrong with a ``state.json``'s content, or None."""
    if not isinstance(meta, dict):
        return f"expected a JSON object, got {type(meta).__name__}"
    if "step" not in meta:
        return "it has no step"
    if not whole(meta["step"], 0):
        return f"step must be a whole number >= 0, got {json.dumps(meta['step'])}"
    for key in ("world_size", "global_batch"):
        if key in meta and not whole(meta[key], 1):
            return f"{key} must be a whole number >= 1, got {json.dumps(meta[key])}"
    for key in ("files", "sha256"):
        value = meta.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return f"{key} must map file names to checksums"
    prints = meta.get("fingerprints", {})
    if not isinstance(prints, dict):
        return "fingerprints must be a JSON object"
    return None


def read_meta(run: Path) -> dict | None:
    """The newest checkpoint's ``state.json``, checked (a whole step >= 0, ...), or None without a checkpoint."""
    path = folder(run)
    if path is None:
        return None
    file = path / STATE_FILE
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged(file, f"not readable JSON: {exc}") from None
    problem = meta_problem(meta)
    if problem:
        raise damaged(file, problem)
    return meta


def _checked(file: Path, meta: dict | None) -> bytes | None:
    """``file``'s bytes after checking them against the SHA-256 its checkpoint recorded (when it did)."""
    expected = (meta or {}).get("sha256", {}).get(file.name)
    if expected is None:
        return None
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise damaged(file, f"unreadable: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise RunFolderError(f"{file} is unreadable (its SHA-256 does not match the one {file.parent / STATE_FILE} "
                             f"recorded: it was changed or cut short since it was written); {FIX}")
    return data


def verify(run: Path) -> None:
    """Check every file of the newest checkpoint against the SHA-256 its ``state.json`` recorded: a missing,
    truncated or altered file is one error, before anything is loaded or written."""
    meta = read_meta(run)
    path = folder(run)
    for name in (meta or {}).get("sha256", {}):
        if not (path / name).is_file():
            raise damaged(path / name, "it is missing")
        _checked(path / name, meta)


def read_tensors(run: Path, stem: str) -> dict[str, torch.Tensor] | None:
    path = folder(run)
    file = None if path is None else path / f"{stem}.safetensors"
    if file is None or not file.is_file():
        return None
    data = _checked(file, read_meta(run))
    try:
        if data is not None:
            from safetensors.torch import load

            return load(data)
        return load_file(file)
    except Exception as exc:
        raise RunFolderError(f"{file} is unreadable ({exc}); {FIX}") from exc


def read_file(run: Path, name: str) -> bytes | None:
    """A file written with ``write(files=...)``, or None."""
    path = folder(run)
    file = None if path is None else path / name
    return file.read_bytes() if file is not None and file.is_file() else None


def read_objects(run: Path) -> dict:
    path = folder(run)
    if path is None:
        raise RunFolderError(f"{run} has no checkpoint to resume from")
    _checked(path / OBJECTS_FILE, read_meta(run))
    try:
        return torch.load(path / OBJECTS_FILE, weights_only=False)
    except Exception as exc:
        raise RunFolderError(f"{path / OBJECTS_FILE} is unreadable ({type(exc).__name__}: {exc}); "
                             f"the optimizer state is lost: start a new run from {run} instead of --resume") from exc


# -- the log ---------------------------------------------------------------------------------------
def read_metrics(run: Path) -> list[tuple[str, dict]]:
    """``metrics.jsonl``, checked: (line, row) for every row, each a JSON object with a whole ``step`` >= 1.
    A last line that is not JSON (torn by a kill while it was appended) is dropped; anything else wrong is
    an error naming the line."""
    file = Path(run) / METRICS
    if not file.is_file():
        return []
    fix = f"remove that line (or restore {file.name} from a copy) and run again"
    try:
        lines = file.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise damaged(file, f"not readable UTF-8 text: {exc}", fix) from None
    rows = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == last:  # a torn last line
                continue
            raise damaged(file, f"line {i + 1} is not JSON", fix) from None
        if not isinstance(row, dict):
            raise damaged(file, f"line {i + 1} is not a JSON object but {type(row).__name__}", fix)
        if not whole(row.get("step"), 1):
            raise damaged(file, f"line {i + 1} has no whole step >= 1 (step: {json.dumps(row.get('step'))})", fix)
        rows.append((line, row))
    return rows


# -- what the run was trained from --------------------------------------------------------------------
def fingerprints(config: dict, backbone_dir: Path | None, data: str | None) -> dict:
    """What a checkpoint records about its origin (``concept.fingerprint``)."""
    return {"build": fingerprint.of_config(config), "backbone": fingerprint.of_backbone(backbone_dir), "data": data}


def check_origin(run: Path, config: dict, backbone_dir: Path | None) -> dict | None:
    """Refuse a checkpoint written for another build (copied from another run: another split, backbone,
    family, ...) or whose ``hf`` backbone folder changed since (other weights). Checkpoints written before
    fingerprints pass. Returns the checkpoint's ``state.json`` (or None without a checkpoint)."""
    meta = read_meta(run)
    recorded = (meta or {}).get("fingerprints") or {}
    path = folder(run)
    # (a checkpoint written before concept.json's format 3 fingerprinted the same build written flat; one of an
    # older baseline run, the build it was trained from: concept.migrate.fingerprinted)
    if recorded.get("build") not in (None, *(fingerprint.of_config(c) for c in fingerprinted(config))):
        raise RunFolderError(
            f"{path} was not written for this run's build: its build fingerprint ({recorded['build']}) differs from "
            f"that of {Path(run) / fs.RUN_MARKER} ({fingerprint.of_config(config)}), e.g. a checkpoint copied from a "
            f"run with another split or backbone; put the run's own checkpoint back, or train a new run from this "
            f"build (`concept train {run} -o DIR`)")
    if isinstance(recorded.get("backbone"), dict):
        changes = fingerprint.backbone_changes(recorded["backbone"], fingerprint.of_backbone(backbone_dir))
        if changes:
            raise RunFolderError(
                f"the backbone folder {backbone_dir} changed since {path} (step {meta['step']}) was trained on it "
                f"({'; '.join(changes[:3])}): its weights no longer fit the run; put the original files back, or "
                f"build and train a new run on the new backbone")
    return meta


# -- leftovers ---------------------------------------------------------------------------------------
def sweep(run: Path) -> list[str]:
    """Remove what a writer killed mid-write left inside ``run`` (``LEFTOVER``); the caller holds the run's lock
    (nobody else is writing it). Returns the names removed."""
    removed = []
    try:
        entries = sorted(Path(run).iterdir())
    except OSError:
        return []
    for path in entries:
        if not LEFTOVER.match(path.name):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def sweep_if_free(run: Path) -> list[str]:
    """:func:`sweep` when nobody holds the run's lock (a command that only reads the run: it takes the lock
    for the sweep alone); nothing when someone is writing it."""
    run = Path(run)
    if not run.is_dir() or not any(LEFTOVER.match(p.name) for p in run.iterdir()):
        return []  # (nothing to sweep: no lock taken)
    lock = fs.Lock(run)
    if not lock.try_acquire():
        return []
    try:
        return sweep(run)
    finally:
        lock.release()
