"""Files too large for one device call: split into parts, each part and the whole checked by sha256.

The GPU machine takes at most 64 MiB per call (the working tree plus the carried folders), so a
large file (the SmolLM2 wheel with its GGUF inside) travels as parts spread over several calls and
is put back together there. The manifest written by ``make gpu-pack`` records the size and sha256
of every part and of the whole; :func:`reassemble` refuses a missing, truncated or corrupted part
by name before it writes anything, and checks the whole file again after joining.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from concept import fs

CHUNK = 1 << 20
MANIFEST = "manifest.json"


class PackError(Exception):
    """A pack that is incomplete or damaged; the message names the file and what to do."""


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def describe(path: str | os.PathLike) -> dict:
    """``{"name", "size", "sha256"}`` of one file."""
    path = Path(path)
    return {"name": path.name, "size": path.stat().st_size, "sha256": sha256_file(path)}


def part_name(name: str, index: int, count: int) -> str:
    return f"{name}.part{index}of{count}"


def even_sizes(total: int, count: int) -> list[int]:
    """``count`` part sizes that add up to ``total``, as equal as whole bytes allow (the first ones larger)."""
    if count < 1 or total < count:
        raise ValueError(f"cannot split {total} bytes into {count} parts")
    base, extra = divmod(total, count)
    return [base + (i < extra) for i in range(count)]


def split_file(source: str | os.PathLike, folders: list[str | os.PathLike]) -> list[dict]:
    """Split ``source`` into one part per folder (equal sizes), ``NAME.partIofN`` in folder I.
    Returns each part's ``{"name", "size", "sha256", "folder"}``."""
    source = Path(source)
    sizes = even_sizes(source.stat().st_size, len(folders))
    parts = []
    with open(source, "rb") as f:
        for i, (size, folder) in enumerate(zip(sizes, folders), 1):
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / part_name(source.name, i, len(folders))
            digest = hashlib.sha256()

            def copy(out, left=size, digest=digest):
                while left:
                    block = f.read(min(CHUNK, left))
                    digest.update(block)
                    out.write(block)
                    left -= len(block)

            fs.write_atomic(target, copy)
            parts.append({"name": target.name, "size": size, "sha256": digest.hexdigest(), "folder": str(folder)})
    return parts


def check_part(path: Path, expected: dict) -> None:
    """Raise :class:`PackError` unless ``path`` has the expected size and sha256."""
    if not path.is_file():
        raise PackError(f"{path} is missing")
    size = path.stat().st_size
    if size != expected["size"]:
        raise PackError(f"{path} has {size} bytes, the manifest says {expected['size']} (truncated or from another "
                        f"pack); run `make gpu-pack` again and carry the new folders")
    if sha256_file(path) != expected["sha256"]:
        raise PackError(f"{path} is corrupted (its sha256 differs from the manifest's); run `make gpu-pack` again "
                        f"and carry the new folders")


def reassemble(parts: list[Path], whole: dict, dest: str | os.PathLike) -> Path:
    """Join ``parts`` (in order; each a path with its expected ``size`` / ``sha256`` in ``whole["parts"]``)
    into ``dest``, after checking every part; the result must match ``whole``'s size and sha256.
    Written to a temporary file and renamed, so ``dest`` is complete or absent."""
    dest = Path(dest)
    for path, expected in zip(parts, whole["parts"], strict=True):
        check_part(Path(path), expected)
    dest.parent.mkdir(parents=True, exist_ok=True)

    def join(out):
        digest, size = hashlib.sha256(), 0
        for path in parts:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    digest.update(block)
                    size += len(block)
                    out.write(block)
        if (size, digest.hexdigest()) != (whole["size"], whole["sha256"]):
            raise PackError(f"{dest.name}: the joined parts do not match the manifest ({size} bytes, sha256 "
                            f"{digest.hexdigest()[:12]}...; expected {whole['size']} bytes, {whole['sha256'][:12]}...)")

    fs.write_atomic(dest, join)  # complete and checked, or absent
    return dest


def read_manifest(folder: str | os.PathLike) -> dict:
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PackError(f"{path} is missing: carry the folder that `make gpu-pack` wrote") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PackError(f"{path} is unreadable ({exc}); run `make gpu-pack` again") from None
