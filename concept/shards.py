"""Token shards: a corpus tokenised once, stored as memory-mapped arrays, read without loading it into RAM.

    open_split(source, split, tokenizer, ...)  ->  TokenSplit(ids, lengths, digest, ...)

A **shard** is one folder ``<cache>/shards/<key>/`` (``<cache>``: ``$CONCEPT_CACHE``, else
``$XDG_CACHE_HOME/concept``, else ``~/.cache/concept``; ``$CONCEPT_DATA_CACHE`` names the shards' folder
itself, e.g. a large or fast disk, without moving the rest of the cache):

* ``tokens.bin``: every document's token ids back to back, in the corpus's sorted order, each followed by
  the tokenizer's eos when it has one (unless the document already ends with it); ``uint16`` when the
  vocabulary fits in 65,536 ids, else ``uint32`` (raw, read with ``numpy.memmap``);
* ``lengths.npy`` (int64, per document, eos included) and ``heldout.npy`` (bool, per document): the
  held-out flags of ``concept.data``'s rule (sha256 of the document's name below ``heldout_fraction``; every
  document training data when they would all be held out), so both splits are views of one shard;
* ``meta.json``: the format version, dtype, counts, the documents' digests per split (names and texts, as
  ``concept.tokens.documents_digest``: what a checkpoint's data fingerprint records) and checksums of the
  three files (the ``lengths`` and ``heldout`` files whole; ``tokens.bin``'s size and 16 sampled blocks, so
  that opening stays flat in corpus size).

**Keys.** A shard's ``key`` hashes the format version, the tokenizer's fingerprint, ``heldout_fraction`` and
the digest of every document (content). Finding it must not read the corpus, so a small index file
``<cache>/shards/source-<skey>.json`` maps a *source key* to it: the source, its options and, for files
and folders, the size and modification time of every file under it (one ``stat`` each; the built-in
corpora: the Python version and path; a ``datasets`` dataset: its own fingerprint, or, streamed, its
name and split). A source key that misses reads the documents, hashes them, and reuses the shard of the
same content if there is one; otherwise it tokenises them.

**Writes** happen under an exclusive ``flock`` on ``<cache>/shards/.source-<skey>.lock`` (a second process
waits, then finds the shard), into ``.tmp-*`` folders renamed into place when complete, so a reader never
sees a half-written shard. A shard that fails its checks (truncated, missing files, checksum mismatch) is
reported once as a warning, removed and rebuilt: never read as a wrong corpus.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from . import fs
from .errors import ConceptError
from .tokens import CHUNK_CHARS, CHUNK_DOCS, _tokenize, tokenizer_fingerprint

log = logging.getLogger("concept.data")

FORMAT_VERSION = 1
SAMPLE_BLOCKS, SAMPLE_BLOCK = 16, 1 << 16
SPLITS = ("train", "heldout", "all")


@dataclass
class TokenSplit:
    """One split of a shard: ``ids`` (memory-mapped, the whole shard's tokens) and, per document of the
    split, in sorted order, ``starts`` (offset into ``ids``) and ``lengths`` (eos included)."""
    ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    digest: str  # documents_digest of the split's documents
    path: Path
    cache_hit: bool
    heldout_digest: str | None = None  # the held-out split's digest ("train": the data fingerprint needs both)

    @property
    def num_documents(self) -> int:
        return len(self.lengths)


DATA_CACHE_ENV = "CONCEPT_DATA_CACHE"  # the shards' folder itself, when they belong elsewhere than the cache


def shards_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir / "shards"``; by default ``$CONCEPT_DATA_CACHE``, else ``cache_root() / "shards"``."""
    if cache_dir is None and os.environ.get(DATA_CACHE_ENV):
        return Path(os.environ[DATA_CACHE_ENV]).expanduser()
    return (fs.cache_root() if cache_dir is None else Path(cache_dir).expanduser()) / "shards"


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data).hexdigest()


def _file_sha(path: Path) -> str:
    return _sha(path.read_bytes())


def _sampled(path: Path) -> str:
    """sha256 of ``path``'s size and of 16 blocks spread over it (flat in its size)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(i * max(0, size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def is_heldout(name: str, fraction: float) -> bool:
    """``concept.data``'s hold-out rule: a stable hash (sha256) of the document's name below ``fraction``."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0 ** 64


def listing(root: Path) -> list:
    """(relative path, size, mtime_ns) of every file under ``root`` (``root`` itself when a file)."""
    if root.is_file():
        st = root.stat()
        return [[root.name, st.st_size, st.st_mtime_ns]]
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.stat(path)
                out.append([os.path.relpath(path, root), st.st_size, st.st_mtime_ns])
    return out


# -- the documents of a source ---------------------------------------------------------------------------------
def _split_flags(names: list[str], fraction: float) -> np.ndarray:
    held = np.array([is_heldout(n, fraction) for n in names], dtype=bool)
    return np.zeros_like(held) if held.all() else held  # tiny corpora: never leave training empty


class _Digests:
    """documents_digest of the train, held-out and whole corpus, fed one document at a time."""

    def __init__(self):
        self.parts = {s: hashlib.sha256() for s in SPLITS}

    def add(self, name: str, text: str, heldout: bool) -> None:
        name_b, text_b = name.encode("utf-8", "surrogateescape"), text.encode("utf-8", "surrogatepass")
        for split in ("all", "heldout" if heldout else "train"):
            self.parts[split].update(b"%d:%d:" % (len(name_b), len(text_b)))
            self.parts[split].update(name_b)
            self.parts[split].update(text_b)

    def hexdigests(self) -> dict[str, str]:
        return {s: h.hexdigest() for s, h in self.parts.items()}


def _content_key(tokenizer_fp: dict, fraction: float, all_digest: str) -> str:
    return _sha(json.dumps({"format": FORMAT_VERSION, "tokenizer": tokenizer_fp, "heldout_fraction": fraction,
                            "documents": all_digest}, sort_keys=True))[:32]


# -- writing ------------------------------------------------------------------------------------------------------
def _dtype(tokenizer_fp: dict, tokenizer) -> np.dtype:
    size = tokenizer_fp.get("size") or getattr(tokenizer, "vocab_size", None)
    return np.dtype(np.uint16) if isinstance(size, int) and size <= 1 << 16 else np.dtype(np.uint32)


def _chunks(documents: Iterable) -> Iterator[list]:
    chunk, size = [], 0
    for doc in documents:
        chunk.append(doc)
        size += len(doc.text)
        if size >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write(folder: Path, documents: Iterable, tokenizer, tokenizer_fp: dict, fraction: float,
           flags: np.ndarray | None, source: str) -> dict:
    """Tokenise ``documents`` (sorted, named) into the shard files of ``folder``; its meta.json last.
    ``flags``: the held-out flags when known in advance (else from each name, with the all-held rule at the end)."""
    dtype = _dtype(tokenizer_fp, tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    lengths, held, digests, count = [], [], _Digests(), 0
    with open(folder / "tokens.bin", "wb") as out:
        for chunk in _chunks(documents):
            ids, lens = _tokenize([d.text for d in chunk], tokenizer)
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(dtype).max):
                raise ConceptError(f"the tokenizer returned id {int(ids.max())}, outside its vocabulary of "
                                   f"{tokenizer_fp.get('size')}; check the backbone's tokenizer")
            pieces, starts = [], np.concatenate([[0], np.cumsum(lens)])
            for j, doc in enumerate(chunk):
                piece = ids[starts[j]:starts[j + 1]]
                if eos is not None and (len(piece) == 0 or piece[-1] != eos):
                    piece = np.concatenate([piece, np.array([eos], dtype=ids.dtype)])
                pieces.append(piece)
                lengths.append(len(piece))
                h = bool(flags[len(held)]) if flags is not None else is_heldout(doc.name, fraction)
                held.append(h)
                digests.add(doc.name, doc.text, h)
            data = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
            out.write(data.tobytes())
            count += len(data)
        out.flush()
        os.fsync(out.fileno())
    held_arr = np.array(held, dtype=bool)
    if flags is None and len(held_arr) and held_arr.all():  # the all-held rule: recompute the digests
        raise _AllHeldOut()
    if not lengths:
        raise ConceptError(f"{source} holds no documents; add text or point --data elsewhere")
    np.save(folder / "lengths.npy", np.array(lengths, dtype=np.int64), allow_pickle=False)
    np.save(folder / "heldout.npy", held_arr, allow_pickle=False)
    hexd = digests.hexdigests()
    meta = {"format": FORMAT_VERSION, "dtype": dtype.name, "tokens": count, "documents": len(lengths),
            "heldout_documents": int(held_arr.sum()), "heldout_fraction": fraction, "source": source,
            "tokenizer": tokenizer_fp, "digests": hexd,
            "checks": {"tokens.bin": _sampled(folder / "tokens.bin"), "lengths.npy": _file_sha(folder / "lengths.npy"),
                       "heldout.npy": _file_sha(folder / "heldout.npy")}}
    fs.write_atomic(folder / "meta.json", json.dumps(meta))
    return meta


class _AllHeldOut(Exception):
    """Every document of a streamed corpus hashed to held-out: rebuild with no document held out."""


# -- reading ------------------------------------------------------------------------------------------------------
class DamagedShard(Exception):
    pass


def _load(folder: Path) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """(meta, ids, lengths, heldout) of a complete shard; ``DamagedShard`` naming what is wrong."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise DamagedShard(f"format {meta.get('format')!r}, expected {FORMAT_VERSION}")
        dtype = np.dtype(meta["dtype"])
        for name, expected in meta["checks"].items():
            path = folder / name
            actual = _sampled(path) if name == "tokens.bin" else _file_sha(path)
            if actual != expected:
                raise DamagedShard(f"{name} does not match its checksum")
        if (folder / "tokens.bin").stat().st_size != meta["tokens"] * dtype.itemsize:
            raise DamagedShard("tokens.bin has the wrong size")
        lengths = np.load(folder / "lengths.npy", allow_pickle=False)
        heldout = np.load(folder / "heldout.npy", allow_pickle=False)
        ids = (np.memmap(folder / "tokens.bin", dtype=dtype, mode="r", shape=(meta["tokens"],)) if meta["tokens"]
               else np.zeros(0, dtype))
    except DamagedShard:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DamagedShard(f"{type(exc).__name__}: {exc}") from None
    if (lengths.dtype != np.int64 or heldout.dtype != np.bool_ or lengths.shape != (meta["documents"],)
            or heldout.shape != lengths.shape or int(lengths.sum()) != meta["tokens"]):
        raise DamagedShard("its document table does not match its tokens")
    return meta, ids, lengths, heldout


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for another process building the same source
        yield
    finally:
        os.close(fd)


def _read_index(index: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        key = json.loads(index.read_text()).get("key")
        return key if isinstance(key, str) else None
    return None


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)  # atomic; fails when another process published the same content first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "meta.json").is_file():
            raise


def _source_key(source_id: dict, tokenizer_fp: dict, fraction: float) -> str:
    return _sha(json.dumps({"format": FORMAT_VERSION, "source": source_id, "tokenizer": tokenizer_fp,
                            "heldout_fraction": fraction}, sort_keys=True, default=str))[:32]


def open_shard(source_id: dict, documents, tokenizer, fraction: float, label: str,
               cache_dir: str | os.PathLike | None = None) -> tuple[Path, dict, np.ndarray, np.ndarray, np.ndarray, bool]:
    """The shard of a source identified by ``source_id`` (built from ``documents()``, an iterable of sorted
    Documents, or a list, only on a miss). Returns (folder, meta, ids, lengths, heldout, cache_hit)."""
    root = shards_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    skey = _source_key(source_id, tokenizer_fp, fraction)
    index = root / f"source-{skey}.json"

    def attempt() -> tuple | None:
        key = _read_index(index)
        if key is None:
            return None
        try:
            return (root / key, *_load(root / key))
        except DamagedShard as exc:
            log.warning("concept: the token shard %s is damaged (%s); rebuilding it", root / key, exc)
            shutil.rmtree(root / key, ignore_errors=True)
            with contextlib.suppress(OSError):
                index.unlink()
            return None

    found = attempt()
    if found is not None:
        return (*found, True)
    with _locked(root / f".source-{skey}.lock"):
        found = attempt()  # built by another process while we waited
        if found is not None:
            return (*found, True)
        docs = documents()
        flags = None
        if isinstance(docs, list):  # known in advance: the content key, and a shard of the same content
            flags = _split_flags([d.name for d in docs], fraction)
            digests = _Digests()
            for d, h in zip(docs, flags):
                digests.add(d.name, d.text, bool(h))
            key = _content_key(tokenizer_fp, fraction, digests.hexdigests()["all"])
            try:
                loaded = _load(root / key)
                fs.write_atomic(index, json.dumps({"key": key, "source": label}))
                return (root / key, *loaded, True)
            except DamagedShard:
                shutil.rmtree(root / key, ignore_errors=True)
        tmp = Path(fs_tmpdir(root))
        try:
            try:
                meta = _write(tmp, docs, tokenizer, tokenizer_fp, fraction, flags, label)
            except _AllHeldOut:
                meta = _write(tmp, documents(), tokenizer, tokenizer_fp, fraction, _NoneHeld(), label)
            key = _content_key(tokenizer_fp, fraction, meta["digests"]["all"])
            _publish(tmp, root / key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fs.write_atomic(index, json.dumps({"key": key, "source": label}))
        return (root / key, *_load(root / key), False)


class _NoneHeld:
    """Held-out flags that are all False (a streamed corpus whose every document hashed to held-out)."""

    def __getitem__(self, i):
        return False


def fs_tmpdir(root: Path) -> str:
    return tempfile.mkdtemp(prefix=".tmp-", dir=root)


def split_view(folder: Path, meta: dict, ids, lengths, heldout, split: str, label: str, cache_hit: bool,
               fraction: float) -> TokenSplit:
    """The documents of ``split`` ("train", "heldout", "all") of a shard (the rule of ``concept.data._split``)."""
    if split not in SPLITS:
        raise ConceptError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    chosen = np.ones_like(heldout) if split == "all" else heldout if split == "heldout" else ~heldout
    if not chosen.any():
        raise ConceptError(
            f"the held-out split of {label} is empty: none of its {len(lengths)} document(s) falls in the held-out "
            f"{fraction:.0%} (chosen by a hash of each document's name); pass a separate --eval-data for "
            f"evaluation, or use more, smaller documents (e.g. a .jsonl file with one document per line)")
    digests = meta["digests"]
    return TokenSplit(ids, starts[chosen], lengths[chosen], digests[split], folder, cache_hit,
                      heldout_digest=digests["heldout"] if meta["heldout_documents"] else None)


def python_identity() -> dict:
    return {"python": sys.version, "prefix": sys.base_prefix}
