"""`xformers`: the deep stack's one-pass rule as xformers block-diagonal attention calls (CUDA).

The valid slots of the packed layout are flattened into one row of query blocks (xformers'
block-diagonal biases want batch 1, BMHK): one document's concepts, or one segment of one
document's tail tokens. Two layouts give the blocks their keys; both are exactly the one-pass rule
(docs/architecture.md, ``concept.packing.allowed``): concepts causal among themselves, a tail token sees every
concept of its document up to its time and its own segment causally, documents never mix, padding
is never a key. Padding queries are left out (their outputs are zeros, and are never read).

**gathered** (one kernel call): each block gets its own copy of its keys,

    a document's concepts          queries c_0 .. c_{n-1}    keys c_0 .. c_{n-1}             (square, causal)
    one segment of a document's    queries x_a .. x_b        keys [ the document's concepts
    tail tokens                                                    up to the segment ;
                                                                  x_a .. x_b ]               (causal from bottom right)

under ``BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, kv_lens)``. The gathered keys
repeat each segment's concept prefix: about C^2/2 per document, K/V memory that grows as r^2 T^2.

**shared** (``shared_prefix.py``): every key once. A local partial (each block against itself,
square causal) plus one partial per bit of the prefix length (a tail segment reads its document's
concepts as dyadic intervals, each interval once per level), merged by their log-sum-exps:
``1 + log2(C)`` kernel calls, O(T + C) memory.

**Which** (``layout``): ``auto`` takes the gathered layout while its K/V of one deep layer is at most
``gathered_max_mib`` (and within ``memory_limit_gib``), the shared one otherwise; ``gathered`` and
``shared`` force one. ``memory_limit_gib`` (0: half the free CUDA memory, divided by the deep layers
when training) refuses a forced gathered layout that would not fit. The choice is made once per
forward, at its first deep layer, and shared by every layer, as are the blocks: index arithmetic
on the layout's device, the block lengths as Python lists (a host sync, and xformers checks every
block in Python: O(blocks) host work). ``docs/benchmarks.md`` counts both layouts' memory.

Kernels: xformers' CUDA kernels (cutlass for fp32, flash / cutlass for bf16 and fp16). Grouped-
query heads: gathered forward-only calls use xformers' 5-D (BMGHK) layout without copying; 5-D has
no backward, so training repeats K/V to the query heads, and so does the shared layout (per partial,
a transient copy). ``kernel = "reference"`` runs the same layouts in plain torch with the
*materialised* biases on any device (O(queries x keys) memory): the slow, obviously correct path
the tests compare against, and a debugging aid.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
from einops import rearrange

from concept.attention import AttentionPattern
from concept.components import accumulation_dtype
from concept.contracts import AttentionBackend
from concept.errors import ConceptError
from concept.packing import PackedLayout

from .shared_prefix import MergedAttention, Partial, ReferencePartials, prefix_levels

KERNELS = ("xformers", "reference")
LAYOUTS = ("auto", "gathered", "shared")
INSTEAD = "use --attention flex (CUDA) or chunked (any device)"


@dataclass
class XFormersConfig:
    kernel: str = "xformers"  # "reference": the same layouts, biases materialised, in plain torch (tests, debugging)
    layout: str = "auto"  # "gathered" (prefix copied per segment), "shared" (one copy, merged partials), or by size
    gathered_max_mib: float = 256.0  # auto: the gathered layout while its K/V of one deep layer is at most this
    memory_limit_gib: float = 0.0  # gathered K/V of one deep layer; 0 = auto (a share of free CUDA memory)

    def validate(self) -> list[str]:
        problems = []
        if self.kernel not in KERNELS:
            problems.append(f"kernel: one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.layout not in LAYOUTS:
            problems.append(f"layout: one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not self.gathered_max_mib >= 0:
            problems.append(f"gathered_max_mib: >= 0, got {self.gathered_max_mib}")
        if not self.memory_limit_gib >= 0:
            problems.append(f"memory_limit_gib: >= 0 (0 = auto), got {self.memory_limit_gib}")
        return problems


@lru_cache(maxsize=None)
def _fmha():
    """xformers' fmha module, imported quietly (a CPU-only or mismatched build logs a warning about
    its C++ extensions on import; what matters here is reported by :func:`kernel_unavailable`)."""
    log = logging.getLogger("xformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from xformers.ops import fmha
    finally:
        log.setLevel(level)
    return fmha


PROBE_DEVICE = "cuda"  # where :func:`kernel_unavailable` runs its probe (the tests run it on the CPU)


def kernel_unavailable() -> str:
    """Why xformers' attention kernels cannot run on this machine ('' if they can): a tiny call of the
    kind the backend makes, answered by xformers' own dispatch (:func:`probe`)."""
    try:
        fmha = _fmha()
    except ImportError as exc:
        return f"xformers is not installed ({exc}): pip install 'concept[xformers]'"
    if torch.device(PROBE_DEVICE).type == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA device (xformers' attention kernels are CUDA-only)"
    return probe(fmha, torch.device(PROBE_DEVICE))


def probe(fmha, device: torch.device) -> str:
    """'' if one of xformers' kernels runs a tiny bf16 block-diagonal causal call (head dim 64) on ``device``,
    else why not, in one line: xformers' reasons per operator, and why its C++/CUDA extensions did not load.
    An operator's ``is_available()`` is not enough: on the GPU image of 2026-11-27 xformers 0.0.35's were
    available, yet it refused every call ("xFormers wasn't build with CUDA support": its ``_C.so`` was built
    for another torch and did not load, and without it no CUDA operator dispatches)."""
    try:
        q = torch.zeros(1, 4, 1, 64, device=device, dtype=torch.bfloat16)
        fmha.memory_efficient_attention(q, q, q, attn_bias=fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens([2, 2]))
    except NotImplementedError as exc:  # xformers' "No operator found", with each operator's reasons
        reasons = refusals(str(exc))
        cause = extensions_not_loaded()
        return (f"xformers {getattr(sys.modules.get('xformers'), '__version__', '')} refuses every attention call "
                f"here ({reasons[:700]})" + (f"; {cause}" if cause else "")).replace("  ", " ")
    except Exception as exc:  # noqa: BLE001 - any other failure of the tiny call is as telling
        return f"xformers' attention failed on a tiny call: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return ""


def refusals(message: str) -> str:
    """xformers' "No operator found" message as one line: each operator with its reasons."""
    ops, current = [], None
    for line in (line.strip() for line in message.splitlines()):
        if line.endswith("is not supported because:"):
            current = [line.removesuffix(" is not supported because:"), []]
            ops.append(current)
        elif line and current is not None:
            current[1].append(line)
    return "; ".join(f"{name}: {', '.join(reasons)}" for name, reasons in ops) or message.splitlines()[0]


def extensions_not_loaded() -> str:
    """Why xformers' C++/CUDA extensions did not load (what it was built for against what is here), or ''."""
    exc = getattr(sys.modules.get("xformers._cpp_lib"), "_cpp_library_load_exception", None)
    if exc is None:
        return ""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip() and "reinstall" not in line)
    return f"its C++/CUDA extensions did not load: {text[:300]}"


class QueryBlocks(NamedTuple):
    """The query blocks both layouts share, as tensors on the layout's device."""

    q_index: torch.Tensor  # [Nq] flat slot b * L + slot of every valid slot, in block order
    q_lens: torch.Tensor  # [blocks]
    prefix_start: torch.Tensor  # [blocks] flat slot of the first concept of its document a block sees
    n_prefix: torch.Tensor  # [blocks] how many concepts it sees (0 for a block of concepts)


def query_blocks(layout: PackedLayout) -> QueryBlocks:
    """One block per document's concepts, and one per segment of a document's tail."""
    meta, emit = layout.meta, layout.emit
    B, L = meta.time.shape
    q_index = meta.valid.reshape(-1).nonzero().squeeze(1)  # row-major: a row's concepts, then its tail
    row = q_index // L
    keep, doc, seg = (t.reshape(-1)[q_index] for t in (meta.keep, meta.doc, meta.seg))
    # a block: one document's concepts, or one segment of one document's tail
    key = torch.stack([row, keep.long(), doc, torch.where(keep, torch.full_like(seg, -1), seg)])
    new = torch.ones_like(keep)
    new[1:] = (key[:, 1:] != key[:, :-1]).any(0)
    starts = new.nonzero().squeeze(1)
    q_lens = torch.diff(starts, append=starts.new_tensor([q_index.numel()]))
    b_row, b_keep, b_doc, b_seg = row[starts], keep[starts], doc[starts], seg[starts]
    # a tail block sees concept slots [lo, hi) of its row: up to its segment, from its document's first
    hi = torch.where(b_keep, torch.zeros_like(b_seg), b_seg * emit)
    last = (hi - 1).clamp(min=0)
    C = layout.num_concepts
    if C:
        last_doc = meta.doc[:, :C][b_row, last.clamp(max=C - 1)]
        last_rank = layout.concept_rank[b_row, last.clamp(max=C - 1)]
        n_prefix = torch.where((hi > 0) & (last_doc == b_doc), last_rank + 1, torch.zeros_like(hi))
    else:
        n_prefix = torch.zeros_like(hi)
    return QueryBlocks(q_index, q_lens, b_row * L + hi - n_prefix, n_prefix)


def gathered_keys(q_index, q_lens, prefix_start, n_prefix):
    """The gathered layout's keys for the :class:`QueryBlocks`: ``kv_index`` [Nkv] (flat slot of every
    gathered key: each block's concept prefix, then its own slots) and ``kv_lens`` [blocks]."""
    device = q_index.device
    kv_lens = n_prefix + q_lens
    block = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), kv_lens)
    offset = torch.arange(block.numel(), device=device) - (torch.cumsum(kv_lens, 0) - kv_lens)[block]
    prefix = n_prefix[block]
    block_start = torch.cumsum(q_lens, 0) - q_lens
    own = q_index[(block_start[block] + offset - prefix).clamp(0, max(q_index.numel() - 1, 0))]
    return torch.where(offset < prefix, prefix_start[block] + offset, own), kv_lens


def shared_partials(blocks: QueryBlocks, device) -> list[Partial]:
    """The shared-prefix layout: the local partial, then one per prefix level."""
    attn_bias = _fmha().attn_bias
    levels = prefix_levels(*blocks)
    lens = torch.cat([blocks.q_lens, *(t for lv in levels for t in lv[2:])]).tolist()  # one host sync
    local, lens = lens[:blocks.q_lens.numel()], lens[blocks.q_lens.numel():]
    partials = [Partial(blocks.q_index, blocks.q_index,
                        attn_bias.BlockDiagonalCausalMask.from_seqlens(local, device=device))]
    for level_q, level_kv, level_q_lens, _ in levels:
        n = level_q_lens.numel()
        q_lens_l, kv_lens_l, lens = lens[:n], lens[n:2 * n], lens[2 * n:]
        partials.append(Partial(level_q, level_kv, attn_bias.BlockDiagonalMask.from_seqlens(q_lens_l, kv_lens_l,
                                                                                            device=device)))
    return partials


class XFormersPattern(AttentionPattern):
    settings = ("config",)  # (a pytree context: AttentionPattern)

    def __init__(self, layout: PackedLayout, config: XFormersConfig, deep_layers: int = 1):
        self.config = config
        self.deep_layers = deep_layers
        self.device = layout.meta.time.device
        self.blocks = query_blocks(layout)
        self.num_keys = int((self.blocks.q_lens + self.blocks.n_prefix).sum())  # gathered keys (a host sync)
        self.chosen = None  # "gathered" or "shared", at the first call
        self._gathered = self._shared = None

    def gathered(self):
        """(q_index, kv_index, bias) of the gathered layout, built once."""
        if self._gathered is None:
            kv_index, kv_lens = gathered_keys(*self.blocks)
            lens = torch.stack([self.blocks.q_lens, kv_lens]).tolist()  # one host sync
            bias = _fmha().attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(lens[0], lens[1],
                                                                                        device=self.device)
            self._gathered = (self.blocks.q_index, kv_index, bias)
        return self._gathered

    def shared(self) -> list[Partial]:
        """The partials of the shared-prefix layout, built once."""
        if self._shared is None:
            self._shared = shared_partials(self.blocks, self.device)
        return self._shared

    def _memory_limit(self, key, training: bool) -> float:
        limit = self.config.memory_limit_gib * 2**30
        if not limit and key.is_cuda:
            free, _ = torch.cuda.mem_get_info(key.device)
            limit = free / (2 * (self.deep_layers if training else 1))  # training keeps one per deep layer
        return limit

    def layout_for(self, key, heads: int, training: bool) -> str:
        """The layout of this forward, decided at its first deep layer (module docstring, "Which")."""
        if self.chosen is None:
            need = 2 * self.num_keys * heads * key.shape[-1] * key.element_size()  # gathered K and V
            limit = self._memory_limit(key, training)
            fits = not limit or need <= limit
            if self.config.layout == "gathered" and not fits:
                tokens = self.blocks.q_index.numel()
                raise ConceptError(
                    f"attention 'xformers': the gathered key/value layout needs {need / 2**30:.2f} GiB per deep "
                    f"layer ({self.num_keys} keys for {tokens} tokens: each segment repeats its concept prefix), over "
                    f"the {limit / 2**30:.2f} GiB allowed; --set attention.layout=shared (or auto) keeps one copy of "
                    f"each key, or {INSTEAD}, or use shorter sequences")
            small = fits and need <= self.config.gathered_max_mib * 2**20
            self.chosen = self.config.layout if self.config.layout != "auto" else ("gathered" if small else "shared")
        return self.chosen

    def __call__(self, query, key, value, scaling):
        B, H, L, hd = query.shape
        Hkv = key.shape[1]
        if not self.blocks.q_index.numel():  # no real token in the batch
            return query.new_zeros(B, L, H, hd)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        flat = [rearrange(t, "b h l d -> (b l) h d") for t in (query, key, value)]
        reference = self.config.kernel == "reference"
        if self.layout_for(key, H if training else Hkv, training) == "shared":
            kernels = ReferencePartials() if reference else XFormersPartials()
            return MergedAttention.apply(*flat, self.shared(), kernels, scaling).view(B, L, H, hd)
        q_index, kv_index, bias = self.gathered()
        attend = reference_attention if reference else kernel_attention
        out = attend(flat[0][q_index], flat[1][kv_index], flat[2][kv_index], bias, scaling, training)
        return query.new_zeros(B * L, H, hd).index_copy(0, q_index, out).view(B, L, H, hd)


@contextmanager
def named_kernel_errors(q):
    """xformers' "No operator found" (a head dim, dtype or device its kernels refuse) as one line
    naming the backends to use instead."""
    try:
        yield
    except NotImplementedError as exc:
        reasons = "; ".join(line.strip() for line in str(exc).splitlines()[1:] if line.strip())[:600]
        raise ConceptError(f"attention 'xformers': no xformers kernel accepts these inputs "
                           f"(head dim {q.shape[-1]}, {q.dtype}, {q.device}): {reasons}; {INSTEAD}") from None


def kernel_attention(q, k, v, bias, scaling, training: bool):
    """xformers' fused kernel over the gathered layout: q [Nq, H, hd], k / v [Nkv, Hkv, hd]."""
    fmha = _fmha()
    H, Hkv = q.shape[1], k.shape[1]
    with named_kernel_errors(q):
        if Hkv == H:
            return fmha.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=scaling)[0]
        group = H // Hkv
        if training:  # 5-D (grouped) inputs have no backward: repeat K/V to the query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return fmha.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=scaling)[0]
        q5 = q.reshape(q.shape[0], Hkv, group, q.shape[-1])[None]
        k5, v5 = (t[:, :, None].expand(-1, -1, group, -1)[None] for t in (k, v))
        out = fmha.memory_efficient_attention(q5, k5, v5, attn_bias=bias, scale=scaling)
        return out[0].reshape(q.shape)


def reference_attention(q, k, v, bias, scaling, training: bool = False):
    """The same attention with the bias materialised, in plain torch (any device; at least float32 math, as
    the kernels accumulate, and float64 for float64 inputs)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    acc = accumulation_dtype(q.dtype)
    mask = bias.materialize((q.shape[0], k.shape[0]), dtype=acc, device=q.device)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scaling + mask
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.to(acc)).to(q.dtype)


def _lse_positions(shape, bias, queries: int):
    """Where query m's log-sum-exp sits in a kernel's [*, H, *] layout: packed [1, H, >= M] (flash,
    or a single block), or per block [blocks, H, longest block] (cutlass)."""
    m = torch.arange(queries, device=bias.q_seqinfo.seqstart.device)
    if shape[0] == 1:
        return torch.zeros_like(m), m
    starts = bias.q_seqinfo.seqstart.long()
    block = torch.searchsorted(starts[1:], m, right=True)
    return block, m - starts[block]


class XFormersPartials:
    """xformers' kernels as the partial attentions of the shared-prefix layout (``MergedAttention``):
    the forward that also returns the log-sum-exp, and the backward given the merged output and
    log-sum-exp, written back into the layout the forward kernel used (so the matching backward
    kernel is dispatched)."""

    def forward(self, q, k, v, bias, scale):
        with named_kernel_errors(q):
            out, lse = _fmha().memory_efficient_attention_forward_requires_grad(q[None], k[None], v[None],
                                                                                attn_bias=bias, scale=scale)
        block, pos = _lse_positions(lse.shape, bias, q.shape[0])
        return out[0], lse[block, :, pos], lse.shape

    def backward(self, d_out, out, lse, q, k, v, bias, scale, lse_shape):
        block, pos = _lse_positions(lse_shape, bias, q.shape[0])
        kernel_lse = lse.new_zeros(lse_shape)
        kernel_lse[block, :, pos] = lse
        with named_kernel_errors(q):
            grads = _fmha().memory_efficient_attention_backward(d_out[None], out[None], kernel_lse, q[None], k[None],
                                                                v[None], attn_bias=bias, scale=scale)
        return tuple(g[0] for g in grads)


class XFormersBackend(AttentionBackend):
    Config = XFormersConfig
    supports_backward = True

    def __init__(self, config: XFormersConfig | None = None, ctx=None):
        self.config = config or XFormersConfig()
        self.deep_layers = ctx.split[2] if ctx is not None else 1

    @staticmethod
    def unavailable_reason() -> str:
        reason = kernel_unavailable()
        return f"{reason}; {INSTEAD}" if reason else ""

    @staticmethod
    def check_compatible(config: XFormersConfig, components) -> list[str]:
        """A build (or a load) with the kernel on a machine that cannot run it is refused up front."""
        if config.kernel == "reference":  # plain torch, but the layouts are xformers' block-diagonal biases
            try:
                _fmha()
            except ImportError as exc:
                return [f"kernel reference: the layouts are built from xformers' attention biases, and xformers is "
                        f"not installed ({exc}): pip install 'concept[xformers]'; or {INSTEAD}"]
            return []
        reason = kernel_unavailable()
        return [f"{reason}; {INSTEAD} (or --set attention.kernel=reference: exact, slow, for debugging)"] if reason else []

    def plan(self, layout: PackedLayout) -> AttentionPattern:
        return XFormersPattern(layout, self.config, self.deep_layers)
