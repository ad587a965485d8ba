"""What a checkpoint was trained from, in a few hex digits: the build (its ``concept.json`` config), the
training data (its documents) and an external backbone folder (an ``hf`` backbone's local files).

A checkpoint records them (``state.json``'s ``fingerprints``); resuming or evaluating a run compares them
with what the run reads now (``concept.checkpoint.check_origin``), so that a checkpoint copied from another
build, or weights replaced under a run, are refused instead of silently loaded.

A backbone folder is fingerprinted file by file without reading it whole: each file's size, its
safetensors header (every tensor's name, dtype, shape and offsets) and ``SAMPLES`` blocks of ``BLOCK``
bytes spread evenly over it. Other weights of the same shapes differ in every block, so they are caught;
the cost does not grow with the model (docs/reliability.md has the measurement).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SAMPLES = 256
BLOCK = 4096
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one (hashed as sampled bytes)
BACKBONE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model")
BACKBONE_NAMES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                  "special_tokens_map.json")


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def of_config(config: dict) -> str:
    """A build config (``concept.json``'s ``config``). An ``hf`` backbone's ``path`` is left out: where the
    folder lies is not what it holds (that is :func:`of_backbone`), and an export's ``./backbone`` resolves to
    wherever the export was moved."""
    config = json.loads(json.dumps(config, default=str))
    backbone = config.get("backbone") if isinstance(config, dict) else None
    if isinstance(backbone, dict) and backbone.get("name") == "hf" and isinstance(backbone.get("params"), dict):
        backbone["params"].pop("path", None)
    return _digest(json.dumps(config, sort_keys=True))


def of_documents(*splits) -> str:
    """The documents training reads (names and texts, in order), e.g. its train and held-out splits."""
    # lazy: concept.tokens (the token shards' reader) is needed only when documents are fingerprinted
    from .tokens import documents_digest

    return _digest("/".join(documents_digest(docs) for docs in splits))


def of_digests(*digests: str) -> str:
    """:func:`of_documents` from each split's ``documents_digest`` (as a token shard records them)."""
    return _digest("/".join(digests))


def _sampled(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        if size <= SAMPLES * BLOCK:
            return f.read()
        parts = []
        if path.suffix == ".safetensors":
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            if 0 < length <= min(HEADER_MAX, size - 8):
                parts.append(head + f.read(length))
        for i in range(SAMPLES):
            f.seek(i * (size - BLOCK) // (SAMPLES - 1))
            parts.append(f.read(BLOCK))
    return b"".join(parts)


def of_backbone(folder: str | os.PathLike | None) -> dict[str, str] | None:
    """A local backbone folder, file by file (weights, config, tokenizer): name -> fingerprint; None when
    there is no such folder."""
    if folder is None or not Path(folder).is_dir():
        return None
    out = {}
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and (path.suffix in BACKBONE_SUFFIXES or path.name in BACKBONE_NAMES):
            size = path.stat().st_size
            out[path.name] = _digest(b"%d:" % size + _sampled(path, size))
    return out


def backbone_changes(recorded: dict, now: dict | None) -> list[str]:
    """The files of a backbone folder that differ between two :func:`of_backbone` results."""
    now = now or {}
    return [f"{name} {'is gone' if name not in now else 'is new' if name not in recorded else 'changed'}"
            for name in sorted(set(recorded) | set(now)) if recorded.get(name) != now.get(name)]
