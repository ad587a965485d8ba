"""The distillation teacher: the frozen backbone itself, i.e. the student's backbone with its LoRA
adapters disabled (peft's own switch), run without gradients on the student's batch.

    with adapters_disabled(model.backbone):       # restores every adapter (and requires_grad) on exit
        ...
    t = teacher_forward(model, batch, needs={"logits", "deep_input"})   # TeacherOutput

The teacher runs **all** the backbone's decoder layers (also those a pruned baseline skips) with the
masks of the dense baseline (``concept.dense``): causal, padding, packed documents, time positions.
Besides the next-token logits it returns the hidden state at the input of layer ``Ls + Lm`` (what the
streaming model's deep stack should read: ``deep_input``) and the last layer's output before the
final norm (``final``), the targets of the hidden-state alignment (``concept.objectives``).
Its cost is one no-grad forward of the whole backbone per micro-batch (no backward; only the
first ``Ls + Lm`` layers when the deep-stack input is all that is needed); the trainer logs it
as ``teacher_s`` and ``teacher_fraction`` in metrics.jsonl, timed by :class:`TeacherClock` without
stopping the host (CUDA events, read with the step's log).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from . import packing
from .attention import CausalPattern
from .backbone import decoder, run_layers
from .errors import ConceptError
from .lora import lora_merged


@dataclass
class TeacherOutput:
    logits: torch.Tensor | None = None  # [B, T, V] next-token logits of the backbone
    deep_input: torch.Tensor | None = None  # [B, T, d] hidden state at the input of layer ``at``
    final: torch.Tensor | None = None  # [B, T, d] last layer's output, before the final norm
    at: int | None = None  # the layer index whose input ``deep_input`` is


class TeacherClock:
    """The seconds the teacher's forwards take, measured without a host sync: on CUDA a pair of events around
    each forward, read (``float``) only once the step's log is, when they are done; on a CPU, whose ops finish
    as Python calls them, the host clock. Several forwards add up (``+``: a step's micro-batches)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: list = []  # (start, end): CUDA events, or perf_counter() values

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def timing(self):
        start = self._now()
        yield
        self.spans.append((start, self._now()))

    def __add__(self, other):
        both = TeacherClock("cuda" if self.cuda else "cpu")
        both.spans = self.spans + (other.spans if isinstance(other, TeacherClock) else [])
        return both if isinstance(other, TeacherClock) or not other else NotImplemented

    __radd__ = __add__

    def __float__(self) -> float:
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in self.spans) / 1000
        return sum(end - start for start, end in self.spans)


def tuner_layers(module: nn.Module) -> list[nn.Module]:
    """peft's adapter-carrying layers (``BaseTunerLayer``) inside ``module``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(module: nn.Module):
    """Disable every peft adapter inside ``module`` (``BaseTunerLayer.enable_adapters(False)``) and
    restore each layer's previous state on exit, even on an exception. peft's switch also flips the
    adapters' ``requires_grad`` (re-enabling sets it to True); the previous flags are restored exactly,
    so frozen adapters (``--train-only new``) stay frozen."""
    if lora_merged(module):  # (merged into the base: the frozen backbone's weights are gone from memory)
        raise ConceptError(f"this model's LoRA adapters were merged into its base weights (merge_lora): the frozen "
                           f"backbone without them is not in memory; load the run without merge_lora (--merge-lora) "
                           f"for what runs the backbone without its adapters (the distillation teacher, the "
                           f"planner's frozen-backbone controls), or leave those out (concept eval --no-controls)")
    layers = tuner_layers(module)
    states = [(layer, bool(layer.disable_adapters)) for layer in layers]
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    try:
        for layer in layers:
            layer.enable_adapters(False)
        yield module
    finally:
        for layer, disabled in states:
            layer.enable_adapters(not disabled)
        for p, flag in flags:
            p.requires_grad_(flag)


def deep_input_layer(model) -> int | None:
    """Index of the first deep layer (``Ls + Lm``) of a streaming model; None for a dense one."""
    split = getattr(model, "split", None)
    return None if split is None else split[0] + split[1]


@torch.no_grad()
def teacher_forward(model, input_ids, attention_mask=None, document_ids=None,
                    needs: frozenset[str] | set[str] = frozenset({"logits"})) -> TeacherOutput:
    """The frozen backbone's forward on a batch: ``needs`` selects ``logits`` / ``deep_input`` / ``final``.

    ``model`` is a ConceptModel or DenseModel (its ``.backbone`` carries the LoRA adapters, which are
    disabled for the call). Gradients never flow; every layer of the backbone runs, in order.
    """
    backbone = model.backbone
    inner = decoder(backbone)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    pos = packing.time_positions(valid, document_ids)
    # the mask unless plain causal attention is known to be exact: nothing read back (finding out is a host sync)
    plan = CausalPattern(valid, document_ids, causal=attention_mask is None and document_ids is None)
    layers = list(inner.layers)
    at = deep_input_layer(model) if "deep_input" in needs else None
    if "deep_input" in needs and at is None:
        raise ValueError("the deep-stack input exists only for a streaming model (it has a split)")
    out = TeacherOutput(at=at)
    with adapters_disabled(backbone):
        x = inner.embed_tokens(input_ids)
        if at is not None:
            x = run_layers(layers[:at], x, pos, plan, inner.rotary_emb)
            out.deep_input = x
            layers = layers[at:]
            if not {"final", "logits"} & set(needs):  # alignment at the deep input only: stop there
                return out
        x = run_layers(layers, x, pos, plan, inner.rotary_emb)
        if "final" in needs:
            out.final = x
        if "logits" in needs:
            out.logits = backbone.lm_head(inner.norm(x))
    return out
