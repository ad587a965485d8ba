"""`xformers`: the deep stack's one-pass rule as one xformers block-diagonal attention call (CUDA).

The valid slots of the packed layout are flattened into one row of query blocks (xformers'
block-diagonal biases want batch 1, BMHK), and each block gets its own gathered keys:

    a document's concepts          queries c_0 .. c_{n-1}    keys c_0 .. c_{n-1}             (square, causal)
    one segment of a document's    queries x_a .. x_b        keys [ the document's concepts
    tail tokens                                                    up to the segment ;
                                                                  x_a .. x_b ]               (causal from bottom right)

``BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, kv_lens)`` is then exactly the
one-pass rule (SPEC §2.1, ``concept.packing.allowed``): concepts causal among themselves, a tail
token sees every concept of its document up to its time and its own segment causally, documents
never mix, padding is never a key. Padding queries are left out (their outputs are zeros, and
are never read).

Costs, built once per forward and shared by every deep layer: the block lengths are Python lists
(one host sync per forward, and xformers checks every block in Python: O(blocks) host work);
the gathered keys repeat each segment's concept prefix, about C^2/2 keys per document in the
worst case (``docs/benchmarks.md`` measures where that stops paying). ``memory_limit_gib``
refuses a layout whose gathered K/V would not fit, naming the backend to use instead.

Kernels: xformers' CUDA kernels (cutlass for fp32, flash / cutlass for bf16 and fp16). Grouped-
query heads: forward-only calls use xformers' 5-D (BMGHK) layout without copying; 5-D has no
backward, so training repeats K/V to the query heads. ``kernel = "reference"`` runs the same
gathered layout with the *materialised* bias in plain torch on any device (O(queries x keys)
memory): the slow, obviously correct path the tests compare against, and a debugging aid.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from concept.attention import AttentionPlan
from concept.errors import ConceptError
from concept.packing import PackedLayout

KERNELS = ("xformers", "reference")
INSTEAD = "use --attention flex (CUDA) or chunked (any device)"


@dataclass
class XFormersConfig:
    kernel: str = "xformers"  # "reference": the materialised bias in plain torch (tests, debugging)
    memory_limit_gib: float = 0.0  # gathered K/V of one deep layer; 0 = auto (a share of free CUDA memory)

    def validate(self) -> list[str]:
        problems = []
        if self.kernel not in KERNELS:
            problems.append(f"kernel: one of {', '.join(KERNELS)}, got {self.kernel!r}")
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


def kernel_unavailable() -> str:
    """Why xformers' attention kernels cannot run on this machine ('' if they can)."""
    try:
        fmha = _fmha()
    except ImportError as exc:
        return f"xformers is not installed ({exc}): pip install xformers"
    if not torch.cuda.is_available():
        return "needs a CUDA device (xformers' attention kernels are CUDA-only)"
    ops = [getattr(getattr(fmha, name, None), "FwOp", None) for name in ("cutlass", "flash", "flash3")]
    if not any(op is not None and op.is_available() for op in ops):
        return ("this xformers build has no CUDA attention kernels (built for another torch / CUDA?); "
                "see `python -m xformers.info`")
    return ""


def block_layout(layout: PackedLayout):
    """The gathered layout of :class:`XFormersPlan`, as tensors on the layout's device:
    ``q_index`` [Nq] (flat ``b * L + slot`` of every valid slot, in block order), ``kv_index``
    [Nkv] (flat slot of every gathered key), ``q_lens`` / ``kv_lens`` [blocks]."""
    meta, emit = layout.meta, layout.emit
    B, L = meta.time.shape
    device = meta.time.device
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
    kv_lens = n_prefix + q_lens
    block = torch.repeat_interleave(torch.arange(starts.numel(), device=device), kv_lens)
    offset = torch.arange(block.numel(), device=device) - (torch.cumsum(kv_lens, 0) - kv_lens)[block]
    prefix = n_prefix[block]
    own = q_index[(starts[block] + offset - prefix).clamp(0, max(q_index.numel() - 1, 0))]
    kv_index = torch.where(offset < prefix, b_row[block] * L + hi[block] - prefix + offset, own)
    return q_index, kv_index, q_lens, kv_lens


class XFormersPlan(AttentionPlan):
    def __init__(self, layout: PackedLayout, config: XFormersConfig, deep_layers: int = 1):
        fmha = _fmha()
        self.config = config
        self.deep_layers = deep_layers
        B, L = layout.meta.time.shape
        self.shape = (B, L)
        self.q_index, self.kv_index, q_lens, kv_lens = block_layout(layout)
        lens = torch.stack([q_lens, kv_lens]).tolist() if q_lens.numel() else [[], []]  # one host sync
        self.bias = (fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            lens[0], lens[1], device=layout.meta.time.device) if lens[0] else None)
        self._checked = False

    @property
    def num_keys(self) -> int:
        return self.kv_index.numel()

    def _check_memory(self, key, heads: int, training: bool) -> None:
        """Refuse a gathered K/V that would not fit, before any kernel runs (once per forward)."""
        if self._checked:
            return
        self._checked = True
        per_layer = 2 * self.num_keys * heads * key.shape[-1] * key.element_size()
        limit = self.config.memory_limit_gib * 2**30
        if not limit and key.is_cuda:
            free, _ = torch.cuda.mem_get_info(key.device)
            limit = free / (2 * (self.deep_layers if training else 1))  # training keeps one per deep layer
        if limit and per_layer > limit:
            tokens = self.q_index.numel()
            raise ConceptError(
                f"attention 'xformers': the gathered key/value layout needs {per_layer / 2**30:.2f} GiB per deep "
                f"layer ({self.num_keys} keys for {tokens} tokens: each segment repeats its concept prefix), over "
                f"the {limit / 2**30:.2f} GiB allowed; {INSTEAD}, or use shorter sequences")

    def __call__(self, query, key, value, scaling):
        B, H, L, hd = query.shape
        Hkv = key.shape[1]
        out = query.new_zeros(B * L, H, hd)
        if self.bias is None:  # no real token in the batch
            return out.view(B, L, H, hd)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        self._check_memory(key, H if training else Hkv, training)
        q = query.transpose(1, 2).reshape(B * L, H, hd)[self.q_index]
        k = key.transpose(1, 2).reshape(B * L, Hkv, hd)[self.kv_index]
        v = value.transpose(1, 2).reshape(B * L, Hkv, hd)[self.kv_index]
        attend = reference_attention if self.config.kernel == "reference" else kernel_attention
        return out.index_copy(0, self.q_index, attend(q, k, v, self.bias, scaling, training)).view(B, L, H, hd)


def kernel_attention(q, k, v, bias, scaling, training: bool):
    """xformers' fused kernel over the gathered layout: q [Nq, H, hd], k / v [Nkv, Hkv, hd]."""
    fmha = _fmha()
    H, Hkv = q.shape[1], k.shape[1]
    try:
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
    except NotImplementedError as exc:  # no kernel for this head dim / dtype / device
        reasons = "; ".join(line.strip() for line in str(exc).splitlines()[1:] if line.strip())[:600]
        raise ConceptError(f"attention 'xformers': no xformers kernel accepts these inputs "
                           f"(head dim {q.shape[-1]}, {q.dtype}, {q.device}): {reasons}; {INSTEAD}") from None


def reference_attention(q, k, v, bias, scaling, training: bool = False):
    """The same attention with the bias materialised, in plain torch (any device, float32 math)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = bias.materialize((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scaling + mask
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


class XFormersBackend:
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
        if config.kernel == "reference":
            return []
        reason = kernel_unavailable()
        return [f"{reason}; {INSTEAD} (or --set attention.kernel=reference: exact, slow, for debugging)"] if reason else []

    def plan(self, layout: PackedLayout) -> AttentionPlan:
        return XFormersPlan(layout, self.config, self.deep_layers)
