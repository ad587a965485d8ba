"""Ideal FLOP counts: what the concept model should cost relative to the dense backbone.

Counts multiply-adds as 2 FLOPs for every matmul of a decoder layer (q, k, v, o
projections; gate, up, down MLP) and attention as ``4 * pairs * heads * head_dim`` where
``pairs`` is the number of allowed (query, key) pairs: ``T(T+1)/2`` for causal attention,
and the exact count of the one-pass rule for the deep stack. "Ideal" means a kernel that
skips every masked pair; measured speed-ups are reported as a fraction of this.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, cfg) -> "Shape":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.hidden_size, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                   or cfg.num_attention_heads, head_dim, cfg.intermediate_size, cfg.vocab_size)

    def linear(self, n: float) -> float:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2.0 * n * (d * q + 2 * d * kv + q * d + 3 * d * self.intermediate)

    def attention(self, pairs: float) -> float:
        return 4.0 * pairs * self.heads * self.head_dim


def evenly_spaced_keep(T: int, ratio: float) -> torch.Tensor:
    """A keep pattern with floor(ratio*T) concepts spread evenly (one every 1/ratio tokens)."""
    t = torch.arange(T, dtype=torch.float64)
    return torch.floor((t + 1) * ratio) > torch.floor(t * ratio)


def deep_keys(keep: torch.Tensor) -> torch.Tensor:
    """[T] keys each deep query sees under the one-pass rule (one row, no padding): the concepts
    emitted so far, plus for a NULL token its own run of tail tokens."""
    keep = keep.bool()
    seg = torch.cumsum(keep.long(), 0)
    t = torch.arange(len(keep))
    last = torch.cummax(torch.where(keep, t, torch.full_like(t, -1)), 0).values
    return torch.where(keep, seg, seg + (t - last))


def deep_pairs(keep: torch.Tensor) -> int:
    """Allowed (query, key) pairs of the one-pass deep mask for one row (no padding)."""
    return int(deep_keys(keep).sum())


@dataclass
class FlopReport:
    T: int
    concepts: int
    dense: float
    concept: float
    shallow: float
    middle: float
    deep: float
    head: float

    @property
    def ratio(self) -> float:
        """concept / dense FLOPs (lower is better)."""
        return self.concept / self.dense

    @property
    def speedup(self) -> float:
        return self.dense / self.concept

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "speedup": self.speedup}


def forward_flops(shape: Shape, split: tuple[int, int, int], keep: torch.Tensor, concept_classes: int) -> FlopReport:
    """FLOPs of one forward over a row with decisions ``keep`` [T], vs the dense backbone."""
    T, C = len(keep), int(keep.sum())
    n_s, n_m, n_d = split
    causal = lambda n: n * (n + 1) / 2  # noqa: E731
    lm_head = 2.0 * T * shape.hidden * shape.vocab
    dense = (n_s + n_m + n_d) * (shape.linear(T) + shape.attention(causal(T))) + lm_head
    shallow = n_s * (shape.linear(T) + shape.attention(causal(T)))
    head = 2.0 * T * shape.hidden * concept_classes
    middle = n_m * (shape.linear(C) + shape.attention(causal(C)))
    deep = n_d * (shape.linear(T) + shape.attention(deep_pairs(keep)))
    return FlopReport(T, C, dense, shallow + head + middle + deep + lm_head, shallow, middle, deep, head)


def ideal_ratio(model, ratio: float, T: int) -> FlopReport:
    """Ideal FLOPs of ``model`` at realised concepts-per-token ``ratio`` and length ``T``."""
    shape = Shape.from_hf_config(model.backbone.config)
    classes = model.vocabulary.logits(torch.zeros(1, shape.hidden, dtype=next(model.vocabulary.parameters()).dtype)).shape[-1]
    return forward_flops(shape, model.split, evenly_spaced_keep(T, ratio), classes)


def decode_flops(shape: Shape, split: tuple[int, int, int], keep: torch.Tensor, concept_classes: int,
                 steps: int) -> FlopReport:
    """FLOPs of decoding the last ``steps`` tokens of a row with decisions ``keep`` [T], one token
    per step with KV caches, vs the dense backbone with its KV cache. A step runs the middle
    stack only when its token emits a concept, and attends to the cached entries: every token
    (shallow), the concepts (middle), the concepts plus the current tail (deep)."""
    keep = keep.bool()
    T = len(keep)
    window = slice(T - steps, T)
    seen = float(torch.arange(1, T + 1)[window].sum())  # keys of a causal query at each step
    concepts = torch.cumsum(keep.long(), 0)[window]
    kept = keep[window]
    n_s, n_m, n_d = split
    lm_head = 2.0 * steps * shape.hidden * shape.vocab
    dense = (n_s + n_m + n_d) * (shape.linear(steps) + shape.attention(seen)) + lm_head
    shallow = n_s * (shape.linear(steps) + shape.attention(seen))
    head = 2.0 * steps * shape.hidden * concept_classes
    middle = n_m * (shape.linear(int(kept.sum())) + shape.attention(float(concepts[kept].sum())))
    deep = n_d * (shape.linear(steps) + shape.attention(float(deep_keys(keep)[window].sum())))
    return FlopReport(steps, int(kept.sum()), dense, shallow + head + middle + deep + lm_head, shallow, middle, deep, head)
