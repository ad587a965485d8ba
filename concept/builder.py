"""Component builders (torchtune style): a validated plan in, a wired model of its family (``concept.families``) out.

``build(config)`` validates everything first (one error listing every problem), loads the
backbone, freezes it, routes its attention through concept's AttentionInterface function,
builds each component from its registry entry and ``Config``, and wires the model.
``save`` / ``load`` write and read a run folder: ``concept.json`` (the config and its
resolved plan), ``modules.safetensors`` (the new modules) and, for randomly initialised
backbones only, ``backbone.safetensors``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import attention, checkpoint, fs
from .backbone import LoadedBackbone
from .components import BuildContext
from .config import BuildConfig, Plan, resolve
from .dense import DenseModel
from .errors import RunFolderError
from .families import family, family_of
from .lora import (
    PEFT_CONFIG_FILE,
    LoraSettings,
    add_lora,
    load_lora_state_dict,
    load_peft_adapter,
)

RUN_FILE = "concept.json"
MODULES_FILE = "modules.safetensors"
BACKBONE_FILE = "backbone.safetensors"
FORMAT_VERSION = 2
# what run folders of an older format were built with, where the config did not say it yet
LEGACY_CONFIG = {1: {"concept_input": "embedding", "tail_fusion": {"name": "none", "params": {}}}}


def build_backbone(plan: Plan) -> LoadedBackbone:
    bb = plan.components["backbone"]
    loaded = bb.cls.load(bb.config)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    attention.route(loaded.model)
    return loaded


def build_components(plan: Plan, loaded: LoadedBackbone) -> dict:
    """Instantiate every non-backbone component from its resolved class and config."""
    comps = plan.components
    info = loaded.info
    ctx = BuildContext(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_layers=info.num_layers,
                       split=plan.split, uses_null_class=getattr(comps["length_policy"].cls, "uses_null_class", True))
    token_embedding = loaded.model.get_input_embeddings().weight

    def init(part):  # components that start at the backbone's embedding scale
        if callable(getattr(part, "init_from_backbone", None)):
            part.init_from_backbone(token_embedding)
        return part

    vocabulary = init(comps["vocabulary"].cls(comps["vocabulary"].config, ctx))
    ctx.concept_vocab_size = vocabulary.size
    parts = dict(
        vocabulary=vocabulary,
        length_policy=comps["length_policy"].cls(comps["length_policy"].config, ctx),
        sampler=comps["sampler"].cls(comps["sampler"].config, ctx),
        eval_sampler=comps["eval_sampler"].cls(comps["eval_sampler"].config, ctx),
        positions=comps["position_scheme"].cls(comps["position_scheme"].config, ctx),
        attention=comps["attention"].cls(comps["attention"].config, ctx),
        tail_fusion=comps["tail_fusion"].cls(comps["tail_fusion"].config, ctx),
    )
    for name, part in parts.items():
        if name != "vocabulary":
            init(part)
    return parts


def build(config: BuildConfig | dict | None = None, plan: Plan | None = None):
    """Build the model of the config's family (``concept.families``) from a config, validated first (all
    errors at once)."""
    if plan is None:
        if isinstance(config, dict):
            config = BuildConfig.from_dict(config)
        plan = resolve(config or BuildConfig())
    loaded = build_backbone(plan)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.config.seed)
        model = family(plan.family).build(plan, loaded)
    return model.eval()


# -- run folders -----------------------------------------------------------------------------

def _run_record(model) -> dict:
    record = {"format": FORMAT_VERSION, "config": absolute_backbone_path(model.plan.config.to_dict()),
              "plan": model.plan.describe()}
    if getattr(model, "calibration", None):  # the build-time NULL-bias calibration (concept.streaming.calibration)
        record["calibration"] = model.calibration
    return record


def read_run(path: str | os.PathLike) -> dict:
    folder = Path(path)
    file = folder / RUN_FILE
    if not file.is_file():
        raise RunFolderError(f"{folder} is not a concept run folder (no {RUN_FILE}); create one with `concept build -o {folder}`")
    try:
        record = json.loads(file.read_text())
        config = record["config"]
        for key, value in LEGACY_CONFIG.get(record.get("format", 1), {}).items():
            config.setdefault(key, value)
        config.setdefault("family", "streaming")  # (written before there was a second family)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise RunFolderError(f"{file} is corrupt ({exc}); rebuild the run with `concept build -o {folder} --force`") from exc
    localise_backbone_path(record["config"], folder)
    return record


def run_kind(record: dict, train: dict | None) -> str:
    """What a run folder holds, from its records (nothing loaded): its family's name, or ``dense`` /
    ``pruned`` for a trained baseline (older runs stored ``baseline: true`` for the dense one)."""
    baseline = (train or {}).get("baseline")
    if baseline:
        return "dense" if baseline is True else str(baseline)
    return record["config"]["family"]


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


BUILT_FILES = {RUN_FILE, MODULES_FILE, BACKBONE_FILE}


def rebuildable(folder: Path, config: dict) -> bool:
    """``folder`` holds only a build of ``config`` (no training, no other files): rebuilding it loses nothing."""
    if not {p.name for p in Path(folder).iterdir()} <= BUILT_FILES:
        return False
    try:
        return read_run(folder)["config"] == config
    except RunFolderError:
        return False


def save(model, path: str | os.PathLike, force: bool = False) -> Path:
    """Write a run folder atomically. An existing run folder holding a *different* model is refused
    unless ``force``, a folder holding anything but a run always (``concept.fs.replace_problem``); it is
    only replaced once the new folder is complete."""
    folder = Path(path)
    record = _run_record(model)
    fs.check_output_path(folder, "-o")
    replace = force or (folder.is_dir() and not folder.is_symlink() and rebuildable(folder, record["config"]))
    problem = fs.replace_problem(folder, replace, "-o", " and holds a different model")
    if problem:
        raise RunFolderError(problem)
    modules = {k: v.detach().contiguous().cpu() for k, v in model.new_state_dict().items()}
    backbone = None if model.plan.backbone_info.pretrained else {
        k: v.detach().contiguous().cpu() for k, v in model.backbone.state_dict().items()}
    fs.check_space(folder, sum(t.numel() * t.element_size() for t in [*modules.values(), *(backbone or {}).values()]),
                   "the run folder")
    with fs.staged(folder, replace=replace, flag="-o") as tmp:  # published whole, or not at all
        save_file(modules, tmp / MODULES_FILE)
        if backbone is not None:
            save_file(backbone, tmp / BACKBONE_FILE)
        (tmp / RUN_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    return folder


TRAIN_FILE = "train.json"
PEFT_ADAPTER_DIR = "adapter"  # a run's LoRA adapters as a standard peft folder (concept.lora.save_peft_adapter)


def read_train(folder: Path) -> dict | None:
    """The training record of a trained run (None for a freshly built one)."""
    file = Path(folder) / TRAIN_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunFolderError(f"{file} is corrupt ({exc})") from exc


def newest_weights(folder: Path, stem: str) -> dict | None:
    """Newest weights named ``stem``: from the run's checkpoint if it has one, else from the build."""
    state = checkpoint.read_tensors(folder, stem)
    if state is None and (folder / f"{stem}.safetensors").is_file():
        try:
            state = load_file(folder / f"{stem}.safetensors")
        except Exception as exc:
            raise RunFolderError(f"{folder}: {stem}.safetensors is unreadable ({exc}); "
                                 f"rebuild with `concept build -o {folder} --force`") from exc
    return state


def load_new_modules(model, state: dict) -> None:
    for name, module in model.new_modules().items():
        prefix = f"{name}."
        try:
            module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        except RuntimeError as exc:  # keys or shapes differ: the weights were saved with another config
            first = next(iter(str(exc).splitlines()[1:]), str(exc)).strip()
            raise RunFolderError(f"saved {name} weights do not match the model built from the run's config ({first})") from None


def load(path: str | os.PathLike):
    """Rebuild a saved model (eval mode) from its run folder: a built model, a trained one (with its
    LoRA adapters and the newest checkpoint's weights) or a trained dense (or pruned) baseline; also a
    folder written by ``concept export`` (its backbone an ``hf`` folder inside it, its adapters a peft
    folder ``adapter/`` or merged into the backbone)."""
    folder = Path(path)
    record = read_run(folder)
    checkpoint.check_origin(folder, record["config"], backbone_folder(record["config"]))  # another build's: refused
    train = read_train(folder)
    plan = resolve(BuildConfig.from_dict(record["config"]))
    if train and train.get("baseline"):  # "dense" / "pruned" (older runs: true)
        loaded = build_backbone(plan)
        # a pruned baseline skips the block of layers its train.json records (concept.training.prune_plan)
        block = (train.get("pruned") or {}).get("removed") if train.get("baseline") == "pruned" else None
        removed = tuple(block) if block and block[1] > block[0] else None
        model = DenseModel(loaded.model, plan=plan, tokenizer=loaded.tokenizer, removed=removed,
                           mtp_heads=train.get("mtp_heads", 0))
    else:
        model = build(plan=plan)
    backbone_state = newest_weights(folder, "backbone")
    if backbone_state is not None:
        model.backbone.load_state_dict(backbone_state)
    exported = record.get("export")
    if exported is not None and checkpoint.folder(folder) is None:  # a `concept export` folder (not a run trained
        # from one): its adapters in adapter/ (peft), merged into the backbone, or none
        if exported.get("lora") == "adapter":
            load_peft_adapter(model.backbone, folder / PEFT_ADAPTER_DIR)
    elif train:
        adapter = newest_weights(folder, "adapter")
        if adapter is None and (folder / PEFT_ADAPTER_DIR / PEFT_CONFIG_FILE).is_file():  # a peft adapter folder
            load_peft_adapter(model.backbone, folder / PEFT_ADAPTER_DIR)
        else:
            add_lora(model.backbone, LoraSettings(**train["lora"]))
            if adapter:
                load_lora_state_dict(model.backbone, adapter)
    if train and family_of(model) is not None:  # e.g. the task a planner-executor was trained on
        family_of(model).prepare(model, train)
    modules = newest_weights(folder, "modules")
    if modules is None and model.new_modules():
        raise RunFolderError(f"{folder} has no weights (modules.safetensors); rebuild with `concept build -o {folder} --force`")
    if modules:
        load_new_modules(model, modules)
    return model.eval()
