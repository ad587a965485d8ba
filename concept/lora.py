"""LoRA adapters on the frozen backbone, through peft (injected in place, so the concept model's
views of the decoder layers stay valid)."""
from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from . import fs
from .backbone import decoder
from .distributed import full_tensor
from .errors import ConceptError, RunFolderError
from .train_config import DEFAULT_TARGETS, LoraSettings  # noqa: F401 (part of this module's API)


def add_lora(backbone: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA into ``backbone`` in place; only the adapter weights are trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = [t.strip() for t in settings.targets.split(",") if t.strip()]
    present = {name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ConceptError(f"LoRA targets {missing} are not linear layers of this backbone; "
                           f"available: {', '.join(sorted(present))}")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, backbone)
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
    return backbone


def lora_state_dict(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights, whole (FSDP2-sharded weights are gathered: every rank must call it)."""
    return {k: full_tensor(v).detach().cpu().contiguous() for k, v in backbone.state_dict().items() if "lora_" in k}


def load_lora_state_dict(backbone: nn.Module, state: dict[str, torch.Tensor]) -> None:
    try:
        missing = backbone.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes differ: another rank
        first = next(iter(str(exc).splitlines()[1:]), str(exc)).strip()
        raise RunFolderError(f"adapter weights do not match the model's LoRA settings ({first}); "
                             f"train with the same --lora-rank / --lora-targets") from None
    unexpected = list(missing.unexpected_keys)
    absent = [k for k in missing.missing_keys if "lora_" in k]
    if unexpected or absent:
        raise RunFolderError(f"adapter weights do not match the model's LoRA settings (unexpected {unexpected[:3]}, "
                             f"missing {absent[:3]}); train with the same --lora-rank / --lora-targets")


# -- standard peft adapter folders -----------------------------------------------------------
# ``save_peft_adapter`` writes what ``PeftModel.save_pretrained`` writes for a model wrapped with
# ``get_peft_model``: adapter_config.json (``LoraConfig.save_pretrained``) and adapter_model.safetensors
# (``get_peft_model_state_dict``: no adapter name, keys under ``base_model.model.``), so that
# ``peft.PeftModel.from_pretrained(plain_hf_backbone, folder)`` loads it onto the plain transformers model.

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the wrapped transformers model
_LAYER_INDEX = r"\.layers\.(\d+)\."


def _layer_of(key: str) -> int | None:
    import re

    match = re.search(_LAYER_INDEX, key)
    return int(match.group(1)) if match else None


def _kept_index(i: int, removed: tuple[int, int]) -> int:
    """Layer ``i``'s index once the block ``removed`` is deleted (``i`` is not in it)."""
    return i - (removed[1] - removed[0]) if i >= removed[1] else i


def save_peft_adapter(backbone: nn.Module, folder, base_model_name_or_path: str | None = None,
                      removed: tuple[int, int] | None = None, state: dict[str, torch.Tensor] | None = None,
                      renumber: bool = False):
    """Write the LoRA adapters injected in ``backbone`` (``add_lora``) as a standard peft adapter folder.

    ``removed=(start, stop)`` (the pruned baseline's skipped block): those layers' adapters are left
    out (they never train: the baseline does not run those layers) and the config's
    ``layers_to_transform`` lists the kept layers, so peft injects adapters on the kept layers only.
    Loaded with peft onto the full backbone this gives the dense forward with the pruned run's
    adapters; delete layers ``start..stop-1`` afterwards to get the pruned baseline itself.
    ``state``: the adapter weights as ``lora_state_dict`` returns them, when already at hand (default:
    ``lora_state_dict(backbone)``, which gathers FSDP2-sharded adapters: a collective, so under FSDP2
    gather on every rank and pass ``state`` on the rank that writes). ``renumber``: the removed layers are
    deleted from the base it is saved for too (a pruned ``concept export``): the kept layers' adapters are
    numbered 0..n-1 as that base's layers are, and apply to all of them. Returns the folder."""
    import copy
    from pathlib import Path

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file


    configs = getattr(backbone, "peft_config", None) or {}
    if "default" not in configs:
        raise ConceptError("this backbone carries no LoRA adapters (concept.lora.add_lora); nothing to save")
    config = copy.deepcopy(configs["default"])
    state = lora_state_dict(backbone) if state is None else state
    state = get_peft_model_state_dict(backbone, state_dict=state)  # adapter name removed, as PeftModel.save_pretrained
    if removed is not None and removed[1] > removed[0]:
        start, stop = removed
        num_layers = len(decoder(backbone).layers)
        config.layers_to_transform = [i for i in range(num_layers) if not start <= i < stop]
        state = {k: v for k, v in state.items() if (i := _layer_of(k)) is None or not start <= i < stop}
        if renumber:
            import re

            config.layers_to_transform = None
            state = {re.sub(_LAYER_INDEX, lambda m: f".layers.{_kept_index(int(m.group(1)), removed)}.", k, count=1): v
                     for k, v in state.items()}
    config.inference_mode = True
    config.base_model_name_or_path = base_model_name_or_path
    config.task_type = "CAUSAL_LM"  # PeftModel.from_pretrained then gives a PeftModelForCausalLM (generate, ...)
    if isinstance(config.target_modules, (set, list, tuple)):
        config.target_modules = sorted(config.target_modules)  # (a set: the file would differ run to run)
    # written whole into a sibling folder, then swapped in: a crash never leaves a torn adapter folder
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.with_name(f".{folder.name}.new-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    try:
        config.save_pretrained(str(fresh))
        save_file({PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()},
                  str(fresh / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    fs.replace_dir(fresh, folder)
    return folder


def read_peft_config(folder):
    """The ``LoraConfig`` of a peft adapter folder, with clear errors."""
    from pathlib import Path

    from peft import LoraConfig


    folder = Path(folder)
    if not (folder / PEFT_CONFIG_FILE).is_file() or not (folder / PEFT_WEIGHTS_FILE).is_file():
        raise RunFolderError(f"{folder} is not a peft adapter folder (needs {PEFT_CONFIG_FILE} and {PEFT_WEIGHTS_FILE})")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise RunFolderError(f"{folder / PEFT_CONFIG_FILE} is unreadable or not a LoRA config ({exc})") from exc
    if getattr(config, "peft_type", None) is None or str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
        raise RunFolderError(f"{folder}: only LoRA adapters are supported, this one is {config.peft_type}")
    return config


def settings_from_peft(config) -> LoraSettings:
    targets = config.target_modules
    if isinstance(targets, str):  # a regex: concept names its targets by module name
        targets = [targets]
    return LoraSettings(rank=int(config.r), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout),
                        targets=",".join(sorted(targets)))


def load_peft_adapter(backbone: nn.Module, folder) -> LoraSettings:
    """Inject the LoRA adapters of a peft adapter folder (``save_peft_adapter``, or any peft LoRA
    folder of this backbone) into ``backbone`` in place, as ``add_lora`` does (only the adapters
    are trainable), and load their weights. Returns the LoRA settings."""
    from pathlib import Path

    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from peft.utils import load_peft_weights


    folder = Path(folder)
    config = read_peft_config(folder)
    config.inference_mode = False
    try:
        state = load_peft_weights(str(folder), device="cpu")
    except Exception as exc:
        raise RunFolderError(f"{folder / PEFT_WEIGHTS_FILE} is unreadable ({exc})") from exc
    state = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in state.items()}
    try:
        inject_adapter_in_model(config, backbone)
    except ValueError as exc:  # e.g. target modules this backbone does not have
        raise RunFolderError(f"the adapter in {folder} does not fit this backbone ({exc})") from None
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
    expected = set(get_lora_keys(backbone))
    try:
        result = set_peft_model_state_dict(backbone, state)
    except RuntimeError as exc:  # shapes differ
        first = next(iter(str(exc).splitlines()[1:]), str(exc)).strip()
        raise RunFolderError(f"the adapter in {folder} does not fit this backbone ({first})") from None
    unexpected = list(result.unexpected_keys)
    absent = sorted(expected & set(result.missing_keys))
    if unexpected or absent:
        raise RunFolderError(f"the adapter in {folder} does not fit this backbone (unexpected {unexpected[:3]}, "
                             f"missing {absent[:3]})")
    return settings_from_peft(config)


def peft_adapter_state(folder) -> dict[str, torch.Tensor] | None:
    """The weights of a peft adapter folder keyed as ``lora_state_dict`` keys them (the adapter named
    ``default``, no ``base_model.model.`` prefix), for ``load_lora_state_dict``; None when ``folder`` holds
    no adapter."""
    from pathlib import Path

    from peft.utils import load_peft_weights


    folder = Path(folder)
    if not (folder / PEFT_CONFIG_FILE).is_file():
        return None
    read_peft_config(folder)
    try:
        state = load_peft_weights(str(folder), device="cpu")
    except Exception as exc:
        raise RunFolderError(f"{folder / PEFT_WEIGHTS_FILE} is unreadable ({exc})") from exc
    out = {}
    for key, value in state.items():
        key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        head, _, leaf = key.rpartition(".")  # ...q_proj.lora_A.weight -> ...q_proj.lora_A.default.weight
        out[f"{head}.default.{leaf}" if head.rsplit(".", 1)[-1].startswith("lora_") else key] = value
    return out


def get_lora_keys(backbone: nn.Module) -> list[str]:
    return [k for k in backbone.state_dict() if "lora_" in k]
