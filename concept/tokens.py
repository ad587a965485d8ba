"""Tokenisers and the on-disk token cache used by ``concept.data``.

* ``ByteTokenizer``: UTF-8 bytes as ids 0..255, for backbones that ship no tokenizer (the tiny
  random ones). It has the two calls the pipeline needs from a Hugging Face fast tokenizer:
  ``tok(texts) -> {"input_ids": [[...], ...]}`` and ``tok.decode(ids)``.
* ``tokenize_documents``: every document's token ids as one flat int32 array plus per-document
  lengths, tokenised in chunks with the tokenizer's batch call. For real tokenizers the result
  is cached as ``<key>.npy`` (int32) + ``<key>.json`` (lengths) under
  ``cache_root() / "data"``, both written atomically (temp file + ``os.replace``); the key
  hashes the documents' names and texts and the tokenizer (its class, name, vocabulary size,
  eos id, and its serialised definition), so any change to data or tokenizer misses cleanly.
  Byte tokenisation is faster than reading a cache, so it is never cached.

The file is named ``tokens`` rather than ``tokenize`` so that it can never shadow the
standard library's ``tokenize`` module.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import fs
from .errors import ConceptError

log = logging.getLogger("concept.data")

CACHE_VERSION = 1
CHUNK_CHARS = 1 << 20  # tokenise about 1 MB of text per batch call
CHUNK_DOCS = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no special tokens (``eos_token_id = None``)."""

    name_or_path = "bytes"
    eos_token_id = None
    bos_token_id = None
    pad_token_id = None

    def __init__(self, vocab_size: int = 256):
        if int(vocab_size) < 256:
            raise ConceptError(
                f"byte-level tokenisation needs a vocabulary of at least 256 ids (one per UTF-8 byte), but the "
                f"backbone has {vocab_size}; build the backbone with a vocabulary of 256 or more (e.g. "
                f'{{"vocab": 256}} for the tiny backbones) or use a backbone that ships a tokenizer'
            )
        self.vocab_size = int(vocab_size)

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)

    def encode(self, text: str, **_: Any) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def __call__(self, texts: str | Sequence[str], **_: Any) -> dict[str, list]:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        return {"input_ids": [self.encode(t) for t in texts]}

    def decode(self, ids, **_: Any) -> str:
        """Bytes back to text (invalid UTF-8 and ids outside 0..255 become U+FFFD)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        parts, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                parts.append(run.decode("utf-8", "replace") + "\ufffd")
                run = bytearray()
        parts.append(run.decode("utf-8", "replace"))
        return "".join(parts)

    def batch_decode(self, batch, **kw: Any) -> list[str]:
        return [self.decode(ids, **kw) for ids in batch]

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


def encode_text(tokenizer, text: str) -> list[int]:
    """The token ids of one text, from a Hugging Face tokenizer (its ``encode``) or a callable tokenizer
    (a dict with ``input_ids``, a tensor or array [T] or [1, T], or a list)."""
    ids = tokenizer.encode(text) if hasattr(tokenizer, "encode") else tokenizer(text)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if hasattr(ids, "flatten"):  # a tensor or an array
        ids = ids.flatten().tolist()
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(i) for i in ids]


def tokenizer_for(model):
    """The model's own tokenizer, or bytes for backbones that have none."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    return ByteTokenizer(int(model.backbone.config.vocab_size))


# -- tokenising -------------------------------------------------------------------------------
@dataclass
class TokenizedDocuments:
    ids: np.ndarray  # int32 [sum(lengths)], documents back to back, in the order given
    lengths: np.ndarray  # int64 [num documents]
    cache_path: Path | None = None  # the .npy file, when cached
    cache_hit: bool = False


@contextlib.contextmanager
def _quiet_transformers():
    """Silence "Token indices sequence length is longer than the specified maximum": we never
    feed whole documents to the model, we pack them into rows."""
    if "transformers" not in sys.modules:
        yield
        return
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _chunks(texts: Sequence[str]):
    start, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= CHUNK_CHARS or i + 1 - start >= CHUNK_DOCS:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def _batch_encoder(tokenizer, texts: Sequence[str]):
    """The tokenizer's batch call; for Hugging Face fast tokenizers, the Rust backend's
    ``encode_batch_fast`` (no offsets: about twice as fast), once a sample shows it agrees."""
    def call(batch):
        try:
            return tokenizer(batch, verbose=False)["input_ids"]
        except TypeError:  # not a Hugging Face tokenizer: no `verbose`
            return tokenizer(batch)["input_ids"]

    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None or getattr(backend, "truncation", None) or getattr(backend, "padding", None) or not texts:
        return call

    def encode(batch):
        return [e.ids for e in fast(batch, add_special_tokens=True)]

    sample = [texts[0][:4096], texts[-1][:4096]]
    return encode if encode(sample) == [list(ids) for ids in call(sample)] else call


def _tokenize(texts: Sequence[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.zeros(len(texts), dtype=np.int64)
    encode_array = getattr(tokenizer, "encode_array", None)
    if encode_array is not None:  # ByteTokenizer: straight from the bytes
        arrays = [encode_array(t) for t in texts]
        lengths[:] = [len(a) for a in arrays]
        ids = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
        return ids, lengths
    pieces = []
    with _quiet_transformers():
        encode = _batch_encoder(tokenizer, texts)
        for a, b in _chunks(texts):
            for j, seq in enumerate(encode(list(texts[a:b]))):
                lengths[a + j] = len(seq)
                pieces.append(np.asarray(seq, dtype=np.int32))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return ids, lengths


# -- cache --------------------------------------------------------------------------------------
def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer's output: class, name, sizes, eos, and its full definition."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode("utf-8"))
    elif hasattr(tokenizer, "get_vocab"):
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    try:
        size = len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
    return {
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "name": str(getattr(tokenizer, "name_or_path", "")),
        "size": size,
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "definition": digest.hexdigest()[:20],
    }


def documents_digest(documents) -> str:
    digest = hashlib.sha256()
    for doc in documents:
        name = doc.name.encode("utf-8", "surrogateescape")
        text = doc.text.encode("utf-8", "surrogatepass")
        digest.update(b"%d:%d:" % (len(name), len(text)))
        digest.update(name)
        digest.update(text)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    return fs.cache_root() / "data"


def _load_cached(npy: Path, meta: Path, count: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        info = json.loads(meta.read_text())
        lengths = np.asarray(info["lengths"], dtype=np.int64)
        ids = np.load(npy, mmap_mode="r")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if ids.dtype != np.int32 or ids.ndim != 1 or len(lengths) != count or int(lengths.sum()) != ids.shape[0]:
        return None
    return ids, lengths


def tokenize_documents(documents, tokenizer, cache_dir: str | os.PathLike | None | bool = None) -> TokenizedDocuments:
    """Token ids of ``documents`` (in the order given), from the cache when possible.

    ``cache_dir``: None for ``cache_root() / "data"``, a folder, or False for no cache.
    """
    texts = [d.text for d in documents]
    if cache_dir is False or getattr(tokenizer, "encode_array", None) is not None:
        return TokenizedDocuments(*_tokenize(texts, tokenizer))
    folder = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    fingerprint = tokenizer_fingerprint(tokenizer)
    key = hashlib.sha256(json.dumps(
        {"version": CACHE_VERSION, "tokenizer": fingerprint, "documents": documents_digest(documents)},
        sort_keys=True).encode()).hexdigest()[:32]
    npy, meta = folder / f"tokens-{key}.npy", folder / f"tokens-{key}.json"
    if meta.is_file() and npy.is_file():
        cached = _load_cached(npy, meta, len(documents))
        if cached is not None:
            return TokenizedDocuments(*cached, cache_path=npy, cache_hit=True)
    ids, lengths = _tokenize(texts, tokenizer)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fs.write_atomic(npy, lambda f: np.save(f, ids, allow_pickle=False))
        record = {"version": CACHE_VERSION, "tokenizer": fingerprint, "documents": len(documents),
                  "tokens": int(ids.shape[0]), "lengths": lengths.tolist()}
        fs.write_atomic(meta, json.dumps(record))  # written last: marks it complete
    except OSError as exc:
        log.warning("concept: could not write the token cache in %s (%s); continuing without it", folder, exc)
        return TokenizedDocuments(ids, lengths)
    return TokenizedDocuments(ids, lengths, cache_path=npy, cache_hit=False)
