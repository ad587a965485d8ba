"""`quality`'s training text: the Python sources of the packages installed on the GPU machine.

At 1e8 tokens per model the standard library (about 3.1e6 SmolLM2 tokens) would repeat 30 times. The GPU
image's installed packages (torch, transformers, jax, scipy, ...) hold several hundred MB of Python source,
1e8 tokens and more, and nothing has to travel for them. ``concept train --data`` reads a folder of files,
so the corpus is a folder of links, one per source file, named as in ``site-packages``:

* **which files**: every ``.py`` under the image's ``site-packages`` (its ``purelib``), with the standard
  library's exclusions (tests, ``__pycache__``, hidden folders) and without files that are not UTF-8 text;
  never this project, the kit's own wheels or the standard library itself (held-out code is the standard
  library's: ``--eval-data stdlib``);
* **as many as the plan needs**: the files in a fixed order (sha256 of ``SEED:name``: independent of the
  seed of training and of how the disk lists them), the shortest prefix whose size covers the tokens the
  plan asks for, held-out share and a margin included; the whole corpus at most;
* **hold-out unchanged**: a file is held out by ``concept.data``'s rule on its name (the same name as in
  ``site-packages``), so the training run's own held-out split is part of the same rule's split of the
  whole corpus, never trained on;
* **tokenised once** (:func:`tokenize`): the corpus is tokenised with the model's tokenizer into
  ``concept``'s token shard (``concept.shards``: memory-mapped, under ``$CONCEPT_CACHE/shards``), which
  every training run of the plan then reads without tokenising or loading the corpus; the count of its
  rows caps the plan, so that **no training token is seen twice** (the plan's steps x batch <= the rows
  of one epoch).

The dry run's stand-in: this project's own ``concept/`` sources, with the byte tokenizer.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import time
from pathlib import Path

from .common import ROOT, KitError, Stage, read_json, write_json

SEED = "concept-gpu-kit-corpus-1"
CHARS_PER_TOKEN = 3.0  # a low guess (SmolLM2's tokenizer on torch's sources: 3.4): selects a little more text
MARGIN = 1.15  # more text than the guess says the plan needs
DRY_TOKENS = 100_000  # the dry run's corpus: about half of concept/'s sources (held-out files among them)


def source_root(dry: bool) -> Path:
    """The image's ``site-packages`` (the dry run: this project's ``concept/``)."""
    return ROOT / "concept" if dry else Path(sysconfig.get_paths()["purelib"])


def python_files(root: Path) -> dict[str, int]:
    """``{relative path: bytes}`` of every ``.py`` file under ``root`` (links not followed), with the standard
    library corpus's exclusions."""
    from concept.data import STDLIB_EXCLUDED_DIRS

    skip = STDLIB_EXCLUDED_DIRS - {"site-packages", "dist-packages"}
    kit = {(ROOT / ".gpukit").resolve(), ROOT.resolve()}
    files = {}
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip and (here / d).resolve() not in kit
                         and not (here / d).is_symlink())
        for name in names:
            path = here / name
            if name.endswith(".py") and not name.startswith(".") and not path.is_symlink():
                try:
                    files[path.relative_to(root).as_posix()] = path.stat().st_size
                except OSError:
                    continue
    return files


def order(names) -> list[str]:
    """``names`` in the corpus's fixed order."""
    return sorted(names, key=lambda n: hashlib.sha256(f"{SEED}:{n}".encode("utf-8", "surrogateescape")).digest())


def select(files: dict[str, int], chars: float, usable=lambda name: True) -> list[str]:
    """The shortest prefix of the fixed order whose size reaches ``chars`` (the whole corpus at most), without
    the files that are not ``usable``."""
    chosen, size = [], 0
    for name in order(files):
        if size >= chars:
            break
        if usable(name):
            chosen.append(name)
            size += files[name]
    return chosen


def utf8_text(path: Path) -> bool:
    """Whether ``path`` is text `concept train` reads without an error: UTF-8, no NUL byte (a site-packages
    holds a few Latin-1 sources, which would stop a run that reads them strictly)."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return b"\0" not in data


def manifest_path(folder: Path) -> Path:
    """What was selected, beside the folder (inside, it would be read as a document)."""
    return folder.with_name(folder.name + ".json")


def heldout_fraction() -> float:
    """The share of documents `concept train` holds out (``read_documents``' default)."""
    import inspect

    from concept.data import read_documents

    return inspect.signature(read_documents).parameters["heldout_fraction"].default


def prepare(stage: Stage, folder: Path, tokens: float, root: Path | None = None) -> dict:
    """The corpus folder for a plan of ``tokens`` training tokens per model: links to the selected files
    (a folder made earlier on this machine for at least as many tokens is kept). Returns its manifest."""
    root = root or source_root(stage.dry)
    if stage.dry:
        tokens = max(tokens, DRY_TOKENS)
    manifest = read_json(manifest_path(folder))
    if manifest and manifest["root"] == str(root) and manifest["wanted_tokens"] >= tokens:
        return manifest
    start = time.monotonic()
    files = python_files(root)
    if not files:
        raise KitError(f"no Python sources under {root}: the training corpus is empty; pass the data by hand "
                       f"(--data) or check the image")
    chars = tokens / (1 - heldout_fraction()) * CHARS_PER_TOKEN * MARGIN
    chosen = select(files, chars, lambda name: utf8_text(root / name))
    if folder.exists():
        shutil.rmtree(folder)
    for name in chosen:
        link = folder / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(root / name)
    manifest = {"root": str(root), "seed": SEED, "wanted_tokens": tokens, "files": len(chosen),
                "bytes": sum(files[n] for n in chosen), "corpus_files": len(files),
                "corpus_bytes": sum(files.values()), "whole": len(chosen) == len(files),
                "select_s": round(time.monotonic() - start, 1)}
    write_json(manifest_path(folder), manifest)
    stage.say(f"corpus: {manifest['files']:,} of {manifest['corpus_files']:,} source files of {root} "
              f"({manifest['bytes'] / 1e6:.1f} of {manifest['corpus_bytes'] / 1e6:.1f} MB)")
    return manifest


def tokenize(stage: Stage, folder: Path, model, seq_len: int, seed: int) -> dict:
    """The training and held-out splits of the corpus folder tokenised as `concept train` tokenises them
    (into the token cache it then reads): rows of ``seq_len`` tokens in one epoch of the training split,
    tokens, documents of each split."""
    from concept import data
    from concept.errors import ConceptError

    start = time.monotonic()
    tokenizer = data.tokenizer_for(model)
    out = {}
    for split in ("train", "heldout"):
        try:
            tokens = data.open_tokens(str(folder), split, tokenizer)  # the token shard the training runs read
            packed = data.PackedSequences(tokens, None, seq_len, seed=seed)
        except ConceptError as exc:  # a held-out split too small (the training run then says so too)
            if split == "train":
                raise KitError(f"the training corpus {folder}: {exc}") from None
            out[split] = {"documents": 0, "tokens": 0, "rows": 0, "note": str(exc)}
            continue
        out[split] = {"documents": tokens.num_documents, "tokens": packed.num_tokens, "rows": len(packed),
                      "cached": packed.cache_path is not None}
    out["tokenize_s"] = round(time.monotonic() - start, 1)
    stage.say(f"corpus tokenised: {out['train']['tokens']:,} training tokens ({out['train']['rows']:,} rows of "
              f"{seq_len}), {out['heldout']['documents']} held-out documents, {out['tokenize_s']} s")
    return out
