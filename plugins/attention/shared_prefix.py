"""The `xformers` backend's shared-prefix layout: every key kept once, partial attentions merged
by their log-sum-exps. Memory O(T + C) per deep layer instead of the gathered layout's ~C^2/2 keys.

A query's allowed keys (``concept.packing.allowed``) are split into disjoint sets, each read by one
*partial* attention whose blocks are contiguous runs of queries against contiguous runs of keys
(what xformers' block-diagonal biases express, forward and backward):

- **local**: every real query against its own block, square and causal: a document's concepts
  among themselves, or a tail segment's tokens among themselves. The keys are the queries' own
  slots, so nothing is repeated.
- **prefix level l** (l = 0, 1, ...): a tail query whose segment sees ``p`` concepts of its
  document reads them as the dyadic intervals of ``p``: for every set bit l of p, the 2^l concepts
  ``[(p >> (l+1)) << (l+1), + 2^l)`` (from the document's first concept). Queries sorted by time
  have non-decreasing p, so the queries that share an interval are consecutive, and one level's
  intervals are disjoint: one block per interval, full (not causal), no key read twice.

Each tail query then reads exactly ``[0, p)`` once, through ``popcount(p)`` levels; there are
``bit_length(max p)`` levels in all. Merging: out = sum_i out_i exp(lse_i - lse), lse =
logsumexp_i lse_i. The backward of each partial takes the *merged* output and log-sum-exp (the
softmax over all its keys, restricted to the partial's keys; the split-key attention backward), so
:class:`MergedAttention` saves only q, k, v, the output and one log-sum-exp per query and head;
every partial's gathered copy is transient, at most T queries and T keys.

The partial kernels are pluggable: :class:`ReferencePartials` here (plain torch, the bias
materialised, any device) and xformers' CUDA kernels (``XFormersPartials`` in ``xformers.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from einops import reduce

from concept.components import accumulation_dtype, upcast


@dataclass
class Partial:
    """One partial attention: queries ``q_index`` (flat slots ``b * L + slot``, in block order)
    against keys ``kv_index`` (flat slots, in block order) under ``bias``, an xformers
    ``BlockDiagonalCausalMask`` (square causal blocks) or ``BlockDiagonalMask`` (full blocks)."""

    q_index: torch.Tensor
    kv_index: torch.Tensor
    bias: Any


def prefix_levels(q_index, q_lens, prefix_start, n_prefix) -> list[tuple[torch.Tensor, ...]]:
    """The concept-prefix part of the rule as one partial per bit of the prefix length.

    Inputs are per query block (see ``xformers.query_blocks``): ``prefix_start`` is the flat slot of
    the first concept of the block's document, ``n_prefix`` how many of its concepts the block sees.
    Returns, per level l, ``(q_index, kv_index, q_lens, kv_lens)``: the tail queries with bit l of
    their prefix length set, in runs sharing one interval of 2^l concepts, and those intervals."""
    seen = torch.repeat_interleave(n_prefix, q_lens)  # concepts each query sees
    first = torch.repeat_interleave(prefix_start, q_lens)
    top = int(seen.max()) if seen.numel() else 0
    levels = []
    for level in range(top.bit_length()):
        size = 1 << level
        rows = ((seen >> level) & 1).nonzero().squeeze(1)
        start = first[rows] + ((seen[rows] >> (level + 1)) << (level + 1))  # flat slot of the interval
        new = torch.ones_like(start, dtype=torch.bool)
        new[1:] = start[1:] != start[:-1]
        runs = new.nonzero().squeeze(1)
        q_lens_l = torch.diff(runs, append=runs.new_tensor([rows.numel()]))
        kv_index = (start[runs][:, None] + torch.arange(size, device=start.device)).reshape(-1)
        levels.append((q_index[rows], kv_index, q_lens_l, torch.full_like(q_lens_l, size)))
    return levels


def _keys(key, value, index, heads: int):
    """The keys and values at flat slots ``index``, repeated to the query heads."""
    k, v = key[index], value[index]
    group = heads // key.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return k, v


def _sum_groups(grad, kv_heads: int):
    """A key gradient over the query heads [N, H, hd] back to the KV heads [N, Hkv, hd]."""
    return reduce(upcast(grad), "n (k g) d -> n k d", "sum", k=kv_heads)


def merge(out, lse, rows, part_out, part_lse) -> None:
    """Fold one partial (``part_out`` [M, H, hd], ``part_lse`` [M, H]) into the running ``out``
    (at least float32) and ``lse`` at ``rows`` (each row at most once per partial)."""
    old = lse[rows]
    new = torch.logaddexp(old, part_lse)
    out[rows] = out[rows] * torch.exp(old - new)[..., None] + part_out.to(out.dtype) * torch.exp(part_lse - new)[..., None]
    lse[rows] = new


class MergedAttention(torch.autograd.Function):
    """Attention over the union of the partials' disjoint key sets. query [S, H, hd], key / value
    [S, Hkv, hd] (every flat slot); returns [S, H, hd], zeros at slots no partial queries."""

    @staticmethod
    def forward(ctx, query, key, value, partials: list[Partial], kernels, scale: float):
        S, H, hd = query.shape
        acc = accumulation_dtype(query.dtype)
        out = query.new_zeros(S, H, hd, dtype=acc)
        lse = query.new_full((S, H), float("-inf"), dtype=acc)
        states = []
        for part in partials:
            part_out, part_lse, state = kernels.forward(query[part.q_index], *_keys(key, value, part.kv_index, H),
                                                        part.bias, scale)
            merge(out, lse, part.q_index, part_out, part_lse)
            states.append(state)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.partials, ctx.kernels, ctx.scale, ctx.states = partials, kernels, scale, states
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        query, key, value, out, lse = ctx.saved_tensors
        H, Hkv = query.shape[1], key.shape[1]
        acc = accumulation_dtype(query.dtype)
        dq = torch.zeros_like(query, dtype=acc)
        dk, dv = (torch.zeros_like(key, dtype=acc) for _ in range(2))
        for part, state in zip(ctx.partials, ctx.states):
            rows = part.q_index
            k, v = _keys(key, value, part.kv_index, H)
            gq, gk, gv = ctx.kernels.backward(d_out[rows].contiguous(), out[rows], lse[rows], query[rows], k, v,
                                              part.bias, ctx.scale, state)
            dq.index_add_(0, rows, gq.to(acc))
            dk.index_add_(0, part.kv_index, _sum_groups(gk, Hkv))
            dv.index_add_(0, part.kv_index, _sum_groups(gv, Hkv))
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None


class ReferencePartials:
    """Partial attentions in plain torch, at least float32 math, the bias materialised (O(queries x keys) per
    partial): the shared-prefix layout on any device, and what the CUDA kernels are compared with.
    The backward is the split-key attention backward the kernels compute: P = exp(S - lse) with the
    merged lse, dS = P (dP - rowsum(dO * O)) with the merged output O."""

    @staticmethod
    def _scores(q, k, bias, scale):
        acc = accumulation_dtype(q.dtype)
        mask = bias.materialize((q.shape[0], k.shape[0]), dtype=acc, device=q.device)
        return torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale + mask

    def forward(self, q, k, v, bias, scale):
        scores = self._scores(q, k, bias, scale)
        lse = scores.logsumexp(-1)  # [H, M]: every query has at least one key
        out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), upcast(v))
        return out, lse.T, None

    def backward(self, d_out, out, lse, q, k, v, bias, scale, state=None):
        d_out = upcast(d_out)
        p = torch.exp(self._scores(q, k, bias, scale) - lse.T[..., None])
        dv = torch.einsum("hqk,qhd->khd", p, d_out)
        dp = torch.einsum("qhd,khd->hqk", d_out, upcast(v))
        rowsum = (d_out * upcast(out)).sum(-1).T  # [H, M]
        ds = p * (dp - rowsum[..., None]) * scale
        return torch.einsum("hqk,khd->qhd", ds, upcast(k)), torch.einsum("hqk,qhd->khd", ds, upcast(q)), dv
