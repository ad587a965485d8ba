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

import contextlib

import torch
from torch import nn

from .config import DEFAULT_INFERENCE_DTYPE, DTYPES  # noqa: F401 (this module's API too)
from .errors import ConfigError


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


# -- a loaded model's precision: ``concept.load(..., dtype=)`` and the inference commands' ``--dtype`` ----------
# The same regime as a bf16 training run, for evaluation, scoring, generation and serving: the frozen base stored in
# bf16 once, the model run under bf16 autocast, the LoRA adapters and the new modules fp32 (what the run trained and
# saved). ``auto`` decides at the model's first call on a device: bf16 on CUDA, fp32 elsewhere; once the base is
# stored in bf16 the model runs bf16 on every device (an fp32 input cannot meet a bf16 weight outside autocast).

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # a dtype as the choices name it
# torch's names of the two dtypes (``torch.bfloat16``, ``"bfloat16"``: what transformers' ``torch_dtype`` and
# lm-eval's ``dtype=`` take) -> the choice they mean
TORCH_NAMES = {str(dtype).removeprefix("torch."): name for dtype, name in DTYPE_NAMES.items()}


def dtype_choice(value) -> str:
    """``value`` as one of :data:`DTYPES`: the choice itself, or torch's dtype or its name (``torch.bfloat16``,
    ``"bfloat16"``, ``torch.float32``); anything else is a clear error."""
    name = str(value).removeprefix("torch.") if isinstance(value, (str, torch.dtype)) else None
    choice = name if name in DTYPES else TORCH_NAMES.get(name)
    if choice is None:
        raise ConfigError([f"dtype: one of {', '.join(DTYPES)} (or torch.bfloat16 / torch.float32), got {value!r}"])
    return choice


class Precision:
    """A loaded model's compute precision (``model.precision``, set by :func:`use_dtype`): the choice and, once
    decided, the dtype it runs in (``auto``: None until its first call on a device)."""

    def __init__(self, choice: str):
        self.choice = choice
        self.dtype = None if choice == "auto" else compute_dtype(choice, torch.device("cpu"))  # (fp32, bf16: anywhere)
        self.active: list = []  # the autocast contexts entered by the model's calls (its forward hooks)

    def decide(self, model: nn.Module, device: torch.device) -> torch.dtype:
        """The dtype ``model`` runs in on ``device`` (``auto``: decided at its first call, and again at its first call on
        a CUDA device after fp32 elsewhere, e.g. a model run on the CPU and then moved; once its base is stored in bf16
        the decision stays)."""
        moved = self.choice == "auto" and self.dtype == torch.float32 and device.type == "cuda"
        if self.dtype is None or moved:
            self.dtype = compute_dtype("auto", device)
            if self.dtype != torch.float32:
                store_frozen_base(model, self.dtype)
        return self.dtype


def use_dtype(model: nn.Module, choice) -> nn.Module:
    """Give the loaded ``model`` the compute precision ``choice`` (:func:`dtype_choice`; in place, returns it): ``bf16``
    stores its frozen base in bf16 now; ``auto`` at its first call on a CUDA device. Its calls (``model(...)``) then run
    under that autocast, as do generation, scoring and evaluation (:func:`running`). ``fp32``: nothing changes."""
    choice = dtype_choice(choice)
    if choice == "fp32" and getattr(model, "precision", None) is None:
        return model
    precision = Precision(choice)
    model.precision = precision
    if precision.dtype is not None and precision.dtype != torch.float32:
        store_frozen_base(model, precision.dtype)
    if not getattr(model, "_precision_hooks", False):
        model.register_forward_pre_hook(_enter, with_kwargs=True)
        model.register_forward_hook(_leave, always_call=True)
        model._precision_hooks = True
    return model


def _first_device(model: nn.Module, args, kwargs) -> torch.device:
    tensor = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return tensor.device if tensor is not None else next(model.parameters()).device


def _enter(model, args, kwargs):
    context = running(model, _first_device(model, args, kwargs))
    context.__enter__()
    model.precision.active.append(context)


def _leave(model, args, output):
    if model.precision.active:  # (empty where entering failed: its error is the one to see)
        model.precision.active.pop().__exit__(None, None, None)


def cast_base(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`use_dtype` stored ``model``'s frozen base in, if it cast it (None: as it was loaded)."""
    precision = getattr(model, "precision", None)
    dtype = precision.dtype if isinstance(precision, Precision) else None
    return dtype if dtype not in (None, torch.float32) else None


def inference_dtype(model: nn.Module, device: torch.device | None = None) -> torch.dtype:
    """The dtype ``model`` computes in on ``device`` (default: its parameters'): its :func:`use_dtype` precision,
    decided now if undecided; fp32 for a model without one."""
    precision = getattr(model, "precision", None)
    if not isinstance(precision, Precision):
        return torch.float32
    return precision.decide(model, device if device is not None else next(model.parameters()).device)


def running(model: nn.Module, device: torch.device | None = None):
    """The autocast ``model`` runs under on ``device`` (:func:`inference_dtype`): what generation, scoring and
    evaluation enter around their calls (nested in a call's own, the same autocast). Nothing for fp32: an autocast the
    caller entered stays as it is."""
    device = torch.device(device if device is not None else next(model.parameters()).device)
    dtype = inference_dtype(model, device)
    return contextlib.nullcontext() if dtype == torch.float32 else autocast(dtype, device)
