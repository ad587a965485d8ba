"""`flex`: FlexAttention over the concepts-first layout, with the one-pass rule as a ``mask_mod``.

The mask is never materialised as T x T. In the concepts-first layout the keys a query may see are two
runs of slots (``mask = "ranges"``, the default): its document's concepts emitted before it
``[concept_lo, concept_hi)`` (a concept: up to itself, causally; a tail token: the first ``seg * emit``
concept slots), and its own segment's tail slots up to itself ``[tail_lo, q]`` (empty for a concept). So
``mask_mod`` reads three int32 per query row, computed once per forward from the layout, and compares slot
indices; nothing per key. A static layout's deep block (``concept.packing.DeepBlock``: each row's tail right
after its own concepts) has the same two runs, its boundary read per row. (``mask = "rule"``: the rule of ``concept.packing.allowed`` over six per-slot
tensors (time, keep, segment, slot index, validity, document) for query and key alike: what the backend did
before issue 40, kept for the GPU kit's diagnosis.) ``create_block_mask`` builds the BlockMask once per
forward (shared by every deep layer) and skips every fully masked 128 x 128 tile, which in the
concepts-first layout is most of the tail-to-tail and every concept-to-tail tile. Exact against the dense
reference (tests). It is built eagerly up to 16k slots per row (no compilation: a compiled build's first
call took 55.7 s on the H100 host, 2026-11-27), compiled beyond (:func:`build_block_mask`).

Compilation (``dynamic``): ``auto`` compiles FlexAttention with symbolic shapes on CUDA (one kernel for every
packed length) and with static ones on the CPU; ``static`` / ``dynamic`` force one. ``kernel_options``:
passed to FlexAttention as they are (tile sizes, warps, stages). The GPU kit's flex diagnosis
(``benchmarks/gpu_kit/flex_diagnosis.py``) times each of these choices on the GPU.

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
from einops import rearrange

from concept.attention import AttentionPattern
from concept.contracts import AttentionBackend
from concept.errors import ConceptError
from concept.packing import PackedLayout

NO_CPU_BACKWARD = ("torch's FlexAttention has no backward pass on CPU; train with --attention chunked "
                   "(or sdpa), or on a CUDA device")


MASKS = ("ranges", "rule")
DYNAMIC = ("auto", "static", "dynamic")


@dataclass
class FlexConfig:
    compile: bool = True  # fused kernels via torch.compile (eager FlexAttention otherwise)
    block: int = 128  # BlockMask tile size
    mask: str = "ranges"  # ranges: 3 int32 per query row; rule: the six-tensor rule (before issue 40)
    dynamic: str = "auto"  # auto: symbolic shapes on CUDA, static on CPU; static; dynamic
    kernel_options: dict | None = None  # FlexAttention's kernel options, e.g. {"BLOCK_M": 64, "BLOCK_N": 64}

    def validate(self) -> list[str]:
        problems = [] if self.block >= 16 and self.block % 16 == 0 else [f"block: a multiple of 16, got {self.block}"]
        if self.mask not in MASKS:
            problems.append(f"mask: one of {', '.join(MASKS)}, got {self.mask!r}")
        if self.dynamic not in DYNAMIC:
            problems.append(f"dynamic: one of {', '.join(DYNAMIC)}, got {self.dynamic!r}")
        if self.kernel_options is not None and not isinstance(self.kernel_options, dict):
            problems.append(f"kernel_options: a JSON object, e.g. {{\"BLOCK_M\": 64}}, got {self.kernel_options!r}")
        return problems


def rule_mask(meta):
    """The rule of ``concept.packing.allowed`` as a ``mask_mod`` over six per-slot tensors, one (query, key)
    pair at a time (``mask = "rule"``)."""
    return rule_mask_mod(*rule_tensors(meta))


def rule_tensors(meta) -> tuple[torch.Tensor, ...]:
    """The six per-slot tensors ``mask = "rule"`` reads: time, keep, segment, validity, document, sub-index."""
    return meta.time, meta.keep, meta.seg, meta.valid, meta.doc, (
        meta.sub if meta.sub is not None else torch.zeros_like(meta.time))


def rule_mask_mod(time, keep, seg, valid, doc, sub):
    """``mask = "rule"``'s ``mask_mod`` over :func:`rule_tensors`."""
    def mask_mod(b, h, q, k):
        t_q, t_k = time[b, q], time[b, k]
        earlier = (t_k < t_q) | ((t_k == t_q) & (sub[b, k] <= sub[b, q]))
        visible = keep[b, k] | (~keep[b, q] & (seg[b, q] == seg[b, k]))
        return (earlier & visible & (doc[b, q] == doc[b, k]) & valid[b, k]) | ~valid[b, q]

    return mask_mod


def slot_ranges(layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query slot [B, L] (int32): the concept slots ``[concept_lo, concept_hi)`` and the tail slots
    ``[tail_lo, q]`` it may see, which are exactly the keys ``concept.packing.allowed`` allows it (concepts are
    sorted by time, a document's concepts and a segment's tail tokens are contiguous runs of slots; a padding
    query sees every slot). The concept part is each row's slots before ``layout.concept_boundary`` (the
    layout's C; a ``DeepBlock``'s, per row)."""
    meta, emit, boundary = layout.meta, layout.emit, layout.concept_boundary
    B, L = meta.time.shape
    slot = torch.arange(L, device=meta.time.device).expand(B, L)
    is_concept = slot < boundary
    # runs of slots: among the concepts, of one document (padding concept slots: none); among the tails, of one
    # (document, segment); the boundary starts a run (the segment key changes there)
    doc = torch.where(is_concept & ~meta.valid, -1, meta.doc)
    seg = torch.where(is_concept, -2, meta.seg)
    new_run = torch.ones_like(is_concept)
    new_run[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (seg[:, 1:] != seg[:, :-1])
    first = torch.cummax(torch.where(new_run, slot, torch.zeros_like(slot)), dim=1).values  # its run's first slot
    # a query's document's first concept: the concept runs' starts, looked up at the last concept it sees
    before = meta.seg * emit  # a tail query's concept slots
    before = before.clamp(max=boundary) if isinstance(boundary, int) else torch.minimum(before, boundary)
    seen = torch.where(is_concept, slot + 1, before)
    last_seen = (seen - 1).clamp(min=0)  # (< the boundary wherever seen > 0)
    same_doc = (seen > 0) & (doc.gather(1, last_seen) == meta.doc)
    concept_lo = torch.where(same_doc, first.gather(1, last_seen), seen)
    tail_lo = torch.where(is_concept, slot + 1, first)
    everything = ~meta.valid  # padding queries may look anywhere
    concept_lo = torch.where(everything, 0, concept_lo)
    concept_hi = torch.where(everything, L, seen)
    tail_lo = torch.where(everything, L, tail_lo)
    return concept_lo.int(), concept_hi.int(), tail_lo.int()


def ranges_mask(layout: PackedLayout):
    """``mask = "ranges"``: three int32 per query row (:func:`slot_ranges`), nothing per key."""
    return ranges_mask_mod(*slot_ranges(layout))


def ranges_mask_mod(concept_lo, concept_hi, tail_lo):
    """``mask = "ranges"``'s ``mask_mod`` over :func:`slot_ranges`."""
    def mask_mod(b, h, q, k):
        return ((k >= concept_lo[b, q]) & (k < concept_hi[b, q])) | ((k >= tail_lo[b, q]) & (k <= q))

    return mask_mod


# mask -> (the tensors its mask_mod reads, of a layout; the mask_mod over them). The module's functions are looked
# up at each call (the flex diagnosis' negative control replaces ``slot_ranges`` with a wrong one)
MASK_MODS = {"ranges": (lambda layout: slot_ranges(layout), ranges_mask_mod),
             "rule": (lambda layout: rule_tensors(layout.meta), rule_mask_mod)}


def _block_mask_fields(block_mask_class) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A BlockMask's tensor attributes and its other constructor arguments (``seq_lengths``, ``BLOCK_SIZE``,
    ``mask_mod``, ...), as this torch's BlockMask lists them (the attribute names are its constructor's
    keywords); torch's first eight and three where it lists none."""
    tensors = getattr(block_mask_class, "_TENSOR_ATTRS", ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                          "full_kv_indices", "q_num_blocks", "q_indices",
                                                          "full_q_num_blocks", "full_q_indices"))
    return tuple(tensors), tuple(getattr(block_mask_class, "_CONTEXT_ATTRS", ("seq_lengths", "BLOCK_SIZE",
                                                                              "mask_mod")))


@lru_cache(maxsize=None)
def _compiled_flex(dynamic: bool):
    """FlexAttention compiled once per process: with symbolic shapes on CUDA (one kernel for every packed
    length); on CPU with static ones, since torch's CPU template generates C++ that does not compile for
    a recompile with symbolic sizes (torch 2.13: "cur_kvSplitSize0 was not declared"), so each new shape
    compiles its own kernel there."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


DENSE_MASK_LIMIT = 1 << 28  # B x L x L: the largest mask built eagerly (L = 16384 at B = 1)


@lru_cache(maxsize=None)
def _compiled_create_block_mask():
    """``torch.compile(create_block_mask)``, once per process (what torch advises instead of ``_compile=True``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def build_block_mask(mask_mod, B: int, L: int, device, block: int, compile: bool):
    """The BlockMask of ``mask_mod`` over B rows of L slots. Eagerly while the dense B x L x L mask has at most
    ``DENSE_MASK_LIMIT`` elements: torch evaluates ``mask_mod`` on every pair and reduces it to blocks, no
    compilation; beyond that (with ``compile``), ``torch.compile(create_block_mask)``, which never materialises
    the dense mask but compiles once per process (and again per new length): its first build took 55.7 s on
    the H100 host at 8k tokens (2026-11-27), every one after 3.6 ms; ``docs/benchmarks.md`` has the CPU's."""
    from torch.nn.attention.flex_attention import create_block_mask

    if torch.compiler.is_compiling():  # inside a graph (``--compile model``): built by it, nothing materialised
        return create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=block)
    if compile and B * L * L > DENSE_MASK_LIMIT:
        return _compiled_create_block_mask()(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=block)
    return create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=block, _compile=False)


class FlexPattern(AttentionPattern):
    """The deep stack's FlexAttention plan: its BlockMask, built once per forward. Kept as tensors (the mask's
    own and the BlockMask's) and constants, not as the BlockMask object, whose ``mask_mod`` closure is no pytree
    leaf: so a whole forward's graph (``--compile model``) passes the plan to each deep layer as data and traces
    one layer for the stack (``AttentionPattern``). :attr:`block_mask` puts the BlockMask back together (its
    constructor only assigns) with a ``mask_mod`` over the same tensors."""

    settings = ("config",)  # (a pytree context: AttentionPattern)

    def __init__(self, layout: PackedLayout, config: FlexConfig):
        self.config = config
        tensors_of, mask_mod_of = MASK_MODS[config.mask]
        self.mask_tensors = tuple(tensors_of(layout))
        B, L = layout.meta.time.shape
        self.block_mask = build_block_mask(mask_mod_of(*self.mask_tensors), B, L, layout.meta.time.device,
                                           config.block, config.compile)
        self.mask_mod = None  # (rebuilt from mask_tensors; a replacement's own, e.g. the flex diagnosis' floor)

    @property
    def block_mask(self):
        from torch.nn.attention.flex_attention import BlockMask

        mask_mod = self.mask_mod or MASK_MODS[self.config.mask][1](*self.mask_tensors)
        return BlockMask(**self.blocks, **self.block_shape, mask_mod=mask_mod)

    @block_mask.setter
    def block_mask(self, block_mask) -> None:
        tensors, context = _block_mask_fields(type(block_mask))
        self.blocks = {name: getattr(block_mask, name) for name in tensors}  # the block tables (None: absent)
        self.block_shape = {name: getattr(block_mask, name) for name in context if name != "mask_mod"}  # ints
        self.mask_mod = block_mask.mask_mod

    def __call__(self, query, key, value, scaling):
        from torch.nn.attention.flex_attention import flex_attention

        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise ConceptError(f"attention 'flex': {NO_CPU_BACKWARD}")
        gqa = query.shape[1] != key.shape[1]
        options = {} if self.config.kernel_options is None else {"kernel_options": self.config.kernel_options}
        if torch.compiler.is_compiling():  # inside a graph (``--compile model``): the kernel is the graph's
            out = flex_attention(query, key, value, block_mask=self.block_mask, scale=scaling, enable_gqa=gqa, **options)
        elif self.config.compile:
            dynamic = self.config.dynamic == "dynamic" or (self.config.dynamic == "auto" and query.device.type != "cpu")
            flex = _compiled_flex(dynamic)
            out = flex(query, key, value, block_mask=self.block_mask, scale=scaling, enable_gqa=gqa, **options)
        else:
            with warnings.catch_warnings():  # eager on purpose: "without torch.compile()" is not news here
                warnings.simplefilter("ignore")
                out = flex_attention(query, key, value, block_mask=self.block_mask, scale=scaling, enable_gqa=gqa,
                                     **options)
        return rearrange(out, "b h l d -> b l h d")


class FlexBackend(AttentionBackend):
    Config = FlexConfig
    plans_deep_block = True  # (its ranges per row: ``slot_ranges``)

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

    def plan(self, layout: PackedLayout) -> AttentionPattern:
        return FlexPattern(layout, self.config)
