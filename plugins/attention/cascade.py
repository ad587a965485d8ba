"""`cascade`: the deep stack's attention built from dense attention kernels, its parts merged by log-sum-exp.

Every pair the one-pass rule allows (``concept.packing.allowed``) falls in exactly one of three parts:

    concepts   concept queries  vs  concept keys            causal (one SDPA call; a document mask when a
                                                            row packs several documents)
    prefix     tail queries     vs  the concept keys        a staircase over the C concept slots: tail query
                                    emitted before them     i sees the first seg_i * emit of them
    local      tail queries     vs  their own segment's     block-diagonal causal: inside a window of the W
                                    tail keys               tail slots before the query (W: the longest run of
                                                            one segment's tail tokens, which a length policy's
                                                            maximum gap bounds)

A concept query's output is its part's. A tail query's two parts have disjoint keys and are merged by their
log-sum-exps (:func:`merge_parts`)::

    lse = logaddexp(lse_prefix, lse_local);  out = out_prefix * exp(lse_prefix - lse) + out_local * exp(lse_local - lse)

**Tiles.** The prefix and local parts run as a few batched dense calls over tiles of equal shape (one kernel
call per tile shape, not one per chunk of queries):

- *prefix*: each row's tail slots in ``prefix_blocks`` query blocks; block j reads the concept keys
  ``[0, w_j)``, ``w_j`` >= the most concepts any of its queries sees, ``granule`` times 2^m or 3 x 2^(m-1)
  (at most C): blocks of one width form one call. A boolean mask (the rule itself) keeps each query to its own
  concepts. Work: about 1.2x the staircase's pairs (the rounding) plus each block's own diagonal, against
  C x (T - C) for one rectangle; keys copied: at most 1.5 x prefix_blocks x C per row, O(rT).
- *local*: tail slots in blocks of ``q`` (>= W, a multiple of ``granule``) reading the ``q + W - 1`` tail slots
  that end with the block, under the rule's mask. Work and memory O(T W).

**Kernels** (``kernel``): the tiles go to a fused attention kernel that returns the log-sum-exp and whose
backward takes the *merged* output and log-sum-exp (the split-key backward, as in ``shared_prefix``):
``auto`` is torch's CPU flash attention on the CPU and torch's memory-efficient (cutlass) attention on CUDA,
both with a mask; ``reference`` is the same tiles in plain torch (scores materialised; tests and debugging).
Grouped-query heads: the query heads of one KV head are folded into a tile's rows, so no key is copied per
query head (the mask is, once per forward, as the bias).

**Memory per layer** O(T + rT): the query tiles (T), the prefix tiles' keys (1.5 x prefix_blocks x C), the
local tiles' keys (about 2T), two float32 merge states of the output's size; the backward keeps q, k, v, the
merged output and one log-sum-exp per query and head. Built once per forward and shared by every layer: the
tiles' indices and masks (one byte per computed pair, about rT^2/2 for the prefix: 5 MB at 8k tokens and
r = 1/8), and, per dtype, the masks as additive biases (the query heads of a KV head folded in: 4 bytes x
3 per pair in float32). The plan costs one host synchronisation per forward (the tile widths, W, and whether
a row packs several documents). With a length policy's default gap bound (16 at r = 1/8) W <= 16 (up to 32
where one segment runs across a document start), so the local tiles keep one or two shapes (16 queries x 32
keys) from forward to forward. Exceptions: the concept part's document mask (C x C) when a row packs several
documents, and a row without concepts, whose tail is one segment (local = dense causal attention).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch
from einops import rearrange

from concept.attention import AttentionPattern, sdpa
from concept.components import accumulation_dtype, upcast
from concept.contracts import AttentionBackend
from concept.packing import PackedLayout, SlotMeta, allowed
from concept.syncs import declared, upload

KERNELS = ("auto", "reference")


@dataclass
class CascadeConfig:
    kernel: str = "auto"  # auto: the device's fused kernel (CPU flash / CUDA memory-efficient); reference: plain torch
    prefix_blocks: int = 16  # query blocks per row for the prefix part (their keys are copied: O(blocks x C))
    granule: int = 16  # tile sizes and key widths are multiples of this (a multiple of 8: CUDA kernels want aligned masks)

    def validate(self) -> list[str]:
        problems = []
        if self.kernel not in KERNELS:
            problems.append(f"kernel: one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.prefix_blocks < 1:
            problems.append(f"prefix_blocks: must be >= 1, got {self.prefix_blocks}")
        if self.granule < 8 or self.granule % 8:
            problems.append(f"granule: a multiple of 8, got {self.granule}")
        return problems


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _units(n: int) -> int:
    """The smallest 2^m or 3 * 2^(m - 1) >= n: two widths per octave (at most 1.5x the keys needed, 1.2x on average
    over a staircase), few enough to keep the calls few."""
    m = max(0, n - 1).bit_length()
    return 3 << (m - 2) if m >= 2 and 3 << (m - 2) >= n else 1 << m


@dataclass
class Tiles:
    """One batched call: ``n`` tiles of ``Lq`` queries against ``Lk`` keys (flat slots ``b * L + slot``)."""

    q_index: torch.Tensor  # [n, Lq] query slots (clamped into the row: rows past its tail are not real)
    k_index: torch.Tensor  # [n, Lk] key slots
    mask: torch.Tensor  # [n, Lq, Lk] bool: the rule (a row no key may see is all True, and does not count)
    counts: torch.Tensor  # [n, Lq] bool: the row's result is real and has a key (else it is dropped)
    q_tail: torch.Tensor  # [n, Lq] every query's flat tail row (b * (L - C) + slot - C)
    target: torch.Tensor  # [n * Lq] where each row's result goes: its tail row, or past the last one (dropped)
    biases: dict  # (dtype, query heads per KV head) -> additive mask [n, 1, groups * Lq, Lk], made once per forward

    def bias(self, dtype, groups: int) -> torch.Tensor:
        """The mask as an additive bias for the query heads of one KV head folded into the rows (:func:`_queries`)."""
        if (dtype, groups) not in self.biases:
            n, lq, lk = self.mask.shape
            mask = self.mask[:, None].expand(n, groups, lq, lk).reshape(n, 1, groups * lq, lk)
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            self.biases[dtype, groups] = torch.where(mask, zero, torch.full_like(zero, float("-inf")))
        return self.biases[dtype, groups]

    def row_weights(self, dtype, groups: int) -> torch.Tensor:
        """1 for the rows that count, 0 for the others, in the folded layout [n, 1, groups * Lq, 1]."""
        n, lq = self.counts.shape
        return self.counts[:, None, None].expand(n, 1, groups, lq).reshape(n, 1, groups * lq, 1).to(dtype)


def _flat(meta: SlotMeta) -> SlotMeta:
    return SlotMeta(*(None if t is None else t.reshape(-1) for t in (meta.time, meta.keep, meta.seg, meta.valid,
                                                                      meta.doc, meta.sub)))


def _tiles(flat: SlotMeta, B: int, L: int, C: int, q_index, q_real, k_index, k_real) -> Tiles:
    """Tiles from their query / key slots; ``q_real`` / ``k_real`` mark the positions inside the range they
    stand for (a clamped index past it is not a key and not a result). A row counts when it is real and has
    an allowed key. No host synchronisation."""
    mask = allowed(flat[q_index], flat[k_index]) & k_real[:, None, :]
    counts = q_real & mask.any(-1)
    mask = mask | ~counts[..., None]  # rows that do not count read every key: finite, then dropped
    q_tail = (q_index // L) * (L - C) + q_index % L - C
    target = torch.where(counts, q_tail, B * (L - C)).reshape(-1)
    return Tiles(q_index, k_index, mask, counts, q_tail, target, {})


class CascadePattern(AttentionPattern):
    settings = ("config",)  # (a pytree context: AttentionPattern)

    def __init__(self, layout: PackedLayout, config: CascadeConfig):
        meta = layout.meta
        self.B, self.L = meta.time.shape
        self.C = C = layout.num_concepts
        self.Tt = Tt = self.L - C
        self.config = config
        device = meta.time.device
        g = config.granule
        tail, concepts = layout.tail_meta, layout.concept_meta
        # the one host synchronisation: whether a row packs several documents (the concept part's mask), W (the
        # longest run of one segment's tail slots) and each prefix block's most visible concepts
        several_docs = (concepts.doc != concepts.doc[:, :1]).any() if C else torch.zeros((), dtype=torch.bool,
                                                                                         device=device)
        seg = tail.seg.contiguous()
        run = torch.arange(Tt, device=device) - torch.searchsorted(seg, seg) + 1
        window = torch.where(tail.valid, run, torch.zeros_like(run)).amax() if Tt else torch.zeros((), device=device)
        q_prefix = max(g, _round_up(math.ceil(Tt / config.prefix_blocks), g))
        blocks = -(-Tt // q_prefix)
        visible = torch.where(tail.valid, (tail.seg * layout.emit).clamp(max=C), torch.zeros_like(tail.seg))
        hi = torch.nn.functional.pad(visible, (0, blocks * q_prefix - Tt)).view(self.B, blocks, q_prefix).amax(-1)
        with declared("cascade tile plan"):  # the tiles' widths are shapes: read once per plan, in one copy
            numbers = torch.cat([several_docs.long().reshape(1), window.long().reshape(1), hi.reshape(-1)]).tolist()
        W, hi_list = max(1, numbers[1]), numbers[2:]
        # concept part: causal; with several documents in a row, only their own
        self.concept_mask = allowed(concepts, concepts) if numbers[0] else None
        self.parts: list[Tiles] = []  # the local part first (every tail row counts there), then the prefix's
        if not Tt:
            return
        flat = _flat(meta)
        row_base = (torch.arange(self.B, device=device) * self.L)[:, None, None]

        # local: blocks of q >= W tail slots, each reading the q + W - 1 tail slots that end with it (one tile
        # of every tail slot when that is the whole tail)
        q_local = _round_up(W, g)
        if q_local + W - 1 >= Tt:
            q_local = width = _round_up(Tt, g)
        else:
            width = _round_up(q_local + W - 1, g)
        n_local = -(-Tt // q_local)
        pos_q = (torch.arange(n_local, device=device)[:, None] * q_local + torch.arange(q_local, device=device))[None]
        start = (torch.arange(n_local, device=device)[:, None] + 1) * q_local - width  # < 0: the window starts at 0
        pos_k = (start.clamp(min=0) + torch.arange(width, device=device))[None]
        q_real, k_real = (pos_q < Tt).expand(self.B, -1, -1), (pos_k < Tt).expand(self.B, -1, -1)
        self.parts.append(_tiles(flat, self.B, self.L, C, (row_base + C + pos_q.clamp(max=Tt - 1)).reshape(-1, q_local),
                                 q_real.reshape(-1, q_local),
                                 (row_base + C + pos_k.clamp(max=Tt - 1)).reshape(-1, width),
                                 k_real.reshape(-1, width)))

        # prefix: a block reads the concept keys [0, w) of its row, w >= the most any of its queries sees (the
        # granule times 2^m or 3 x 2^(m-1), at most C rounded up): one call per width
        if not C:
            return
        by_width: dict[int, list[tuple[int, int]]] = {}
        for flat_block, top in enumerate(hi_list):
            if top > 0:
                w = min(_round_up(C, g), g * _units(-(-top // g)))
                by_width.setdefault(w, []).append((flat_block // blocks, flat_block % blocks))
        for w, members in sorted(by_width.items()):
            b, j = upload(members, torch.long, device).unbind(1)  # one non-blocking copy, no sync
            pos_q = j[:, None] * q_prefix + torch.arange(q_prefix, device=device)
            keys = torch.arange(w, device=device).expand(len(members), -1)
            self.parts.append(_tiles(flat, self.B, self.L, C, b[:, None] * self.L + C + pos_q.clamp(max=Tt - 1),
                                     pos_q < Tt,
                                     b[:, None] * self.L + keys.clamp(max=C - 1), keys < C))

    def __call__(self, query, key, value, scaling):
        B, H, L, hd = query.shape
        C = self.C
        outs = []
        if C:
            outs.append(rearrange(sdpa(query[:, :, :C], key[:, :, :C], value[:, :, :C], scaling, self.concept_mask,
                             is_causal=self.concept_mask is None), "b h l d -> b l h d"))
        if self.Tt:
            kernels = ReferenceKernel() if self.config.kernel == "reference" else device_kernel(query.device)
            device = query.device.type
            if torch.is_autocast_enabled(device):  # one dtype for the kernels, as autocast gives SDPA
                dtype = torch.get_autocast_dtype(device)
                query, key, value = (t.to(dtype) for t in (query, key, value))
            outs.append(MergedTiles.apply(query, key, value, self, kernels, scaling).view(B, self.Tt, H, hd))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _flat_heads(x):
    """[B, H, L, hd] -> [B * L, H, hd]."""
    return rearrange(x, "b h l d -> (b l) h d")


def _queries(flat, index, kv_heads: int):
    """Query tiles from flat [B * L, H, ...] at ``index`` [n, Lq], the query heads of one KV head folded into
    the rows: [n, Hkv, groups * Lq, ...] (grouped-query attention against the KV heads, no key copied)."""
    return rearrange(flat[index], "n q (k g) ... -> n k (g q) ...", k=kv_heads)


def _unfold(tile, lq: int):
    """[n, Hkv, groups * Lq, ...] -> [n * Lq, H, ...]: :func:`_queries` undone, one row per query."""
    return rearrange(tile, "n k (g q) ... -> (n q) (k g) ...", q=lq)


def _keys(flat, index):
    """Key / value tiles [n, Hkv, Lk, hd] from flat [B * L, Hkv, hd] at ``index`` [n, Lk]."""
    return rearrange(flat[index], "n l k d -> n k l d")


def merge_parts(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint key sets from each's output [R, H, hd] and log-sum-exp [R, H] (``lse_a``
    finite): ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``; on CUDA
    xformers' fused ``merge_attentions`` where its kernels load (:func:`xformers_merge`)."""
    fused = xformers_merge() if out_a.is_cuda else None
    if fused is not None:
        try:
            out, lse = fused([out_a[None], out_b[None]], [lse_a.T[None], lse_b.T[None]], write_lse=True,
                             output_dtype=out_a.dtype)
            return out[0], lse[0].T.to(lse_a.dtype)
        except Exception as exc:  # a fast path only: the same merge in torch below, and never again this process
            warnings.warn(f"cascade: xformers' merge_attentions failed ({type(exc).__name__}: {exc}); merging in torch")
            xformers_merge.cache_clear()
            _MERGE_FAILED.append(exc)
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


_MERGE_FAILED: list = []  # xformers' merge failed once in this process: torch's from then on


@lru_cache(maxsize=None)
def xformers_merge():
    """xformers' ``merge_attentions`` (a fused Triton merge) where xformers' CUDA kernels load, else None."""
    if _MERGE_FAILED:
        return None
    try:
        # lazy: xformers (slow to import, and it warns on a build for another torch) only where a CUDA merge asks
        from .xformers import _fmha, kernel_unavailable

        return None if kernel_unavailable() else _fmha().merge_attentions
    except Exception:  # no xformers, or one that does not import here: the three lines of torch
        return None


class MergedTiles(torch.autograd.Function):
    """The tail queries' attention over the union of the parts' disjoint key sets (``CascadePattern.parts``):
    the local part's output and log-sum-exp for every tail row, the prefix tiles' for theirs, merged by
    :func:`merge_parts`. Saves q, k, v, the merged output and log-sum-exp; the backward runs each part's
    kernel backward with the merged output and log-sum-exp and adds the gradients up. Returns [B * (L - C), H,
    hd], the tail rows."""

    @staticmethod
    def forward(ctx, query, key, value, plan: CascadePattern, kernels, scale: float):
        B, H, L, hd = query.shape
        Hkv, groups = key.shape[1], H // key.shape[1]
        q, k, v = (_flat_heads(t) for t in (query, key, value))
        acc = accumulation_dtype(query.dtype)
        rows = B * plan.Tt  # the tail rows; one more, past them, takes the results of rows that do not count
        found, states = [], []  # (out, lse) of the local part, then of the prefix (a tail row at most once in each)
        for tiles in plan.parts:
            if len(found) < 2:
                found.append((q.new_zeros(rows + 1, H, hd, dtype=acc), q.new_full((rows + 1, H), float("-inf"), dtype=acc)))
            lq = tiles.q_index.shape[1]
            part_out, part_lse, state = kernels.forward(_queries(q, tiles.q_index, Hkv), _keys(k, tiles.k_index),
                                                        _keys(v, tiles.k_index), tiles.bias(query.dtype, groups), scale)
            out_acc, lse_acc = found[-1]
            out_acc.index_copy_(0, tiles.target, _unfold(part_out, lq).to(acc))
            lse_acc.index_copy_(0, tiles.target, _unfold(part_lse, lq).to(acc))
            states.append(state)
        found = [(o[:rows], l[:rows]) for o, l in found]
        out, lse = merge_parts(*found[0], *found[1]) if len(found) > 1 else found[0]
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.kernels, ctx.scale, ctx.states = plan, kernels, scale, states
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        query, key, value, out, lse = ctx.saved_tensors
        B, H, L, hd = query.shape
        Hkv, groups = key.shape[1], H // key.shape[1]
        q, k, v = (_flat_heads(t) for t in (query, key, value))
        acc = accumulation_dtype(query.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        dk, dv = (torch.zeros_like(k, dtype=acc) for _ in range(2))
        for tiles, state in zip(ctx.plan.parts, ctx.states):
            lq = tiles.q_index.shape[1]
            weight = tiles.row_weights(d_out.dtype, groups)  # rows that do not count give nothing
            # rows that do not count: lse = +inf, so that their probabilities are 0 (their gradient is 0 anyway)
            lse_t = torch.where(weight[..., 0] > 0, _queries(lse, tiles.q_tail, Hkv), float("inf"))
            gq, gk, gv = ctx.kernels.backward(_queries(d_out, tiles.q_tail, Hkv) * weight,
                                              _queries(q, tiles.q_index, Hkv), _keys(k, tiles.k_index),
                                              _keys(v, tiles.k_index), _queries(out, tiles.q_tail, Hkv), lse_t,
                                              tiles.bias(query.dtype, groups), ctx.scale, state)
            dq.index_add_(0, tiles.q_index.reshape(-1), upcast(_unfold(gq, lq)))
            dk.index_add_(0, tiles.k_index.reshape(-1), rearrange(upcast(gk), "n k l d -> (n l) k d"))
            dv.index_add_(0, tiles.k_index.reshape(-1), rearrange(upcast(gv), "n k l d -> (n l) k d"))
        back = lambda g, like: rearrange(g, "(b l) h d -> b h l d", b=B).to(like.dtype)  # noqa: E731
        return back(dq, query), back(dk, key), back(dv, value), None, None, None


# -- kernels: forward -> (out [n, H, Lq, hd], lse [n, H, Lq] float, state); backward with the merged out, lse ---
class ReferenceKernel:
    """Plain torch, scores materialised, at least float32 math (float64 for float64): any device."""

    @staticmethod
    def _scores(q, k, bias, scale):
        acc = accumulation_dtype(q.dtype)
        return torch.einsum("nhqd,nhkd->nhqk", q.to(acc), k.to(acc)) * scale + bias.to(acc)

    def forward(self, q, k, v, bias, scale):
        scores = self._scores(q, k, bias, scale)
        lse = scores.logsumexp(-1)
        out = torch.einsum("nhqk,nhkd->nhqd", torch.exp(scores - lse[..., None]), upcast(v))
        return out.to(q.dtype), lse, None

    def backward(self, d_out, q, k, v, out, lse, bias, scale, state=None):
        d_out = upcast(d_out)
        p = torch.exp(self._scores(q, k, bias, scale) - lse[..., None].to(d_out.dtype))
        dv = torch.einsum("nhqk,nhqd->nhkd", p, d_out)
        dp = torch.einsum("nhqd,nhkd->nhqk", d_out, upcast(v))
        ds = p * (dp - (d_out * upcast(out)).sum(-1, keepdim=True)) * scale
        return (torch.einsum("nhqk,nhkd->nhqd", ds, upcast(k)), torch.einsum("nhqk,nhqd->nhkd", ds, upcast(q)), dv)


def _like(bias, q):
    """The additive mask in the kernel's dtype (the CPU flash kernel takes one dtype; -inf stays -inf)."""
    return bias if bias is None or bias.dtype == q.dtype else bias.to(q.dtype)


class CPUFlashKernel:
    """torch's CPU flash attention (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward):
    a mask, the log-sum-exp, any float dtype."""

    def forward(self, q, k, v, bias, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                             attn_mask=_like(bias, q), scale=scale)
        return out, lse, None

    def backward(self, d_out, q, k, v, out, lse, bias, scale, state=None):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out.contiguous(), q, k, v, out.contiguous(), lse.float().contiguous() if q.dtype != torch.float64
            else lse.contiguous(), 0.0, False, attn_mask=_like(bias, q), scale=scale)


class CUDAEfficientKernel:
    """torch's memory-efficient (cutlass) CUDA attention (``aten::_scaled_dot_product_efficient_attention`` and
    its backward): a mask, the log-sum-exp (its rows padded to a multiple of 32), fp32 / bf16 / fp16. The backward
    is given the merged output in the layout the forward returns its own (:func:`_heads_inner`). The operators are
    attributes so that a test can stand in for them on a machine without CUDA (tests/cuda_kernel_standin.py
    keeps to the kernels' memory contract)."""

    forward_op = staticmethod(lambda *a, **kw: torch.ops.aten._scaled_dot_product_efficient_attention(*a, **kw))
    backward_op = staticmethod(lambda *a, **kw: torch.ops.aten._scaled_dot_product_efficient_attention_backward(*a, **kw))

    def forward(self, q, k, v, bias, scale):
        bias = bias.expand(-1, q.shape[1], -1, -1)
        out, lse, seed, offset = self.forward_op(q, k, v, bias, True, 0.0, False, scale=scale)
        return out, lse[..., : q.shape[2]], (seed, offset, lse.shape)

    def backward(self, d_out, q, k, v, out, lse, bias, scale, state):
        seed, offset, lse_shape = state
        padded = lse.new_zeros(lse_shape)
        padded[..., : q.shape[2]] = lse
        grads = self.backward_op(d_out.contiguous(), q, k, v, bias.expand(-1, q.shape[1], -1, -1), _heads_inner(out),
                                 padded, seed, offset, 0.0, [True, True, True, False], False, scale=scale)
        return grads[0], grads[1], grads[2]


def _heads_inner(x):
    """``x`` [n, H, M, hd] stored as [n, M, H, hd] (a view with the same shape): the layout in which the kernel's
    backward reads the forward's output. It takes that output's batch and head strides but assumes its row
    stride to be H x hd (cutlass ``o_strideM``), so an output stored [n, H, M, hd] is read at wrong rows, past
    its end for the last heads (uninitialised memory), whenever H > 1. Only the half-precision kernels read it
    (they compute rowsum(dO * O) themselves; in float32 torch does, with the true strides)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def device_kernel(device):
    return CUDAEfficientKernel() if torch.device(device).type == "cuda" else CPUFlashKernel()


class CascadeBackend(AttentionBackend):
    Config = CascadeConfig
    supports_backward = True

    def __init__(self, config: CascadeConfig | None = None, ctx=None):
        self.config = config or CascadeConfig()

    def plan(self, layout: PackedLayout) -> AttentionPattern:
        return CascadePattern(layout, self.config)
