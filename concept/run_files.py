"""One validating reader for the files of a run folder.

Every command that reads a run (``eval``, ``export``, ``inspect``, ``generate``, ``train SRC -o``, a
``frontier`` re-run, ``concept.load``) reads its files through here:

- ``concept.json`` and ``train.json`` are parsed and checked against their dataclasses (``BuildConfig``,
  ``TrainConfig``): an object where one is expected, the keys every version wrote, each value's type, a
  section of the wrong type;
- weights (``modules.safetensors``, ``backbone.safetensors``, ``adapter.safetensors``, the checkpoint's and an
  export's copies) are opened header first (an empty, truncated or garbled file), then their keys, shapes and
  dtypes are compared with the model they are loaded into (:func:`load_weights`);
- ``metrics.jsonl`` rows, ``checkpoint/state.json`` and the JSON files of exports and frontier folders are
  parsed and checked for the keys their readers use.

:func:`check_files` validates every such file of a folder before anything is loaded or written. A problem
is one line: the file, what is wrong, what to do (:class:`RunFileError`, exit 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from . import checkpoint
from .config import BuildConfig, resolve
from .errors import ConceptError, ConfigError, RunFolderError, UnknownComponentError, one_line
from .families import of_run
from .migrate import RecordFormatError, migrate_run, migrate_train, source_modules
from .options import check
from .train_config import LoraSettings, composed, for_family

RUN_FILE = "concept.json"
TRAIN_FILE = "train.json"
MODULES_FILE = "modules.safetensors"
BACKBONE_FILE = "backbone.safetensors"
ADAPTER_FILE = "adapter.safetensors"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.json"
# train.json keys every version of concept wrote (newer fields default when an older file lacks them)
TRAIN_REQUIRED = ("steps", "seq_len", "batch", "lr", "lora", "seed")
# train.json keys that record what a run resolved to, beside the TrainConfig fields
TRAIN_DERIVED_TYPES = {"source": str, "attention_resolved": str, "compile_resolved": str, "pruned": dict,
                       "distributed": dict, "versions": dict, "git_sha": str}
TRAIN_DERIVED = tuple(TRAIN_DERIVED_TYPES)


class RunFileError(RunFolderError):
    """A file of a run folder that is missing a part, damaged, or belongs to another model."""


_COPIES: dict[str, str] = {}  # a folder of copies -> the folder its files were copied from (for messages)


@contextlib.contextmanager
def copied_from(copy: Path, original: Path):
    """While this block reads the files of ``copy`` (e.g. a new run's staging folder, filled from its source
    run), errors name them in ``original``, the folder the user knows."""
    _COPIES[str(copy)] = str(original)
    try:
        yield
    finally:
        _COPIES.pop(str(copy), None)


def damaged(file: Path, problem: str, fix: str) -> RunFileError:
    """The one-line error for ``file``: what is wrong (``problem``), then what to do (``fix``)."""
    text = f"{file}: {problem}; {fix}"
    for copy, original in _COPIES.items():
        text = text.replace(copy, original)
    return RunFileError(one_line(text))


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


# -- plain files ------------------------------------------------------------------------------
def read_bytes(file: Path, fix: str) -> bytes:
    try:
        return Path(file).read_bytes()
    except IsADirectoryError:
        raise damaged(file, "is a folder, not a file", fix) from None
    except OSError as exc:
        raise damaged(file, f"cannot be read ({exc.strerror or exc})", fix) from None


def read_text(file: Path, fix: str) -> str:
    data = read_bytes(file, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise damaged(file, f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})", fix) from None


def read_json(file: Path, fix: str, expect: type | None = dict) -> Any:
    """The JSON value of ``file`` (an object unless ``expect`` says otherwise)."""
    text = read_text(file, fix)
    if not text.strip():
        raise damaged(file, f"is empty ({len(text.encode())} bytes)", fix)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise damaged(file, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", fix) from None
    except RecursionError:
        raise damaged(file, "is not valid JSON (nested too deeply)", fix) from None
    if expect is not None and not isinstance(value, expect):
        raise damaged(file, f"holds {_kind(value)} where {_kind(expect())} is expected", fix)
    return value


# -- concept.json -----------------------------------------------------------------------------
def run_fix(folder: Path) -> str:
    return (f"restore it from a copy (a trained run's is its source build's), or rebuild the model with "
            f"`concept build -o {folder} --force`")


def _hf_params(config: dict) -> dict | None:
    """The params of an ``hf`` backbone in a build config dict (they hold its ``path``), else None."""
    backbone = config.get("backbone") if isinstance(config, dict) else None
    params = backbone.get("params") if isinstance(backbone, dict) and backbone.get("name") == "hf" else None
    return params if isinstance(params, dict) and isinstance(params.get("path"), str) and params["path"] else None


def _relative(path: str) -> bool:
    return not path.startswith("~") and not Path(path).is_absolute()


def localise_backbone_path(config: dict, folder: Path) -> dict:
    """A relative local path of an ``hf`` backbone that exists inside the run folder (``concept export``
    writes ``./backbone``) is made absolute, so the folder loads wherever it is moved and whatever the
    working directory; any other relative path keeps meaning the working directory. Edits ``config``."""
    params = _hf_params(config)
    if params and _relative(params["path"]) and (Path(folder) / params["path"] / "config.json").is_file():
        params["path"] = str((Path(folder) / params["path"]).resolve())
    return config


def backbone_folder(config: dict) -> Path | None:
    """The local folder an ``hf`` backbone loads from (absolute; relative paths mean the working
    directory), or None (another backbone, or a hub id)."""
    params = _hf_params(config)
    if params is None:
        return None
    path = params["path"]
    folder = Path(path).expanduser()
    return folder.resolve() if folder.exists() or path.startswith((".", "/", "~")) else None


def absolute_backbone_path(config: dict) -> dict:
    """A relative local path of an ``hf`` backbone (one that exists from the working directory) made
    absolute, so that the run it is saved in loads from any directory. Edits ``config``."""
    params = _hf_params(config)
    if params and _relative(params["path"]) and Path(params["path"]).exists():
        params["path"] = str(Path(params["path"]).resolve())
    return config


def read_run(path: str | os.PathLike) -> dict:
    """The record of a run folder (``concept.json``), checked: its config is a valid ``BuildConfig`` (not yet
    resolved against the installed plugins: :func:`plan_of`), and its other sections have their types. A
    relative local backbone path inside the folder is made absolute (:func:`localise_backbone_path`)."""
    folder = Path(path)
    file = folder / RUN_FILE
    if not file.exists() and not file.is_symlink():
        raise RunFolderError(f"{folder} is not a concept run folder (no {RUN_FILE}); create one with "
                             f"`concept build -o {folder}`")
    fix = run_fix(folder)
    try:  # an older format's record in today's (concept.migrate; an older baseline's reads its train.json)
        record = migrate_run(read_json(file, fix), unchecked_train(folder))
    except RecordFormatError as exc:
        raise damaged(file, exc.problem, exc.fix or fix) from None
    if "config" not in record:
        raise damaged(file, "has no 'config' (how the model was built)", fix)
    config = record["config"]
    if not isinstance(config, dict):
        raise damaged(file, f"'config' is {_kind(config)}, not an object", fix)
    for key, expected in (("plan", dict), ("calibration", dict), ("export", dict)):
        if record.get(key) is not None and not isinstance(record[key], expected):
            raise damaged(file, f"'{key}' is {_kind(record[key])}, not {_kind(expected())}", fix)
    problems = config_problems(config)
    if problems:
        raise damaged(file, f"its config is invalid ({'; '.join(problems)})", fix)
    localise_backbone_path(config, folder)
    return record


def unchecked_train(folder: Path) -> dict | None:
    """The run's train.json as it reads, or None (absent or unreadable: :func:`read_train` says why)."""
    try:
        return json.loads((folder / TRAIN_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None


def config_problems(config: dict) -> list[str]:
    """What is wrong with a build config dict, structurally (each slot an object with a name and params,
    each family section an object, the plain options of their types)."""
    try:
        built = BuildConfig.from_dict(config)
    except ConfigError as exc:
        return exc.problems
    except (TypeError, ValueError, AttributeError) as exc:
        return [str(exc)]
    section = built.section
    return check(built) + (check(section) if section is not None and dataclasses.is_dataclass(section) else [])


def plan_of(record: dict, folder: Path):
    """The resolved build plan of a run's record (``concept.config.resolve``); a config this installation
    cannot build is one line naming the file (a problem with the record: exit 1)."""
    file = Path(folder) / RUN_FILE
    try:
        return resolve(BuildConfig.from_dict(record["config"]))
    except ConfigError as exc:
        if exc.exit_code == 2:  # the record's values (an unknown name, a bad option)
            raise damaged(file, f"describes a model that cannot be built ({'; '.join(exc.problems)})",
                          run_fix(Path(folder))) from None
        raise ConceptError(one_line(f"cannot build the model of {file}: {'; '.join(exc.problems)}")) from None


# -- train.json -------------------------------------------------------------------------------
def train_fix(folder: Path) -> str:
    return f"restore it from a copy, or start a new run from the build {folder} was trained from: `concept train " \
           f"SOURCE -o DIR`"


def read_train(folder: str | os.PathLike) -> dict | None:
    """The training record of a trained run (``train.json``), checked against ``TrainConfig``; None when the
    folder has none (a build)."""
    folder = Path(folder)
    file = folder / TRAIN_FILE
    if not file.exists() and not file.is_symlink():
        return None
    fix = train_fix(folder)
    text = read_text(file, fix)
    if text.strip() == "null":
        raise damaged(file, "holds null, not a training record", fix)
    declared = train_config_of(folder)
    shipped = composed(third_party=False).option_owners  # (the library's own families' options)
    # an older version's record in today's (concept.migrate)
    record = migrate_train(read_json(file, fix), [f.name for f in dataclasses.fields(declared)], shipped)
    if record == {}:  # an older baseline saved untrained: what it recorded is its build's now
        return None
    problems = train_problems(record, declared)
    if problems:
        raise damaged(file, f"is invalid ({'; '.join(problems)})", fix)
    return record


def train_config_of(folder: str | os.PathLike) -> type:
    """The training config class of the run in ``folder``: the core's options and its family's (named in its
    concept.json; only that family is imported), or the library's own families' where that cannot be read or
    the family does not import (the readers of concept.json and of the plan say why)."""
    name = of_run(folder)
    try:
        return for_family(name) if name is not None else composed(third_party=False)
    except ConceptError:
        return composed(third_party=False)


def train_problems(record: dict, declared: type | None = None) -> list[str]:
    """What is wrong with a training record: the keys every version wrote, the types and declared checks of
    ``TrainConfig``'s options, the derived keys' types."""
    missing = [k for k in TRAIN_REQUIRED if k not in record]
    if missing:
        return [f"no {', '.join(repr(k) for k in missing)}"]
    lora = record["lora"]
    if not isinstance(lora, dict):
        return [f"lora: expected an object, got {_kind(lora)}"]
    if "rank" not in lora:
        return ["lora: no 'rank'"]
    lora_fields = {f.name for f in dataclasses.fields(LoraSettings)}
    unknown = sorted(set(lora) - lora_fields)
    if unknown:
        return [f"lora: unknown key {unknown[0]!r} (known: {', '.join(sorted(lora_fields))})"]
    config = _train_config(record, declared)
    problems = check(config) + check(config.lora, prefix="lora-")
    for key, expected in TRAIN_DERIVED_TYPES.items():
        if record.get(key) is not None and not isinstance(record[key], expected):
            problems.append(f"{key}: expected {_kind(expected())}, got {_kind(record[key])}")
    removed = (record.get("pruned") or {}).get("removed")
    if removed is not None and not (isinstance(removed, list) and len(removed) == 2
                                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in removed)):
        problems.append(f"pruned.removed: expected [START, STOP], got {removed!r}")
    return problems


def _train_config(record: dict, declared: type | None = None):
    """The training config (of class ``declared``; default: the core's and the library's own families'
    options) of a training record (its known keys; derived and unknown ones left out)."""
    declared = declared or composed(third_party=False)
    fields = {f.name for f in dataclasses.fields(declared)} - {"lora"}
    lora = {k: v for k, v in record["lora"].items() if k in {f.name for f in dataclasses.fields(LoraSettings)}}
    return declared(**{k: v for k, v in record.items() if k in fields}, lora=LoraSettings(**lora))


# -- metrics.jsonl, checkpoint/state.json -----------------------------------------------------
def read_metrics(folder: str | os.PathLike) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` ([] without one): each a JSON object with an integer ``step``. A
    torn last line (a writer killed mid-line) is left out; any other bad line is an error."""
    file = Path(folder) / METRICS_FILE
    if not file.exists() and not file.is_symlink():
        return []
    fix = "remove the damaged line (or the file: it is the training log, not needed to load the run)"
    lines = read_text(file, fix).splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # a torn last line
                continue
            raise damaged(file, f"line {number} is not valid JSON ({exc.msg})", fix) from None
        if not isinstance(row, dict):
            raise damaged(file, f"line {number} holds {_kind(row)}, not an object", fix)
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise damaged(file, f"line {number} has no step number ('step': {step!r})", fix)
        if row.get("eval") is not None and not isinstance(row["eval"], dict):
            raise damaged(file, f"line {number}: 'eval' is {_kind(row['eval'])}, not an object", fix)
        rows.append(row)
    return rows


def checkpoint_state(folder: str | os.PathLike) -> dict | None:
    """The newest checkpoint's ``state.json`` (None without a checkpoint), with its step checked."""
    found = checkpoint.folder(Path(folder))
    if found is None:
        return None
    file = found / STATE_FILE
    fix = (f"restore the checkpoint folder, or remove {found} to use the weights the run started from "
           f"(its training is then lost)")
    state = read_json(file, fix)
    problem = checkpoint.meta_problem(state)  # (the one check of a state.json, the writer's too)
    if problem:
        raise damaged(file, problem, fix)
    return state


# -- weights ----------------------------------------------------------------------------------
def weights_fix(file: Path) -> str:
    folder = Path(file).parent
    if folder.name == CHECKPOINT_DIR:
        return (f"restore it, or remove {folder} to go back to the weights the run started from (its training is "
                f"then lost)")
    if (folder / TRAIN_FILE).exists():
        return "restore it from a copy, or train the run again from its build"
    return f"restore it from a copy, or rebuild with `concept build -o {folder} --force`"


def weights_header(file: Path, fix: str | None = None) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype, shape)} from a safetensors file's header (nothing else is read)."""
    from safetensors import SafetensorError, safe_open

    fix = fix or weights_fix(file)
    file = Path(file)
    if file.is_dir():
        raise damaged(file, "is a folder, not a weights file", fix)
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise damaged(file, f"cannot be read ({exc.strerror or exc})", fix) from None
    if size == 0:
        raise damaged(file, "is empty (0 bytes)", fix)
    try:
        with safe_open(str(file), "pt") as f:
            return {k: (str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise damaged(file, f"is not a readable safetensors file ({exc})", fix) from None


def read_weights(file: Path, fix: str | None = None) -> dict:
    """The tensors of a safetensors file (header checked first)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    fix = fix or weights_fix(file)
    weights_header(file, fix)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise damaged(file, f"is not a readable safetensors file ({exc})", fix) from None
    except MemoryError:
        raise damaged(file, "does not fit in memory", "free memory, or load it on a larger machine") from None


def weights_file(folder: str | os.PathLike, stem: str) -> Path | None:
    """Where the newest weights named ``stem`` are: the run's checkpoint if it has them, else the folder's own."""
    found = checkpoint.folder(Path(folder))
    for where in ([found] if found is not None else []) + [Path(folder)]:
        file = where / f"{stem}.safetensors"
        if file.exists() or file.is_symlink():
            return file
    return None


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def weights_problems(state: dict, expected: dict) -> list[str]:
    """How the tensors ``state`` differ from the model's ``expected`` ones (names to tensors): names missing or
    unexpected, other shapes, an integer tensor where the model has a float one."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in state if k in expected and tuple(state[k].shape) != tuple(expected[k].shape)]
    kinds = [k for k in state if k in expected and k not in shapes
             and state[k].is_floating_point() != expected[k].is_floating_point()]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model's tensors missing (e.g. {missing[0]!r})")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors the model does not have (e.g. {unexpected[0]!r})")
    if shapes:
        k = shapes[0]
        problems.append(f"{len(shapes)} of another shape (e.g. {k!r}: {_shape(state[k].shape)} in the file, "
                        f"{_shape(expected[k].shape)} in the model)")
    if kinds:
        k = kinds[0]
        problems.append(f"{len(kinds)} of another dtype (e.g. {k!r}: {state[k].dtype} in the file, "
                        f"{expected[k].dtype} in the model)")
    return problems


def check_weights(state: dict, expected: dict, file: Path, what: str, fix: str | None = None) -> None:
    """Refuse tensors ``state`` read from ``file`` that are not the model's ``expected`` ones (``what``: e.g.
    "backbone"), in one line."""
    problems = weights_problems(state, expected)
    if problems:
        raise damaged(file, f"does not hold the weights of this run's {what}, but another model's? "
                            f"({', '.join(problems)})", fix or weights_fix(file))


def load_weights(module, file: Path, what: str, state: dict | None = None) -> None:
    """Load ``file`` (or its already read ``state``) into ``module``, every tensor checked against the module's
    own first (names, shapes, dtypes)."""
    state = read_weights(file) if state is None else state
    check_weights(state, module.state_dict(), file, what)
    module.load_state_dict(state)


# -- a whole folder, before anything is loaded --------------------------------------------------
def check_files(folder: str | os.PathLike) -> tuple[dict, dict | None]:
    """Validate every file of a run folder that a reader trusts, before anything is loaded or written:
    ``concept.json``, ``train.json`` (and that it trains this run's family), the checkpoint's ``state.json``,
    every weights file's header (and the top-level modules' names and shapes against the checkpoint's copy), an export's backbone
    and adapter configs. Returns (the run record, the training record or None)."""
    folder = Path(folder)
    record = read_run(folder)
    train = read_train(folder)
    if train is not None:  # a training record of this run's family
        foreign = foreign_options(record, train)
        if foreign:
            raise damaged(folder / TRAIN_FILE, f"sets {foreign}, which this {record['config']['family']} run "
                                               f"does not have: another run's train.json?", train_fix(folder))
    checkpoint_state(folder)
    headers = {}
    for file in sorted(folder.glob("*.safetensors")) + sorted((folder / CHECKPOINT_DIR).glob("*.safetensors")):
        headers[file.relative_to(folder).as_posix()] = weights_header(file)
    for stem in ("modules", "adapter") if not source_modules(record["config"]) else ("adapter",):  # two copies: the same
        top, saved = headers.get(f"{stem}.safetensors"), headers.get(f"{CHECKPOINT_DIR}/{stem}.safetensors")
        if top is not None and saved is not None and top != saved:
            raise damaged(folder / f"{stem}.safetensors", f"does not hold the tensors of the run's checkpoint "
                                                          f"({_difference(top, saved)}: another model's file?)",
                          weights_fix(folder / f"{stem}.safetensors"))
    if train is not None and train.get("lora"):  # the adapters are those train.json describes
        rank = train["lora"]["rank"]
        for rel in ("adapter.safetensors", f"{CHECKPOINT_DIR}/adapter.safetensors"):
            odd = [k for k, (_, shape) in headers.get(rel, {}).items() if len(shape) == 2
                   and shape[0 if ".lora_A." in k else 1] != rank and (".lora_A." in k or ".lora_B." in k)]
            if odd:
                raise damaged(folder / rel, f"holds LoRA adapters of another rank than train.json's {rank} (e.g. "
                                            f"{odd[0]!r}): another run's file, or another run's train.json?",
                              weights_fix(folder / rel))
    if record.get("export") is not None and checkpoint.folder(folder) is None:  # (a trained run's adapter/: a copy)
        check_export(folder, train)
    return record, train


def check_export(folder: Path, train: dict | None) -> None:
    """An export's Hugging Face backbone folder and peft adapter folder: their configs are JSON objects, their
    weights readable; the adapter's config holds a LoRA rank that its weights and train.json share."""
    fix = "restore the file, or export the run again"
    for sub, name in (("backbone", "config.json"), ("adapter", "adapter_config.json")):
        if (folder / sub).is_dir():
            config = read_json(folder / sub / name, fix)
            headers = {file: weights_header(file, fix) for file in sorted((folder / sub).glob("*.safetensors"))}
            if sub == "adapter":
                check_peft_adapter(folder / sub / name, config, headers, train, fix)


def check_peft_adapter(file: Path, config: dict, headers: dict, train: dict | None, fix: str) -> None:
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise damaged(file, f"'r' (the LoRA rank) is {rank!r}", fix)
    for key in ("lora_alpha", "lora_dropout"):
        if not isinstance(config.get(key, 0), (int, float)) or isinstance(config.get(key), bool):
            raise damaged(file, f"'{key}' is {config.get(key)!r}, not a number", fix)
    if train and train.get("lora") and train["lora"]["rank"] != rank:
        raise damaged(file, f"says LoRA rank {rank}, train.json {train['lora']['rank']}: one of them is another "
                            f"run's", fix)
    for weights, header in headers.items():
        for k, (dtype, shape) in header.items():
            if not dtype.startswith(("F", "BF")):
                raise damaged(weights, f"holds {k!r} as {dtype}, not floating point", fix)
            if len(shape) == 2 and (".lora_A." in k or ".lora_B." in k) and shape[0 if ".lora_A." in k else 1] != rank:
                raise damaged(weights, f"holds adapters of another rank than {file.name}'s {rank} (e.g. {k!r})", fix)


def foreign_options(record: dict, train: dict) -> str:
    """The options of ``train`` that only another of the library's families than the record's reads, set away
    from their defaults ("" for none), e.g. ``task 'reconstruct' (planner-executor)``. Imports the record's
    family and the library's own."""
    try:
        own = for_family(record["config"]["family"])
    except (UnknownComponentError, ConceptError):
        return ""  # (an unknown family is the plan's error)
    shipped = composed(third_party=False)
    defaults = {f.name: f.default for f in dataclasses.fields(shipped)}
    return ", ".join(f"{name.replace('_', '-')} {train[name]!r} ({' or '.join(owners)})"
                     for name, owners in shipped.option_owners.items()
                     if name in train and name not in own.__dataclass_fields__ and train[name] != defaults[name])


def _difference(a: dict, b: dict) -> str:
    only = sorted(set(a) ^ set(b))
    if only:
        return f"{len(only)} tensor name(s) differ, e.g. {only[0]!r}"
    k = next(k for k in a if a[k] != b[k])
    return (f"{k!r} is {a[k][0]} {_shape(a[k][1])} here and {b[k][0]} {_shape(b[k][1])} in the checkpoint")


def nonfinite_weights(tensors: dict) -> list[str]:
    """The names of the tensors holding NaN or infinity (weights are checked before they are published)."""
    import torch

    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]

