"""`flex`: FlexAttention over the concepts-first layout, with the one-pass rule as a ``mask_mod``.

The mask is never materialised as T x T: ``mask_mod`` reads O(T) per-slot metadata (time,
keep, segment, slot index, validity, document) and ``create_block_mask`` builds a BlockMask
that skips every fully masked 128 x 128 tile, which in the concepts-first layout is most of
the tail-to-tail and every concept-to-tail tile. Exact against the dense reference (tests).

Devices: on CUDA, forward and backward run as fused kernels (``torch.compile``). On CPU,
torch compiles a forward kernel too, but FlexAttention has no backward there: a training
forward on CPU is refused with the reason (use ``chunked``). ``compile = false`` runs
FlexAttention eagerly (it then materialises the scores; meant for tests and debugging).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch

from concept.attention import AttentionPlan
from concept.errors import ConceptError
from concept.packing import PackedLayout

NO_CPU_BACKWARD = ("torch's FlexAttention has no backward pass on CPU; train with --attention chunked "
                   "(or sdpa), or on a CUDA device")


@dataclass
class FlexConfig:
    compile: bool = True  # fused kernels via torch.compile (eager FlexAttention otherwise)
    block: int = 128  # BlockMask tile size

    def validate(self) -> list[str]:
        return [] if self.block >= 16 and self.block % 16 == 0 else [f"block: a multiple of 16, got {self.block}"]


@lru_cache(maxsize=None)
def _compiled_flex(dynamic: bool):
    """FlexAttention compiled once per process: with symbolic shapes on CUDA (one kernel for every packed
    length); on CPU with static ones, since torch's CPU template generates C++ that does not compile for
    a recompile with symbolic sizes (torch 2.13: "cur_kvSplitSize0 was not declared"), so each new shape
    compiles its own kernel there."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


class FlexPlan(AttentionPlan):
    def __init__(self, layout: PackedLayout, config: FlexConfig):
        from torch.nn.attention.flex_attention import create_block_mask

        meta = layout.meta
        time, keep, seg, valid, doc = meta.time, meta.keep, meta.seg, meta.valid, meta.doc
        sub = meta.sub if meta.sub is not None else torch.zeros_like(time)
        self.config = config

        def mask_mod(b, h, q, k):  # the rule of concept.packing.allowed, one (query, key) pair at a time
            t_q, t_k = time[b, q], time[b, k]
            earlier = (t_k < t_q) | ((t_k == t_q) & (sub[b, k] <= sub[b, q]))
            visible = keep[b, k] | (~keep[b, q] & (seg[b, q] == seg[b, k]))
            return (earlier & visible & (doc[b, q] == doc[b, k]) & valid[b, k]) | ~valid[b, q]

        B, L = time.shape
        self.block_mask = create_block_mask(mask_mod, B, None, L, L, device=time.device,
                                            BLOCK_SIZE=config.block, _compile=config.compile)

    def __call__(self, query, key, value, scaling):
        from torch.nn.attention.flex_attention import flex_attention

        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise ConceptError(f"attention 'flex': {NO_CPU_BACKWARD}")
        gqa = query.shape[1] != key.shape[1]
        if self.config.compile:
            flex = _compiled_flex(query.device.type != "cpu")
            out = flex(query, key, value, block_mask=self.block_mask, scale=scaling, enable_gqa=gqa)
        else:
            with warnings.catch_warnings():  # eager on purpose: "without torch.compile()" is not news here
                warnings.simplefilter("ignore")
                out = flex_attention(query, key, value, block_mask=self.block_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2)


class FlexBackend:
    Config = FlexConfig

    def __init__(self, config: FlexConfig | None = None, ctx=None):
        self.config = config or FlexConfig()

    @property
    def supports_backward(self) -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def unavailable_reason() -> str:
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as exc:  # torch older than 2.5
            return f"FlexAttention is not in this torch ({exc})"
        return "" if torch.cuda.is_available() else f"no CUDA device: forward only ({NO_CPU_BACKWARD})"

    @staticmethod
    def check_trainable(device) -> str:
        return NO_CPU_BACKWARD if torch.device(device).type == "cpu" else ""

    def plan(self, layout: PackedLayout) -> AttentionPlan:
        return FlexPlan(layout, self.config)
