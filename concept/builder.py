"""Component builders (torchtune style): a validated plan in, a wired model of its family (``concept.families``) out.

``build(config)`` validates everything first (one error listing every problem), loads the
backbone, freezes it, routes its attention through concept's AttentionInterface function,
runs its RMSNorms as one op (``concept.rms_norm``), builds each component from its registry
entry and ``Config``, and wires the model.
``save`` / ``load`` write and read a run folder: ``concept.json`` (the config and its
resolved plan), ``modules.safetensors`` (the new modules) and, for randomly initialised
backbones only, ``backbone.safetensors``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import attention, checkpoint, fs, memory, run_files
from .backbone import LoadedBackbone
from .compiled import compile_model
from .components import BuildContext
from .config import DEFAULT_COMPILE, BuildConfig, BuildResolution, resolve
from .errors import ConceptError, ConfigError, RunFolderError
from .families import family, family_of
from .hub import local_folder
from .lora import (
    PEFT_CONFIG_FILE,
    LoraSettings,
    add_lora,
    load_lora_state_dict,
    load_peft_adapter,
    merge_adapters,
)
from .precision import DEFAULT_INFERENCE_DTYPE, dtype_choice, use_dtype
from .rms_norm import fuse_rms_norms

from .migrate import FORMAT_VERSION  # noqa: F401 (this module's API too)
from .run_files import BACKBONE_FILE, MODULES_FILE, RUN_FILE  # noqa: F401 (this module's API too)
from .run_files import absolute_backbone_path, backbone_folder, localise_backbone_path  # noqa: F401 (this module's API too)


def build_backbone(plan: BuildResolution) -> LoadedBackbone:
    bb = plan.components["backbone"]
    loaded = bb.cls.load(bb.config)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    attention.route(loaded.model)
    fuse_rms_norms(loaded.model)  # every family's model, the dense and pruned baselines too (concept.rms_norm)
    return loaded


def build_components(plan: BuildResolution, loaded: LoadedBackbone) -> dict:
    """Instantiate every non-backbone component from its resolved class and config."""
    comps = plan.components
    info = loaded.info
    ctx = BuildContext(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_layers=info.num_layers,
                       split=plan.split, uses_null_class=comps["length_policy"].cls.uses_null_class)
    token_embedding = loaded.model.get_input_embeddings().weight

    def init(part):  # components that start at the backbone's embedding scale
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


def build(config: BuildConfig | dict | None = None, resolution: BuildResolution | None = None,
          compile: str = DEFAULT_COMPILE):
    """Build the model of the config's family (``concept.families``) from a config, validated first (all
    errors at once), or from its ``resolution`` (``concept.config.resolve``). ``compile``: run its stacks compiled
    (``concept.compiled``; off by default)."""
    if resolution is None:
        if isinstance(config, dict):
            config = BuildConfig.from_dict(config)
        resolution = resolve(config or BuildConfig())
    plan = resolution
    need, what = memory.build_bytes(plan)
    fits, have = memory.fits(need)
    if not fits:  # a clear error, not an allocation failure or an out-of-memory kill halfway
        raise ConceptError(f"this model needs at least {memory.gib(need)} for {what}, and this machine has "
                           f"{memory.gib(have)} available; build a smaller one (e.g. a smaller --set vocabulary.size)")
    loaded = build_backbone(plan)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.config.seed)
        model = family(plan.family).build(plan, loaded)
    return compile_model(model, compile).eval() if compile != "off" else model.eval()


# -- run folders -----------------------------------------------------------------------------

def _run_record(model) -> dict:
    record = {"format": FORMAT_VERSION, "config": absolute_backbone_path(model.resolution.config.to_dict()),
              "plan": model.resolution.describe()}
    if getattr(model, "calibration", None):  # the build-time NULL-bias calibration (concept.streaming.calibration)
        record["calibration"] = model.calibration
    return record


def read_run(path: str | os.PathLike) -> dict:
    """The record of a run folder (``concept.json``), validated (``concept.run_files.read_run``)."""
    return run_files.read_run(path)


BUILT_FILES = {RUN_FILE, MODULES_FILE, BACKBONE_FILE}


def run_kind(record: dict, train: dict | None) -> str:
    """What a run folder holds, from its records (nothing loaded): its family's name (a baseline's too:
    ``dense`` / ``pruned``)."""
    return record["config"]["family"]


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
    backbone = None if model.resolution.backbone_info.pretrained else {
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
    """The training record of a trained run (None for a freshly built one), validated
    (``concept.run_files.read_train``)."""
    return run_files.read_train(folder)


def newest_weights(folder: Path, stem: str) -> dict | None:
    """Newest weights named ``stem``: from the run's checkpoint if it has one, else from the build."""
    file = run_files.weights_file(folder, stem)
    return None if file is None else run_files.read_weights(file)


def load_new_modules(model, state: dict, file: Path | None = None) -> None:
    """Load the new modules' weights ``state`` (keyed ``MODULE.PARAM``, as ``model.new_state_dict()``), each
    tensor checked against the model's first (``file``: where they were read, for the error)."""
    run_files.check_weights(state, model.new_state_dict(), file or Path("modules.safetensors"), "new modules")
    for name, module in model.new_modules().items():
        prefix = f"{name}."
        module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def load(path: str | os.PathLike, compile: str = DEFAULT_COMPILE, dtype=DEFAULT_INFERENCE_DTYPE, merge_lora: bool = False,
         **hub):
    """Rebuild a saved model (eval mode) from its run folder: a built model, a trained one (with its
    LoRA adapters and the newest checkpoint's weights), a dense or pruned baseline among them; also a
    folder written by ``concept export`` (its backbone an ``hf`` folder inside it, its adapters a peft
    folder ``adapter/`` or merged into the backbone), or a hub id ``org/name`` of one (downloaded with
    ``huggingface_hub.snapshot_download``; ``hub``: its ``revision``, ``cache_dir``, ``token``,
    ``local_files_only``, ``force_download``, ``subfolder``; see ``concept.hub``). Every file is validated
    first (``concept.run_files.check_files``); a damaged one is one error naming it. ``compile``: run its
    stacks compiled (``concept.compiled``; off by default). ``dtype``: its compute precision (``fp32``, the
    default; ``bf16`` or ``torch.bfloat16``; ``auto``: bf16 on a CUDA device; ``concept.precision``): with bf16 its frozen
    base is stored in bf16 and it runs under bf16 autocast, its adapters and new modules fp32. ``merge_lora``: merge
    its LoRA adapters into the base weights (``concept.lora.merge_adapters``, in fp32, before any bf16 storage): the
    forward of the backbone without adapters, no adapter product or cast per call, the same values up to rounding; for
    inference only (the model can no longer be saved or exported, nor run its backbone without the adapters)."""
    dtype = dtype_choice(dtype)  # (a clear error before anything is read)
    if not isinstance(merge_lora, bool):
        raise ConfigError([f"merge_lora: True or False, got {merge_lora!r}"])
    folder = local_folder(path, **hub)
    record, train = run_files.check_files(folder)
    checkpoint.check_origin(folder, record["config"], backbone_folder(record["config"]))  # another build's: refused
    plan = run_files.plan_of(record, folder)
    model = build(resolution=plan)  # (a baseline: the dense or pruned family's; an older one's: concept.migrate)
    backbone_file = run_files.weights_file(folder, "backbone")
    if backbone_file is not None:
        run_files.load_weights(model.backbone, backbone_file, "backbone")
    modules_file = run_files.weights_file(folder, "modules") if model.new_modules() else None  # (a baseline's
    # modules.safetensors is its build's: only MTP heads are its own)
    if modules_file is None and model.new_modules():
        raise RunFolderError(f"{folder} has no weights (modules.safetensors); rebuild with `concept build -o {folder} --force`")
    modules = run_files.read_weights(modules_file) if modules_file is not None else None
    if modules is not None:  # checked now, loaded last (a family's prepare sees the model as built)
        run_files.check_weights(modules, model.new_state_dict(), modules_file, "new modules")
    exported = record.get("export")
    if exported is not None and checkpoint.folder(folder) is None:  # a `concept export` folder (not a run trained
        # from one): its adapters in adapter/ (peft), merged into the backbone, or none
        if exported.get("lora") == "adapter":
            load_peft_adapter(model.backbone, folder / PEFT_ADAPTER_DIR)
    elif train:
        adapter_file = run_files.weights_file(folder, "adapter")
        if adapter_file is None and (folder / PEFT_ADAPTER_DIR / PEFT_CONFIG_FILE).is_file():  # a peft adapter folder
            load_peft_adapter(model.backbone, folder / PEFT_ADAPTER_DIR)
        else:
            add_lora(model.backbone, LoraSettings(**train["lora"]))
            if adapter_file is not None:
                adapter = run_files.read_weights(adapter_file)
                expected = {k: v for k, v in model.backbone.state_dict().items() if "lora_" in k}
                run_files.check_weights(adapter, expected, adapter_file, "LoRA adapters")
                load_lora_state_dict(model.backbone, adapter)
    if train and family_of(model) is not None:  # e.g. the task a planner-executor was trained on
        family_of(model).prepare(model, train)
    if modules is not None:
        load_new_modules(model, modules, modules_file)
    model.loaded_from = {"folder": str(folder.resolve()), "record": record, "train": train}  # (save_pretrained re-exports it)
    if merge_lora:
        merge_adapters(model.backbone)  # (fp32: before the base is stored in bf16)
    use_dtype(model, dtype)  # (before compiling: the graphs see the weights as they are stored)
    return compile_model(model, compile).eval() if compile != "off" else model.eval()
