"""Training precision (``--dtype``): what is stored in which dtype, and the autocast a step runs under.

With bf16 (``--dtype bf16``, or ``auto`` on CUDA) the frozen base weights are **stored** in bf16 (cast
once, when the training model is made): autocast leaves a bf16 weight as it is, so no frozen weight is
cast inside a step (with fp32 storage autocast re-cast every frozen matrix at every use, forward and
backward: the top device operator of every model on the H100, ``aten::copy_``). The LoRA adapters, the
new modules and the optimizer state stay fp32; autocast casts the small trainable matrices to bf16 for
their matmuls. The distillation teacher is the same backbone with its adapters off: bf16 too. Losses,
softmaxes and norms accumulate in fp32 (``concept.components.upcast``). With fp32 nothing is cast and
autocast is off: fp32 training is unchanged.

Frozen adapters (``--train-only new``) stay fp32: they are saved with the run and must not lose bits.
"""
from __future__ import annotations

import torch
from torch import nn


def compute_dtype(choice: str, device: torch.device) -> torch.dtype:
    """bf16 for ``--dtype bf16`` on any device and ``auto`` on CUDA; fp32 otherwise."""
    return torch.bfloat16 if choice == "bf16" or (choice == "auto" and device.type == "cuda") else torch.float32


def autocast(dtype: torch.dtype, device: torch.device):
    """Autocast to ``dtype`` on ``device`` (off for fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == torch.float32 else dtype,
                          enabled=dtype != torch.float32)


def frozen_base(model: nn.Module) -> dict[str, nn.Parameter]:
    """The backbone's weights that do not train and are not adapters (LoRA weights travel with a run), by name."""
    return {name: p for name, p in model.backbone.named_parameters()
            if not p.requires_grad and "lora_" not in name and p.is_floating_point()}


def store_frozen_base(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen base weights (:func:`frozen_base`) in ``dtype``, in place (each parameter object
    stays: tied weights stay tied); returns how many were cast. peft's LoRA layers would cast their input to
    the adapters' fp32 and autocast back to bf16 for the matmul (two copies of every adapted layer's
    input, forward and backward, for a bit-identical result): under bf16 that casting is turned off."""
    cast = 0
    with torch.no_grad():
        for p in frozen_base(model).values():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
                cast += 1
    if dtype != torch.float32:
        for module in model.backbone.modules():
            if hasattr(module, "cast_input_dtype_enabled"):  # peft's BaseTunerLayer
                module.cast_input_dtype_enabled = False
    return cast
