"""Training and evaluation data: documents in, fixed-length packed token rows out.

    read_documents(source, split)  ->  [Document(name, text), ...]      (sorted by name)
    open_tokens(source, split, tokenizer)  ->  TokenSplit                 (a memory-mapped token shard)
    PackedSequences(documents or TokenSplit, tokenizer, seq_len, seed)
        .batch(step, batch_size)  ->  {input_ids, attention_mask, document_ids}  [B, T]

Training and evaluation read ``open_tokens``: the source tokenised once into a token shard
(``concept.shards``: cached by content, memory-mapped, found without reading the source), so a run
neither reads nor holds the corpus; ``PackedSequences`` gathers each batch's rows from the map.

* Sources: a built-in corpus (always on the machine, no download), a text file (one document),
  a ``.jsonl`` file (one document per line, text in ``text_field``), or a folder of those
  (recursive, sorted; hidden entries and binaries skipped). Hugging Face ``datasets`` input,
  read through the ``datasets`` library (imported only then), one document per row, text in
  the column ``text_field``, rows named ``NAME#ROW`` (0-based): a folder written by
  ``Dataset.save_to_disk``; a ``DatasetDict.save_to_disk`` folder (its ``train`` split, or
  ``PATH:SPLIT`` for another; rows named ``SPLIT#ROW`` like ``PATH/SPLIT`` read as a Dataset
  folder); a ``.parquet`` or ``.arrow`` file; and those inside a folder. A dataset id ``datasets.load_dataset``
  loads (``hf:NAME``, or a bare ``NAME`` / ``ORG/NAME`` that is no path: :func:`hub_name`): its split
  ``data_split`` (default ``train``), optionally streamed, rows named ``SPLIT#ROW``. Nothing is written
  next to the data (no ``datasets`` cache). Built-in corpora, by name:

  - ``stdlib`` (alias ``code``; the default): the ``.py`` sources of the Python standard
    library, one document per file (tests, ``site-packages`` and ``pydoc_data`` excluded);
  - ``pydoc`` (alias ``prose``): English prose, the Python language reference and library
    topics that the standard library ships for ``help()`` (``pydoc_data/topics.py``), one
    document per topic, named ``pydoc_data/topics:NAME``.

  ``pydoc_data`` is prose, so it is excluded from the code corpus: the two domains are
  disjoint. For more prose, any folder of text files works, e.g. Debian's ``python3.11-doc``
  reST sources: ``--data /usr/share/doc/python3.11/html/_sources/tutorial``. A folder or file
  named like an alias or ``pydoc`` is ambiguous: pass ``./NAME`` to read it.
* Splits: a document is held out when a stable hash (sha256) of its name falls below
  ``heldout_fraction``. The split therefore does not depend on the seed nor on the order files
  are listed, and held-out documents are never trained on. If every document of a corpus
  hashes to held-out (only possible for a handful of documents) they are all training data and
  the held-out split is empty.
* Packing: documents are tokenised (a token shard; ``concept.tokens`` for a list of Documents), followed by the tokenizer's eos
  when it has one, concatenated in a seeded order and cut into rows of ``seq_len`` tokens (the
  incomplete last row is dropped). ``document_ids`` number the documents inside each row from 0;
  a document cut at a row end continues, as id 0, in the next row.
* Batches: row k of the infinite stream is row ``perm_e[k % rows]`` with ``e = k // rows`` and
  ``perm_e`` a ``torch.randperm`` seeded with ``seed * 1000003 + e``. ``batch(step, B)`` is a pure
  function of ``(seed, step, B)``, so resuming at a step replays exactly the same batches.
"""
from __future__ import annotations

import codecs
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ConceptError, one_line
from . import shards
from .fingerprint import of_digests
from .shards import TokenSplit, listing, python_identity
from .shards import is_heldout as _is_heldout
from .tokens import ByteTokenizer, tokenize_documents, tokenizer_for
from .syncs import host_values

__all__ = ["Document", "DEFAULT_CORPUS", "PROSE_CORPUS", "CORPORA", "builtin_corpus", "read_documents", "ByteTokenizer", "tokenizer_for", "PackedSequences"]

DEFAULT_CORPUS = "stdlib"
PROSE_CORPUS = "pydoc"
CORPORA = {"stdlib": "stdlib", "code": "stdlib", "pydoc": "pydoc", "prose": "pydoc"}  # name -> built-in corpus
SPLITS = ("train", "heldout", "all")
# pydoc_data holds English prose (the `pydoc` corpus), not code
STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
BINARY_SUFFIXES = {
    ".7z", ".a", ".arrow", ".avi", ".bin", ".bmp", ".bz2", ".class", ".db", ".dll", ".dylib", ".exe", ".flac",
    ".gguf", ".gif", ".gz", ".h5", ".ico", ".iso", ".jar", ".jpeg", ".jpg", ".mov", ".mp3", ".mp4", ".npy", ".npz",
    ".o", ".ogg", ".onnx", ".otf", ".parquet", ".pdf", ".pickle", ".pkl", ".png", ".pt", ".pth", ".pyc", ".pyd",
    ".pyo", ".safetensors", ".so", ".sqlite", ".tar", ".tgz", ".tif", ".tiff", ".ttf", ".wav", ".webp", ".whl",
    ".woff", ".woff2", ".xz", ".zip", ".zst",
}
ENCODING_HINT = "pass --encoding-errors replace to decode it with U+FFFD replacement characters"
TABLE_SUFFIXES = {".parquet", ".arrow"}  # read through `datasets`, one document per row (binary otherwise)
DATASETS_PIN = "'datasets>=3.0,<6'"


@dataclass
class Document:
    name: str  # path relative to the source root, "file.jsonl:LINE", or "file.parquet#ROW" / "folder#ROW"
    text: str


# -- reading --------------------------------------------------------------------------------
def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except PermissionError:
        raise ConceptError(f"cannot read {path}: permission denied; make it readable (chmod +r) or move it "
                           f"out of the data folder") from None
    except OSError as exc:
        raise ConceptError(f"cannot read {path}: {exc.strerror or exc}") from None


def _decode(data: bytes, path: Path, errors: str) -> str:
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8", errors)
    except UnicodeDecodeError as exc:
        offset = exc.start + skip
        line = data.count(b"\n", 0, offset) + 1
        raise ConceptError(f"{path} is not valid UTF-8: byte 0x{data[offset]:02x} at offset {offset} (line {line}); "
                           f"convert the file to UTF-8, or {ENCODING_HINT}") from None


def _jsonl(text: str, path: Path, name: str, text_field: str) -> list[tuple[int, Document]]:
    docs = []
    # split on "\n" only: str.splitlines() would also cut at U+2028 etc., legal inside JSON strings
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConceptError(f"{path} line {number}: invalid JSON ({exc.msg} at column {exc.colno}); "
                               f"a .jsonl file holds one JSON object per line") from None
        if not isinstance(record, dict):
            raise ConceptError(f"{path} line {number}: expected a JSON object with a {text_field!r} field, "
                               f"got a JSON {type(record).__name__}")
        if text_field not in record:
            fields = ", ".join(repr(k) for k in record) or "none"
            strings = [k for k, v in record.items() if isinstance(v, str)]
            hint = f"; pass --text-field {strings[0]}" if len(strings) == 1 else "; choose one with --text-field"
            raise ConceptError(f"{path} line {number} has no {text_field!r} field (fields: {fields}){hint}")
        value = record[text_field]
        if not isinstance(value, str):
            raise ConceptError(f"{path} line {number}: field {text_field!r} is a JSON "
                               f"{type(value).__name__}, expected a string")
        if value.strip():
            docs.append((number, Document(f"{name}:{number}", value)))
    return docs


def _read_file(path: Path, name: str, text_field: str, errors: str, explicit: bool) -> list[tuple[int, Document]]:
    """Documents of one file as (line, Document); [] for a skipped binary inside a folder."""
    data = _read_bytes(path)
    if b"\0" in data:
        if explicit:
            at = data.index(b"\0")
            raise ConceptError(f"{path} looks like a binary file (NUL byte at offset {at}); "
                               f"pass a text file, a .jsonl file, or a folder of them")
        return []
    text = _decode(data, path, errors)
    if path.suffix.lower() == ".jsonl":
        return _jsonl(text, path, name, text_field)
    return [(0, Document(name, text))] if text.strip() else []


# -- Hugging Face `datasets` input (imported lazily: only for such input) ---------------------------
def _import_datasets():
    try:
        import datasets
    except ImportError as exc:
        raise ConceptError(f"reading Hugging Face datasets folders, .parquet and .arrow files needs the `datasets` "
                           f"package ({exc}); install it: pip install {DATASETS_PIN}") from None
    return datasets


def _datasets_folder(path: Path) -> str | None:
    """"dataset" for a folder written by ``Dataset.save_to_disk``, "dict" for one written by
    ``DatasetDict.save_to_disk``, else None (checked by file names, without importing ``datasets``)."""
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "dataset"
    if (path / "dataset_dict.json").is_file():
        return "dict"
    return None


def _read_errors():
    import pyarrow

    return OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, pyarrow.ArrowException


def _table_rows(features, read_column, path: Path, name: str, text_field: str) -> list[tuple[int, Document]]:
    """Documents of one table (``features``: its ``datasets.Features``; ``read_column()``: the text
    column as a list) as (row, Document), rows named ``NAME#ROW``; the checks of ``_jsonl``."""
    import datasets

    def is_string(feature) -> bool:
        return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "string_view")

    strings = [c for c, f in features.items() if is_string(f)]
    if len(strings) == 1:
        hint = f"; pass --text-field {strings[0]}"
    elif strings:
        hint = f"; choose one with --text-field NAME (string columns: {', '.join(repr(c) for c in strings)})"
    else:
        hint = "; no column holds strings: pass --text-field NAME naming a column of text"
    if text_field not in features:
        columns = ", ".join(repr(c) for c in features) or "none"
        raise ConceptError(f"{path} has no {text_field!r} column (columns: {columns}){hint}")
    if not is_string(features[text_field]):
        raise ConceptError(f"{path}: column {text_field!r} holds {features[text_field]!r}, expected strings{hint}")
    try:
        values = read_column()
    except _read_errors() as exc:
        raise ConceptError(f"cannot read column {text_field!r} of {path}: {exc}") from None
    docs = []
    for row, value in enumerate(values):
        if value is None:
            raise ConceptError(f"{path} row {row}: column {text_field!r} is null (a missing value), expected a "
                               f"string; drop or fill the rows without text")
        if value.strip():
            docs.append((row, Document(f"{name}#{row}", value)))
    return docs


def _empty_dataset(path: Path) -> bool:
    """A ``Dataset.save_to_disk`` folder whose ``state.json`` lists no data files (a dataset of 0 rows)."""
    try:
        state = json.loads(_read_bytes(path / "state.json"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def _read_dataset_folder(path: Path, name: str, text_field: str, split: str | None = None) -> list[tuple[int, Document]]:
    """Documents of a ``save_to_disk`` folder: a Dataset (rows ``NAME#ROW``), or a DatasetDict's
    ``split`` (default "train"; rows ``NAME/SPLIT#ROW``, or ``SPLIT#ROW`` for an empty ``name``)."""
    if _datasets_folder(path) == "dict":
        index = path / "dataset_dict.json"
        try:
            splits = json.loads(_read_bytes(index)).get("splits")
        except (ValueError, AttributeError):
            splits = None
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise ConceptError(f"{index} is not a valid DatasetDict index (no list of \"splits\"); "
                               f"save the data again with DatasetDict.save_to_disk")
        listed = ", ".join(repr(s) for s in splits) or "none"
        if split is None and "train" not in splits:
            example = f", e.g. --data {path}:{splits[0]}" if splits else ""
            raise ConceptError(f"{path} is a Hugging Face DatasetDict without a 'train' split (splits: {listed}); "
                               f"choose one with --data {path}:SPLIT{example}")
        split = "train" if split is None else split
        if split not in splits:
            raise ConceptError(f"{path} has no split {split!r} (splits: {listed}); pass --data {path}:SPLIT "
                               f"with one of them")
        return _read_dataset_folder(path / split, f"{name}/{split}" if name else split, text_field)
    if split is not None:
        raise ConceptError(f"--data {path}:{split}: {path} is a single Hugging Face Dataset, not a DatasetDict "
                           f"with splits; pass --data {path}")
    if _empty_dataset(path):  # `datasets` itself fails on a folder with no data files (IndexError)
        raise ConceptError(f"the Hugging Face dataset {path} has no rows; add data to it, or point --data elsewhere")
    datasets = _import_datasets()
    try:
        ds = datasets.Dataset.load_from_disk(str(path))  # memory-mapped; writes nothing
    except _read_errors() as exc:
        raise ConceptError(one_line(f"cannot read the Hugging Face datasets folder {path} ({type(exc).__name__}: "
                                    f"{exc}); save it again with Dataset.save_to_disk, or point --data elsewhere")) from None
    return _table_rows(ds.features, lambda: ds.data.column(text_field).to_pylist(), path, name, text_field)


def _read_table_file(path: Path, name: str, text_field: str) -> list[tuple[int, Document]]:
    """Documents of a ``.parquet`` or ``.arrow`` file (Arrow IPC stream, as ``datasets`` writes, or
    IPC file / Feather v2), one per row, read in place."""
    datasets = _import_datasets()
    import pyarrow as pa

    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            features = datasets.Features.from_arrow_schema(pq.read_schema(path))
            return _table_rows(features, lambda: pq.read_table(path, columns=[text_field]).column(0).to_pylist(),
                               path, name, text_field)
        try:
            table = datasets.Dataset.from_file(str(path)).data  # memory-mapped stream format
        except pa.ArrowInvalid:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_file(source).read_all()
        features = datasets.Features.from_arrow_schema(table.schema)
    except _read_errors() as exc:
        raise ConceptError(f"cannot read {path} as a {path.suffix.lower()[1:]} table: {exc}") from None
    return _table_rows(features, lambda: table.column(text_field).to_pylist(), path, name, text_field)


def _walk(root: Path, stdlib: bool) -> list[Path]:
    def onerror(exc: OSError):
        reason = "permission denied" if isinstance(exc, PermissionError) else (exc.strerror or str(exc))
        raise ConceptError(f"cannot read folder {exc.filename}: {reason}; make it readable or point --data elsewhere")

    files = []  # and, outside the stdlib, `save_to_disk` folders (read whole, not walked into)
    for folder, dirs, names in os.walk(root, onerror=onerror):
        if not stdlib and Path(folder) != root and _datasets_folder(Path(folder)):
            files.append(Path(folder))
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".") and not (stdlib and d in STDLIB_EXCLUDED_DIRS)]
        for n in names:
            path = Path(folder, n)
            suffix = path.suffix.lower()
            if n.startswith(".") or (stdlib and suffix != ".py") or (suffix in BINARY_SUFFIXES and
                                                                     (stdlib or suffix not in TABLE_SUFFIXES)):
                continue
            if path.is_file():
                files.append(path)
    return files


# -- datasets that `datasets.load_dataset` loads (a hub id, or `hf:PATH` for a local dataset folder) --------
HUB_PREFIX = "hf:"
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
FILE_SUFFIXES = {".txt", ".jsonl", ".json", ".md", ".rst", ".py", ".csv", ".parquet", ".arrow"}


def hub_name(source) -> str | None:
    """The name ``datasets.load_dataset`` is given for ``source``: ``hf:NAME`` (any name, a local dataset
    folder included), or a bare ``NAME`` / ``ORG/NAME`` that is no existing path, built-in corpus or
    file name; None otherwise (a local path, read as always)."""
    if not isinstance(source, str):
        return None
    if source.startswith(HUB_PREFIX) and source[len(HUB_PREFIX):].strip():
        return source[len(HUB_PREFIX):]
    if (source in CORPORA or os.path.lexists(source) or not HUB_NAME.fullmatch(source)
            or Path(source).suffix.lower() in FILE_SUFFIXES):
        return None
    return source


def _load_hub(name: str, data_split: str | None, streaming: bool):
    """``datasets.load_dataset(name, split=...)``: one error line when it cannot."""
    datasets = _import_datasets()
    split = data_split or "train"
    try:
        return datasets.load_dataset(name, split=split, streaming=streaming)
    except Exception as exc:  # datasets raises many kinds (offline, not found, bad split, bad files)
        local = Path(name).expanduser()
        what = "" if local.exists() else f"no file or folder {name} exists (does not exist), and "
        raise ConceptError(one_line(
            f"--data {name}: {what}`datasets.load_dataset({name!r}, split={split!r})` cannot load it "
            f"({type(exc).__name__}: {exc}); pass an existing path, a dataset id the `datasets` library can load "
            f"(a cached hub dataset offline), or another --data-split")) from None


def hub_identity(source, text_field: str, data_split: str | None, streaming: bool) -> dict:
    """What identifies a ``load_dataset`` source's content for the token-shard cache (see concept.shards)."""
    name = hub_name(source)
    ident = {"hub": name, "split": data_split or "train", "text_field": text_field, "streaming": streaming}
    local = Path(name).expanduser()
    if local.exists():
        ident["path"], ident["listing"] = str(local.resolve()), listing(local)
    if not streaming:
        ident["fingerprint"] = getattr(_load_hub(name, data_split, False), "_fingerprint", None)
    return ident


def hub_documents(source, text_field: str = "text", data_split: str | None = None, streaming: bool = False):
    """The rows of a ``load_dataset`` source as Documents named ``SPLIT#ROW`` (as a DatasetDict folder's
    rows), in row order, one at a time (a streamed dataset is never held whole)."""
    name = hub_name(source)
    split = data_split or "train"
    ds = _load_hub(name, data_split, streaming)
    features = getattr(ds, "features", None)
    if features is not None and text_field not in features:
        columns = ", ".join(repr(c) for c in features) or "none"
        raise ConceptError(f"--data {name} (split {split!r}) has no {text_field!r} column (columns: {columns}); "
                           f"choose one with --text-field NAME")
    empty = True
    for row, record in enumerate(ds):
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            if text_field not in record:
                raise ConceptError(f"--data {name} row {row} has no {text_field!r} column; choose one with "
                                   f"--text-field NAME")
            raise ConceptError(f"--data {name} row {row}: column {text_field!r} is {type(value).__name__}, "
                               f"expected a string; drop or fill the rows without text")
        if value.strip():
            empty = False
            yield Document(f"{split}#{row}", value)
    if empty:
        raise ConceptError(f"--data {name} (split {split!r}) holds no documents (no rows, or every row's "
                           f"{text_field!r} is empty); point --data elsewhere")


def stdlib_root() -> Path:
    return Path(warnings.__file__).parent


def builtin_corpus(source) -> str | None:
    """The built-in corpus ``source`` names ("stdlib" or "pydoc"), or None for a path.
    None means the default corpus. A new name (not "stdlib") that is also an existing path is
    refused as ambiguous."""
    if source is None:
        return DEFAULT_CORPUS
    if not isinstance(source, str) or source not in CORPORA:
        return None
    if source != DEFAULT_CORPUS and os.path.lexists(source):
        raise ConceptError(f"--data {source} is ambiguous: it names the built-in {CORPORA[source]!r} corpus and a "
                           f"path in the current folder; pass ./{source} for the path or "
                           f"{CORPORA[source]} for the corpus")
    return CORPORA[source]


def local_path(source) -> Path | None:
    """The file or folder ``source`` reads (``PATH:SPLIT``: its ``PATH``), or None for a built-in corpus
    or a path that does not exist."""
    if builtin_corpus(source) is not None or not str(source).strip():  # ("": no path, not the working folder)
        return None
    path = Path(source).expanduser()
    if path.exists():
        return path
    base, colon, split = str(source).rpartition(":")
    if colon and base and split and "/" not in split and Path(base).expanduser().exists():
        return Path(base).expanduser()
    return None


def stored_source(source) -> str | None:
    """``source`` as a run records it: a path made absolute (so ``--resume`` works from any folder),
    a built-in corpus name or anything else unchanged."""
    path = local_path(source)
    name = hub_name(source)
    if path is None and name is not None and isinstance(source, str) and source.startswith(HUB_PREFIX):
        local = Path(name).expanduser()  # hf:PATH of a local dataset folder: absolute, as a path
        return f"{HUB_PREFIX}{local.resolve()}" if local.exists() else source
    if path is None:
        return source
    absolute = str(path.resolve())
    return absolute if Path(source).expanduser().exists() else f"{absolute}:{str(source).rpartition(':')[2]}"


def _pydoc_documents() -> list[Document]:
    """The `pydoc` corpus: one document per topic of ``pydoc_data.topics`` (English prose)."""
    import importlib

    try:
        topics = importlib.import_module("pydoc_data.topics").topics
    except (ImportError, AttributeError) as exc:
        raise ConceptError(f"the built-in prose corpus needs the standard library's pydoc_data.topics, which this "
                           f"Python lacks ({exc}); pass a folder of text files to --data instead") from None
    docs = [Document(f"pydoc_data/topics:{name}", text) for name, text in topics.items()
            if isinstance(text, str) and text.strip()]
    return sorted(docs, key=lambda d: d.name)


def read_documents(source: str | os.PathLike | None = None, split: str = "all", text_field: str = "text",
                   heldout_fraction: float = 0.05, encoding_errors: str = "strict",
                   data_split: str | None = None) -> list[Document]:
    """Documents of ``source`` (None or "stdlib"/"code": the Python standard library's sources;
    "pydoc"/"prose": its English help topics; a text, .jsonl, .parquet or .arrow file; a folder of
    them; or a ``datasets`` ``save_to_disk`` folder, ``PATH:SPLIT`` for a DatasetDict's split other
    than "train"; or a dataset ``datasets.load_dataset`` loads, see :func:`hub_name`, its ``data_split``),
    restricted to ``split`` ("train", "heldout" or "all"), sorted."""
    _check_read_options(source, split, heldout_fraction, encoding_errors)
    corpus = builtin_corpus(source)
    stdlib = corpus == DEFAULT_CORPUS
    root = stdlib_root() if stdlib else None if corpus else Path(source).expanduser()
    label = {"stdlib": "the Python standard library", "pydoc": "the pydoc corpus"}.get(corpus, str(source))
    if corpus == PROSE_CORPUS:
        docs = _pydoc_documents()
        if not docs:
            raise ConceptError("the standard library's pydoc_data.topics is empty; pass a folder of text files to --data")
        return _split(docs, split, heldout_fraction, label)
    dataset_split = None  # PATH:SPLIT picks a split of a DatasetDict folder
    if corpus is None and not root.exists():
        base, colon, chosen = str(source).rpartition(":")
        if colon and base and chosen and "/" not in chosen and _datasets_folder(Path(base).expanduser()):
            root, dataset_split, label = Path(base).expanduser(), chosen, str(source)
    if not root.exists() and hub_name(source) is not None:
        return _split(list(hub_documents(source, text_field, data_split)), split, heldout_fraction, label)
    if not root.exists():
        raise ConceptError(f"data path {root} does not exist; pass an existing text file, .jsonl file or folder "
                           f"to --data, or leave it out to use the default corpus (the Python standard library)")
    kind = None if stdlib or not root.is_dir() else _datasets_folder(root)
    if kind or dataset_split is not None:  # a `save_to_disk` folder: read through `datasets`
        keyed = _keyed_dataset_folder(root, kind, text_field, dataset_split, label)
    elif root.is_dir():
        keyed = _keyed_folder(root, stdlib, text_field, encoding_errors, label)
    elif root.is_file():
        keyed = _keyed_file(root, text_field, encoding_errors)
    else:
        raise ConceptError(f"data path {root} is neither a regular file nor a folder")
    keyed.sort(key=lambda kd: kd[0])
    return _split([d for _, d in keyed], split, heldout_fraction, label)


def _check_read_options(source, split: str, heldout_fraction: float, encoding_errors: str) -> None:
    """Refuse an unknown split, a held-out fraction outside [0, 1), an unknown error handler, an empty path."""
    if split not in SPLITS:
        raise ConceptError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ConceptError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    try:
        codecs.lookup_error(encoding_errors)
    except LookupError:
        raise ConceptError(f"unknown encoding error handler {encoding_errors!r}; use 'strict' or 'replace'") from None
    if isinstance(source, (str, os.PathLike)) and not str(source).strip():  # ("" would read the working folder)
        raise ConceptError(f"--data {str(source)!r} is an empty path; pass a text file, .jsonl file or folder, or "
                           f"leave --data out to use the default corpus (the Python standard library)")


def _keyed_dataset_folder(root: Path, kind, text_field: str, dataset_split, label: str) -> list:
    """(sort key, Document) of a ``save_to_disk`` folder, read through ``datasets``: a Dataset's rows are
    named after the folder (like a single file), a DatasetDict's after the split."""
    keyed = [((root.name, row), doc) for row, doc in
             _read_dataset_folder(root, root.name if kind == "dataset" else "", text_field, dataset_split)]
    if not keyed:
        raise ConceptError(f"{label} holds no documents (no rows, or every row's {text_field!r} is empty); "
                           f"add text or point --data elsewhere")
    return keyed


def _keyed_folder(root: Path, stdlib: bool, text_field: str, encoding_errors: str, label: str) -> list:
    """(sort key, Document) of every file (and ``save_to_disk`` folder) in the folder ``root``."""
    keyed = []
    files = _walk(root, stdlib)
    for path in files:
        rel = path.relative_to(root).as_posix()
        if path.is_dir():  # a `save_to_disk` folder inside the folder
            found = _read_dataset_folder(path, rel, text_field)
        elif not stdlib and path.suffix.lower() in TABLE_SUFFIXES:
            found = _read_table_file(path, rel, text_field)
        else:
            found = _read_file(path, rel, text_field, encoding_errors, False)
        keyed += [((rel, line), doc) for line, doc in found]
    if not keyed:
        what = "no files" if not files else f"{len(files)} file(s), all empty or binary"
        raise ConceptError(f"{label} holds no readable documents ({what}; hidden entries and binary files are "
                           f"skipped); point --data at text or .jsonl files")
    return keyed


def _keyed_file(root: Path, text_field: str, encoding_errors: str) -> list:
    """(sort key, Document) of the one file ``root`` (text, .jsonl or a table)."""
    table = root.suffix.lower() in TABLE_SUFFIXES
    found = (_read_table_file(root, root.name, text_field) if table
             else _read_file(root, root.name, text_field, encoding_errors, True))
    keyed = [((root.name, line), doc) for line, doc in found]
    if not keyed:
        detail = ("every line is blank or has an empty text" if root.suffix.lower() == ".jsonl" else
                  f"no rows, or every row's {text_field!r} is empty" if table else
                  "it is empty" if not root.stat().st_size else "it holds only whitespace")
        raise ConceptError(f"{root} holds no documents ({detail}); add text or point --data elsewhere")
    return keyed


def _split(docs: list[Document], split: str, heldout_fraction: float, label: str) -> list[Document]:
    if split == "all":
        return docs

    held = [_is_heldout(d.name, heldout_fraction) for d in docs]
    if all(held):  # tiny corpora: never leave training empty; then nothing is held out
        held = [False] * len(docs)
    chosen = [d for d, h in zip(docs, held) if h == (split == "heldout")]
    if not chosen:  # only the held-out split can be empty
        raise ConceptError(
            f"the held-out split of {label} is empty: none of its {len(docs)} document(s) falls in the held-out "
            f"{heldout_fraction:.0%} (chosen by a hash of each document's name); pass a separate --data for "
            f"evaluation, or use more, smaller documents (e.g. a .jsonl file with one document per line)")
    return chosen


# -- token shards -----------------------------------------------------------------------------
def source_identity(source, text_field: str, encoding_errors: str, data_split: str | None, streaming: bool) -> dict:
    """What identifies ``source``'s documents for the token-shard cache without reading them (concept.shards)."""
    corpus = builtin_corpus(source)
    if corpus is not None:
        return {"builtin": corpus, **python_identity()}
    path = local_path(source)
    if path is not None:
        return {"path": str(path.resolve()), "source": str(source), "listing": listing(path.resolve()),
                "text_field": text_field, "encoding_errors": encoding_errors}
    if hub_name(source) is not None:
        return hub_identity(source, text_field, data_split, streaming)
    read_documents(source)  # the error naming what is wrong with ``source``
    raise ConceptError(f"--data {source!r}: not a readable source")  # (not reached)


def open_tokens(source, split: str, tokenizer, *, text_field: str = "text", encoding_errors: str = "strict",
                heldout_fraction: float = 0.05, data_split: str | None = None, streaming: bool = False,
                cache_dir=None):
    """``split`` of ``source`` (as :func:`read_documents` reads it) as a :class:`concept.shards.TokenSplit`:
    tokenised once into a memory-mapped shard in the cache, then read from it without reading the source."""
    if split not in SPLITS:
        raise ConceptError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if isinstance(source, (str, os.PathLike)) and not str(source).strip():
        read_documents(source)  # the empty-path error
    if (data_split is not None or streaming) and (hub_name(source) is None or local_path(source) is not None):
        flag = "--streaming" if streaming else f"--data-split {data_split}"
        raise ConceptError(f"{flag} is for a --data dataset id that `datasets.load_dataset` loads (hf:NAME), not "
                           f"--data {source or DEFAULT_CORPUS}; for a DatasetDict folder's split pass --data PATH:SPLIT")
    label = {"stdlib": "the Python standard library", "pydoc": "the pydoc corpus"}.get(builtin_corpus(source),
                                                                                      str(source))
    ident = source_identity(source, text_field, encoding_errors, data_split, streaming)
    if hub_name(source) is not None and local_path(source) is None:
        documents = lambda: hub_documents(source, text_field, data_split, streaming)  # noqa: E731 (streamed)
    else:
        documents = lambda: read_documents(source, "all", text_field, heldout_fraction, encoding_errors,  # noqa: E731
                                           data_split)
    found = shards.open_shard(ident, documents, tokenizer, heldout_fraction, label, cache_dir)
    return shards.split_view(*found[:5], split, label, found[5], heldout_fraction)


# -- packing ---------------------------------------------------------------------------------
class PackedSequences:
    """Documents packed back to back into rows of ``seq_len`` tokens (see the module docstring)."""

    def __init__(self, documents: list[Document] | TokenSplit, tokenizer, seq_len: int, seed: int = 0, cache_dir=None):
        """``documents``: Documents (tokenised here, in memory), or a :class:`concept.shards.TokenSplit` (read from
        its memory map; ``tokenizer`` unused: its tokens and eos are stored)."""
        if isinstance(documents, TokenSplit):
            self._pack(documents.ids, documents.starts, documents.lengths, np.zeros_like(documents.lengths), None,
                       seq_len, seed)
            self.cache_path, self.cache_hit = documents.path, documents.cache_hit
            return
        if not documents:
            raise ConceptError("no documents to pack; check --data and --split")
        tokens = tokenize_documents(documents, tokenizer, cache_dir)
        lengths = tokens.lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        eos = getattr(tokenizer, "eos_token_id", None)
        add = np.zeros_like(lengths)
        if eos is not None:  # append eos, unless the tokenizer already ended the document with it
            ends_with_eos = np.zeros(len(lengths), dtype=bool)
            nonempty = lengths > 0
            ends_with_eos[nonempty] = np.asarray(tokens.ids)[starts[nonempty] + lengths[nonempty] - 1] == eos
            add = (~ends_with_eos).astype(np.int64)
        self._pack(tokens.ids, starts, lengths, add, eos, seq_len, seed)
        self.cache_path, self.cache_hit = tokens.cache_path, tokens.cache_hit

    def _pack(self, ids, starts, lengths, add, eos, seq_len, seed) -> None:
        """Documents ``ids[starts[i]:starts[i] + lengths[i]]`` (plus ``eos`` where ``add[i]``) in a seeded
        order, as a virtual stream: a row is gathered from ``ids`` when asked for (the stream is never copied)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ConceptError(f"seq_len must be a positive integer, got {seq_len!r}")
        if not len(lengths):
            raise ConceptError("no documents to pack; check --data and --split")
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.num_documents = len(lengths)
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(self.seed % 2 ** 64)).numpy()
        order = order[(lengths + add)[order] > 0]
        self.order = order  # document indices, in packing order
        span = (lengths + add)[order]
        total = int(span.sum())
        self._num_tokens = total
        if total < self.seq_len:
            raise ConceptError(f"data has {total} tokens, fewer than one sequence of seq_len={self.seq_len}; "
                               f"lower --seq-len or add data")
        self._rows = total // self.seq_len
        self._ids, self._eos = (ids if len(ids) else np.zeros(1, np.int32)), eos
        self._doc_ends = np.cumsum(span)  # end of each packed document in the stream
        self._doc_starts = self._doc_ends - span  # its start in the stream
        self._src_starts = np.asarray(starts, dtype=np.int64)[order]  # its start in ``ids``
        self._src_lengths = np.asarray(lengths, dtype=np.int64)[order]  # its stored tokens (eos slot excluded)
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self._rows

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed stream (eos included), before the incomplete last row is dropped."""
        return self._num_tokens

    @property
    def tokens_per_epoch(self) -> int:
        return self._rows * self.seq_len

    def permutation(self, epoch: int) -> np.ndarray:
        """The order rows are visited in during ``epoch``."""
        if epoch not in self._perms:
            g = torch.Generator().manual_seed((self.seed * 1000003 + epoch) % 2 ** 64)
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            with host_values("data order"):  # (a host generator's permutation: no device involved)
                self._perms[epoch] = torch.randperm(self._rows, generator=g).numpy()
        return self._perms[epoch]

    def rows(self, indices) -> dict[str, torch.Tensor]:
        """Rows by their index in packing order (not shuffled), as a batch."""
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self._rows):
            raise IndexError(f"row index out of range 0..{self._rows - 1}")
        where = rows[:, None] * self.seq_len + np.arange(self.seq_len)
        doc = np.searchsorted(self._doc_ends, where, side="right")
        offset = where - self._doc_starts[doc]
        stored = offset < self._src_lengths[doc]  # else the appended eos slot
        source = np.where(stored, self._src_starts[doc] + offset, 0)
        tokens = np.asarray(self._ids[source.reshape(-1)], dtype=np.int64).reshape(source.shape)  # reads these only
        if self._eos is not None:
            tokens = np.where(stored, tokens, self._eos)
        ids = torch.from_numpy(tokens)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "document_ids": torch.from_numpy(doc - doc[:, :1])}

    def batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Rows [step * batch_size, (step + 1) * batch_size) of the epoch-by-epoch stream."""
        if batch_size < 1:
            raise ConceptError(f"batch size must be at least 1, got {batch_size}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        k = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
        epochs, within = np.divmod(k, self._rows)
        rows = np.empty_like(k)
        for e in np.unique(epochs):
            sel = epochs == e
            rows[sel] = self.permutation(int(e))[within[sel]]
        return self.rows(rows)

    def epoch_of(self, step: int, batch_size: int) -> float:
        """Epochs completed before ``step`` (fractional)."""
        return step * batch_size / self._rows

    def __repr__(self) -> str:
        return (f"PackedSequences(documents={self.num_documents}, tokens={self.num_tokens}, rows={len(self)}, "
                f"seq_len={self.seq_len}, seed={self.seed})")


# -- a training run's data -----------------------------------------------------------------------
@dataclass
class TrainingData:
    """What a training run reads: its training rows, the held-out rows of the periodic evaluation (None when
    there are none: ``no_heldout`` says why) and the fingerprint of their documents (a checkpoint records it)."""

    train: PackedSequences
    heldout: PackedSequences | None
    fingerprint: str
    no_heldout: str | None = None


def open_training(config, tokenizer) -> TrainingData:
    """The training rows and the held-out ones of a training config (``concept.train_config.TrainConfig``), read
    from token shards (tokenised once, memory-mapped). ``eval_data`` replaces the held-out split of the training
    data for the periodic evaluation (all of it; a built-in corpus: its held-out split). Data too small for a
    held-out split trains anyway (evaluate later with ``concept eval --data``)."""
    read = dict(text_field=config.text_field, encoding_errors=config.encoding_errors,
                data_split=config.data_split, streaming=config.streaming)
    tokens = open_tokens(config.data, "train", tokenizer, **read)
    # (the documents of the train and held-out splits)
    fingerprint = of_digests(tokens.digest, *filter(None, [tokens.heldout_digest]))
    train = PackedSequences(tokens, None, config.seq_len, seed=config.seed)
    try:
        if config.eval_data is not None:
            split = "heldout" if builtin_corpus(config.eval_data) else "all"
            heldout = open_tokens(config.eval_data, split, tokenizer, text_field=config.text_field,
                                  encoding_errors=config.encoding_errors)
        else:
            heldout = open_tokens(config.data, "heldout", tokenizer, **read)
        return TrainingData(train, PackedSequences(heldout, None, config.seq_len, seed=config.seed), fingerprint)
    except ConceptError as exc:
        return TrainingData(train, None, fingerprint, str(exc))
