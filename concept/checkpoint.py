"""Checkpoints inside a run folder, written atomically.

``RUN/checkpoint/`` holds everything needed to continue exactly: the new modules and LoRA
adapters (safetensors), optimizer and scheduler state, RNG states, the ratio controller and
the step (the data position is a pure function of the step). A new checkpoint is written to
a temporary folder and swapped in with renames, so a crash or a full disk while writing
leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from . import fs
from .errors import RunFolderError

CHECKPOINT = "checkpoint"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write(run: Path, tensors: dict[str, dict[str, torch.Tensor]], objects: dict, meta: dict,
          files: dict[str, bytes] | None = None) -> Path:
    """tensors: file stem -> state dict (safetensors); objects: torch.save'd; meta: state.json; files: name ->
    bytes, written as they are (e.g. an objective's state)."""
    run = Path(run)
    tmp = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=run))
    try:
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        for stem, state in tensors.items():
            if state:
                save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, tmp / f"{stem}.safetensors")
        torch.save(objects, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))  # written last: marks the folder complete
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


def read_meta(run: Path) -> dict | None:
    path = folder(run)
    return None if path is None else json.loads((path / "state.json").read_text())


def read_tensors(run: Path, stem: str) -> dict[str, torch.Tensor] | None:
    path = folder(run)
    file = None if path is None else path / f"{stem}.safetensors"
    if file is None or not file.is_file():
        return None
    try:
        return load_file(file)
    except Exception as exc:
        raise RunFolderError(f"{file} is unreadable ({exc})") from exc


def read_file(run: Path, name: str) -> bytes | None:
    """A file written with ``write(files=...)``, or None."""
    path = folder(run)
    file = None if path is None else path / name
    return file.read_bytes() if file is not None and file.is_file() else None


def read_objects(run: Path) -> dict:
    path = folder(run)
    if path is None:
        raise RunFolderError(f"{run} has no checkpoint to resume from")
    try:
        return torch.load(path / "trainer.pt", weights_only=False)
    except Exception as exc:
        raise RunFolderError(f"{path / 'trainer.pt'} is unreadable ({type(exc).__name__}: {exc}); "
                             f"the optimizer state is lost: start a new run from {run} instead of --resume") from exc
