"""`chunked`: block-sparse attention over the concepts-first layout, with plain SDPA calls.

1. Concept queries attend causally to concept keys: one causal SDPA over the concept block.
2. Tail queries, ``chunk`` at a time, attend to [the concept prefix visible to the chunk ;
   the tail keys from the start of the chunk's first segment up to the chunk's end], with a
   small boolean mask from the one-pass rule for exactness.

Keys outside those ranges are never allowed by the rule, so the result equals the dense
reference while skipping most of the T x T tiles: the deep attention cost falls from
~T^2/2 to ~C^2/2 + (T - C) * (C/2 + chunk + segment length).

A static layout (``PackedLayout.static``, the build's ``max_ratio``) is planned without reading anything
back to the host: a chunk of tail queries ``[a, b)`` attends to every concept slot and the tail slots
``[0, b)`` (the rule masks the rest), and the concept block's queries join the first chunk's call (their
keys are a prefix of its keys; the rule masks the tail ones): one SDPA call per chunk. The
ranges are then functions of the shapes alone (one compiled graph, no sync), at the cost of the tail
segment windows: ~T^2/2 tail-to-tail pairs instead of ~T * segment. A static layout's deep block
(``concept.packing.DeepBlock``: concepts and tail in one block, the boundary per row) is planned the same way,
with no concept part of its own: chunk ``[a, b)`` of its slots sees the slots ``[0, b)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from concept.attention import AttentionPattern, additive, sdpa
from concept.contracts import AttentionBackend
from concept.packing import PackedLayout, RuleBlocks, allowed


@dataclass
class ChunkedConfig:
    chunk: int = 128  # tail queries per SDPA call

    def validate(self) -> list[str]:
        return [] if self.chunk >= 1 else [f"chunk: must be >= 1, got {self.chunk}"]


class ChunkedPattern(AttentionPattern):
    merged = False  # whether the concept block's queries are in the first chunk's call (a static layout)

    def __init__(self, layout: PackedLayout, chunk: int):
        C = self.num_concepts = layout.num_concepts
        if layout.static:
            self._static(layout, chunk)
            return
        meta, tail = layout.meta, layout.tail_meta
        # Concepts attend causally to concepts; with several packed documents, only their own.
        concepts = layout.concept_meta
        several_docs = bool((concepts.doc != concepts.doc[:, :1]).any()) if C else False
        self.concept_mask = additive(allowed(concepts, concepts)) if several_docs else None
        num_tail = tail.time.shape[1]
        device = meta.time.device
        # Tail slot -> first tail slot of its segment (tail segments are sorted per row).
        seg = tail.seg.contiguous()
        start = torch.searchsorted(seg, seg)
        visible = torch.where(tail.valid, tail.seg * layout.emit, torch.zeros_like(tail.seg))  # concept slots before it
        starts = torch.where(tail.valid, start, torch.full_like(start, num_tail))
        bounds = list(range(0, num_tail, chunk))
        # per-chunk key ranges, computed for all chunks at once (one host sync for both)
        pad = (-num_tail) % chunk
        vis = torch.nn.functional.pad(visible, (0, pad)).view(visible.shape[0], -1, chunk).amax(dim=(0, 2))
        lo = torch.nn.functional.pad(starts, (0, pad), value=num_tail).view(starts.shape[0], -1, chunk).amin(dim=(0, 2))
        self.chunks = []
        vis_lo = torch.stack([vis, lo]).tolist() if bounds else [[], []]
        for a, hc, first in zip(bounds, *vis_lo):
            b = min(a + chunk, num_tail)
            first = min(first, a)
            keys = torch.cat([torch.arange(hc, device=device), torch.arange(C + first, C + b, device=device)])
            mask = additive(allowed(meta[:, C + a: C + b], meta[:, keys]))
            self.chunks.append((C + a, C + b, hc, C + first, mask))

    def _static(self, layout: PackedLayout, chunk: int) -> None:
        """Ranges from the shapes alone: chunk [a, b) of the tail sees slots [0, C + b). The concept block's
        keys [0, C) lie inside the first chunk's, so its queries join that chunk's call (slots [0, C + b0)
        with the rule's mask: a concept never sees a tail slot): one SDPA call less per layer."""
        C = self.num_concepts
        rule = RuleBlocks(layout.meta)  # (each chunk's mask: the rule's slices of per-slot parts built once)
        self.concept_mask = None
        self.chunks = []
        for a in range(0, layout.length - C, chunk):
            b = min(a + chunk, layout.length - C)
            qa = C + a if a else 0  # (the first chunk's queries start with the concept block's)
            self.chunks.append((qa, C + b, 0, 0, additive(rule(qa, C + b, C + b))))
        if C and not self.chunks:  # (no tail slots: the concept block alone)
            self.chunks.append((0, C, 0, 0, additive(rule(0, C, C))))
        self.merged = True

    def __call__(self, query, key, value, scaling):
        C = 0 if self.merged else self.num_concepts  # (a static plan's chunks hold the concept block)
        # the query blocks partition the slots: one split (its backward one cat, not a zero-filled copy per block)
        sizes = ([C] if C else []) + [qb - qa for qa, qb, *_ in self.chunks]
        blocks = query.split(sizes, dim=2) if len(sizes) > 1 else (query,)
        outs = []
        if C:
            outs.append(sdpa(blocks[0], key[:, :, :C], value[:, :, :C], scaling, self.concept_mask,
                             is_causal=self.concept_mask is None))
        for q, (qa, qb, hc, ka, mask) in zip(blocks[1:] if C else blocks, self.chunks):
            if hc == 0 or ka == hc:  # one range of keys (every chunk of a static layout): a view, no copy
                first = ka if hc == 0 else 0
                whole = first == 0 and qb == key.shape[2]  # (all of them: the tensors themselves)
                k, v = (key, value) if whole else (key[:, :, first:qb], value[:, :, first:qb])
            else:
                k = torch.cat([key[:, :, :hc], key[:, :, ka:qb]], dim=2)
                v = torch.cat([value[:, :, :hc], value[:, :, ka:qb]], dim=2)
            outs.append(sdpa(q, k, v, scaling, mask))
        if len(outs) == 1:  # (one call: e.g. a static layout of at most one chunk of tail slots)
            return outs[0].transpose(1, 2)
        return torch.cat([out.transpose(1, 2) for out in outs], dim=1)  # [B, L, H, hd], contiguous: one copy


class ChunkedBackend(AttentionBackend):
    Config = ChunkedConfig
    supports_backward = True
    plans_deep_block = True  # (a static layout's plan: the block's slots are chunks like any others)

    def __init__(self, config: ChunkedConfig | None = None, ctx=None):
        self.config = config or ChunkedConfig()

    def plan(self, layout: PackedLayout) -> AttentionPattern:
        return ChunkedPattern(layout, self.config.chunk)
