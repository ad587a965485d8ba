"""The backbone's RMSNorm as one op: ``torch.nn.functional.rms_norm`` with the module's weight and eps.

transformers' ``LlamaRMSNorm`` (and Qwen2's, Mistral's, Qwen3's: the same code) normalises in ~8 aten ops:
``to(float32)``, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``to(input dtype)``, ``weight *``. Under bf16 that
is two casts and six kernels per norm, forward, and more backward; a 30-layer model has 61 norms. ``F.rms_norm``
is one op: on CUDA (torch >= 2.8) the fused ``_fused_rms_norm`` kernel and its fused backward; on the CPU it
decomposes to the same math (upcast to float32, ``pow`` / ``mean`` / ``add`` / ``rsqrt`` / ``mul``, then the
weight, then the cast back).

:func:`fuse_rms_norms` gives every such module of a backbone the fused forward, in place (its class becomes a
subclass of its own: ``isinstance``, the parameters, the state dict keys, peft, checkpoints and exports stay as
they are). ``concept.builder.build_backbone`` calls it, so every family's model runs it, the dense and pruned
baselines included. What it computes:

* float32 (input and weight): HF's ops in HF's order: bit for bit HF's output and gradients;
* bf16 / fp16 (input and weight alike): the weight is multiplied in float32 before the one rounding to the
  input's dtype, where HF rounds the normalised state first, multiplies by the weight and rounds again: within
  one rounding of HF's, and nearer the exact value;
* anything else (float64, or a weight in another dtype than the input, e.g. an fp32 weight under autocast):
  HF's own forward, unchanged (HF normalises float64 in float32; a mixed pair gives HF's promoted dtype).

``rms_norm`` is on CUDA autocast's float32 list: under autocast it would upcast a bf16 input and weight and
return float32 (a cast of the weight per call, the output in float32). The fused forward runs with autocast off:
its input already is the compute dtype, and HF's own ops are not autocast-listed either, so the output's dtype
is HF's.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

# the transformers classes whose forward is ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (the
# supported architectures' norms, concept.backbone.SUPPORTED_ARCHITECTURES), by the module that defines each
HF_RMS_NORMS = {
    "LlamaRMSNorm": "transformers.models.llama.modeling_llama",
    "MistralRMSNorm": "transformers.models.mistral.modeling_mistral",
    "Qwen2RMSNorm": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3RMSNorm": "transformers.models.qwen3.modeling_qwen3",
}
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Asked directly: torch.amp.is_autocast_available is not traceable by dynamo under torch 2.11.
AUTOCAST_DEVICES = ("cuda", "cpu")


class FusedRMSNormForward:
    """A transformers RMSNorm's forward as ``F.rms_norm`` (mixed in before the HF class)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden_states.dtype != weight.dtype or hidden_states.dtype not in FUSED_DTYPES:
            return super().forward(hidden_states)
        device = hidden_states.device.type
        if device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)
        return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


_FUSED: dict[type, type] = {}


def fused_class(hf_class: type) -> type:
    """``Fused<HF class>``: ``hf_class`` with :class:`FusedRMSNormForward`'s forward (made once)."""
    if hf_class not in _FUSED:
        _FUSED[hf_class] = type(f"Fused{hf_class.__name__}", (FusedRMSNormForward, hf_class),
                                {"__module__": __name__})
    return _FUSED[hf_class]


def hf_class(name: str) -> type | None:
    """The transformers class ``name`` of :data:`HF_RMS_NORMS` (None where this transformers has none)."""
    try:
        return getattr(importlib.import_module(HF_RMS_NORMS[name]), name)
    except (ImportError, AttributeError):
        return None


def __getattr__(name: str):
    if name.startswith("Fused") and name[len("Fused"):] in HF_RMS_NORMS:  # (pickle and copy find a class by name)
        plain = hf_class(name[len("Fused"):])
        if plain is not None:
            return fused_class(plain)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every transformers RMSNorm of ``model`` (:data:`HF_RMS_NORMS`, exactly that class) the fused
    forward, in place; returns how many (0 for a model that has none, or whose norms are already fused)."""
    count = 0
    for module in model.modules():
        if HF_RMS_NORMS.get(type(module).__name__) == type(module).__module__:
            module.__class__ = fused_class(type(module))
            count += 1
    return count
