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

from .packing import deep_block_width


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


def deep_keys(keep: torch.Tensor, emit: int = 1) -> torch.Tensor:
    """[T] keys each token's deep query sees under the one-pass rule (one row, no padding): the
    concepts emitted so far (``emit`` per emitting token), plus for a NULL token its own run
    of tail tokens. With emit > 1 this counts the last of a token's concept slots."""
    keep = keep.bool()
    seg = torch.cumsum(keep.long(), 0) * emit
    t = torch.arange(len(keep))
    last = torch.cummax(torch.where(keep, t, torch.full_like(t, -1)), 0).values
    return torch.where(keep, seg, seg + (t - last))


def concept_keys(keep: torch.Tensor, emit: int = 1) -> torch.Tensor:
    """[T] keys seen by all the concept slots of each token (0 for a NULL token): slot m of an
    emitting token with s emitting tokens before it sees s * emit + m + 1 concepts (middle
    and deep stacks alike)."""
    keep = keep.bool()
    earlier = torch.cumsum(keep.long(), 0) - 1
    return torch.where(keep, emit * emit * earlier + emit * (emit + 1) // 2, torch.zeros_like(earlier))


def deep_pairs(keep: torch.Tensor, emit: int = 1) -> int:
    """Allowed (query, key) pairs of the one-pass deep mask for one row (no padding)."""
    keep = keep.bool()
    return int(torch.where(keep, concept_keys(keep, emit), deep_keys(keep, emit)).sum())


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


def forward_flops(shape: Shape, split: tuple[int, int, int], keep: torch.Tensor, concept_classes: int,
                  emit: int = 1, fusion: float = 0.0, static_slots: int | None = None,
                  deep_block: bool = False) -> FlopReport:
    """FLOPs of one forward over a row with decisions ``keep`` [T] (``emit`` concepts per emitting token), vs the
    dense backbone. ``fusion``: FLOPs of the tail fusion per tail token (counted with the deep stack; a static
    layout fuses its whole tail part, T slots). ``static_slots``: the concept slots of a static layout
    (``ConceptModel.concept_slots(T)``), whose widths its linear layers compute, padding included: the middle stack
    that many slots, the deep stack that many and a tail of T (``packing.pack``), or with ``deep_block`` its
    concepts and tail in one block (``packing.deep_block_width``: T with one concept per boundary); its attention
    counts the real pairs (masked pairs cost an ideal kernel nothing). None: the layout as wide as the decisions.
    ``tests/test_flops_measured.py`` holds the model's own matrix products to these counts."""
    T, C = len(keep), int(keep.sum()) * emit
    n_s, n_m, n_d = split
    causal = lambda n: n * (n + 1) / 2  # noqa: E731
    if static_slots is None:
        middle_width, deep_width = C, T - int(keep.sum()) + C
    else:
        middle_width = static_slots
        deep_width = deep_block_width(T, static_slots, emit) if deep_block else static_slots + T
    lm_head = 2.0 * T * shape.hidden * shape.vocab
    dense = (n_s + n_m + n_d) * (shape.linear(T) + shape.attention(causal(T))) + lm_head
    shallow = n_s * (shape.linear(T) + shape.attention(causal(T)))
    head = 2.0 * T * shape.hidden * concept_classes
    middle = n_m * (shape.linear(middle_width) + shape.attention(causal(C)))
    deep = n_d * (shape.linear(deep_width) + shape.attention(deep_pairs(keep, emit)))
    deep += fusion * (T if static_slots is not None else T - int(keep.sum()))  # (a static tail: T slots)
    return FlopReport(T, C, dense, shallow + head + middle + deep + lm_head, shallow, middle, deep, head)


def fusion_flops(model) -> float:
    """FLOPs per tail token of the model's tail fusion (0 for `none` / `update`)."""
    fusion = getattr(model, "tail_fusion", None)  # (a dense model has none; a streaming one may have None)
    return 0.0 if fusion is None else float(fusion.flops_per_token)


def head_classes(model) -> int:
    """Output classes of the model's ConceptHead (K, +1 with a NULL class)."""
    param = next(model.vocabulary.parameters())
    return model.vocabulary.logits(torch.zeros(1, model.backbone.config.hidden_size, dtype=param.dtype,
                                               device=param.device)).shape[-1]


def ideal_ratio(model, ratio: float, T: int) -> FlopReport:
    """Ideal FLOPs of ``model`` at realised concepts-per-token ``ratio`` and length ``T`` (a boundary
    emits the policy's ``emit`` concepts, each of the vocabulary's ``levels`` code slots)."""
    shape = Shape.from_hf_config(model.backbone.config)
    emit, levels = getattr(model, "emit", 1), getattr(model, "levels", 1)
    return forward_flops(shape, model.split, evenly_spaced_keep(T, ratio * levels / emit), head_classes(model),
                         emit=emit, fusion=fusion_flops(model))


def decode_flops(shape: Shape, split: tuple[int, int, int], keep: torch.Tensor, concept_classes: int,
                 steps: int, emit: int = 1) -> FlopReport:
    """FLOPs of decoding the last ``steps`` tokens of a row with decisions ``keep`` [T], one token
    per step with KV caches, vs the dense backbone with its KV cache. A step runs the middle
    stack only when its token emits concepts (``emit`` of them), and attends to the cached
    entries: every token (shallow), the concepts (middle), the concepts plus the current
    tail (deep)."""
    keep = keep.bool()
    T = len(keep)
    window = slice(T - steps, T)
    seen = float(torch.arange(1, T + 1)[window].sum())  # keys of a causal query at each step
    kept = keep[window]
    slots = int(kept.sum()) * emit
    concept_attention = float(concept_keys(keep, emit)[window].sum())
    tail_attention = float(deep_keys(keep, emit)[window][~kept].sum())
    n_s, n_m, n_d = split
    lm_head = 2.0 * steps * shape.hidden * shape.vocab
    dense = (n_s + n_m + n_d) * (shape.linear(steps) + shape.attention(seen)) + lm_head
    shallow = n_s * (shape.linear(steps) + shape.attention(seen))
    head = 2.0 * steps * shape.hidden * concept_classes
    middle = n_m * (shape.linear(slots) + shape.attention(concept_attention))
    deep = n_d * (shape.linear(steps - int(kept.sum()) + slots) + shape.attention(concept_attention + tail_attention))
    return FlopReport(steps, slots, dense, shallow + head + middle + deep + lm_head, shallow, middle, deep, head)


def pruned_flops(shape: Shape, n_layers: int, T: int) -> float:
    """FLOPs of one forward of the dense backbone cut to ``n_layers`` decoder layers (a causal row of
    length ``T``, LM head included): the pruned FLOP-matched baseline."""
    return n_layers * (shape.linear(T) + shape.attention(T * (T + 1) / 2)) + 2.0 * T * shape.hidden * shape.vocab


@dataclass
class PrunePlan:
    """Which contiguous block of layers the pruned baseline removes, and the FLOPs that gives."""
    removed: tuple[int, int]  # layers [start, stop) are skipped
    num_layers: int  # decoder layers of the backbone
    flop_ratio: float  # pruned / dense forward FLOPs at length T
    target_flop_ratio: float  # the streaming model's ideal / dense at the target ratio
    target_ratio: float | None  # the concept ratio the target stands for (None: a FLOP ratio given as such)
    T: int
    layer_share: float = 0.0  # one decoder layer's FLOPs / dense: the granularity of whole-layer pruning

    @property
    def met(self) -> bool:
        """Within half a layer of the target: always for the FLOP-matched choice, unless the target
        lies outside what one layer .. all layers can reach."""
        return abs(self.flop_ratio - self.target_flop_ratio) <= self.layer_share / 2 + 1e-9

    @property
    def kept(self) -> int:
        return self.num_layers - (self.removed[1] - self.removed[0])

    def to_dict(self) -> dict:
        return {"removed": list(self.removed), "kept_layers": self.kept, "num_layers": self.num_layers,
                "flop_ratio": self.flop_ratio, "target_flop_ratio": self.target_flop_ratio,
                "target_ratio": self.target_ratio, "seq_len": self.T, "target_met": self.met}


def matched_prune(shape: Shape, split: tuple[int, int, int], concept_classes: int, target_ratio: float, T: int,
                  emit: int = 1, removed: tuple[int, int] | None = None) -> PrunePlan:
    """The pruned baseline whose forward FLOPs match the streaming model's ideal FLOPs at ``target_ratio``
    and length ``T`` (concepts evenly spaced): :func:`prune_block` from the start of the middle stack (layers
    Ls .. Ls+n-1, so the pruned model keeps the streaming model's shallow and deep stacks and the end of its
    middle stack). Measured untrained on SmolLM2 (docs/training.md), that position beat a block centred in the
    middle stack or ending at its end. ``removed`` = (start, stop) sets the block by hand instead (its FLOPs are
    still reported)."""
    streaming = forward_flops(shape, split, evenly_spaced_keep(T, target_ratio), concept_classes, emit).concept
    L = sum(split)
    return prune_block(shape, L, T, streaming / pruned_flops(shape, L, T), split[0], removed, target_ratio)


def prune_block(shape: Shape, num_layers: int, T: int, target_flop_ratio: float, first: int,
                removed: tuple[int, int] | None = None, target_ratio: float | None = None) -> PrunePlan:
    """The contiguous block of layers whose removal brings the backbone's forward FLOPs at length ``T`` closest
    to ``target_flop_ratio`` x dense: the whole number of kept layers (at least 1) closest to it, the block
    starting at layer ``first`` (clamped to the layer range). ``removed`` = (start, stop) sets the block by hand
    instead (its FLOPs are still reported). ``target_ratio``: the concept ratio the target stands for, if any."""
    L = num_layers
    dense = pruned_flops(shape, L, T)
    if removed is None:
        goal = target_flop_ratio * dense
        kept = min(range(1, L + 1), key=lambda n: (abs(pruned_flops(shape, n, T) - goal), n))
        n_removed = L - kept
        start = max(0, min(first, L - n_removed))
        removed = (start, start + n_removed)
    kept = L - (removed[1] - removed[0])
    share = (pruned_flops(shape, 1, T) - pruned_flops(shape, 0, T)) / dense
    return PrunePlan(tuple(removed), L, pruned_flops(shape, kept, T) / dense, target_flop_ratio, target_ratio, T,
                     share)
