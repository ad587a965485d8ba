"""The packed deep sequence and its attention rule (docs/architecture.md, the one-pass forward).

Given ``keep[t]`` (token t emitted a concept) the deep stack sees exactly one element per
real token: element t is concept number ``seg[t] - 1`` if ``keep[t]`` else the shallow state
of token t, with ``seg = cumsum(keep)``. Elements are compared by their time index t, so any
memory layout is valid; we use **concepts first** per row::

    slots:  [ c_0 c_1 ... c_{C-1} | pad... ][ tail tokens in time order | pad... ]
             <----- C = max concepts ---->  <------- max tail tokens ------->

which lets block-sparse backends skip most tiles. A static layout (``concepts``: the budget's C slots, T tail
slots) keeps that shape whatever the decisions; its deep stack runs over the :class:`DeepBlock`, the same
elements with each row's tail right after its own concepts, T slots wide with one concept per boundary.
The rule, for query i and key j::

    allowed(i, j) = t_j <= t_i  and  (keep_j  or  (not keep_i and seg_i == seg_j))

A policy may emit M > 1 concepts at one boundary (``emit``): token t then owns M concept
slots at time t, numbered ``sub`` = 0..M-1, and among slots of the same time the order is
causal (``t_j < t_i or (t_j == t_i and sub_j <= sub_i)``). Slot ``sub`` takes its concept
id (and its RoPE position) from token ``t - M + 1 + sub``, one of the chunk's last M tokens
(``concept_id_src``); the logits at t are read from the last slot. With multi-level codes
(``levels`` L > 1) each of those M concepts is L consecutive slots, level 0 first: slot ``sub``
is level ``sub % L`` (``concept_level``) of the concept taken from token
``t - M + 1 + sub // L``, so ``emit`` = M * L slots per emitting token.

(concept -> concept causal, tail -> concept allowed, tail -> tail causal inside its own
segment, concept -> tail forbidden), keys must be real and of the same document, and
padding queries may look anywhere (their outputs are never used).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PAD_SEG = torch.iinfo(torch.long).max // 2  # keeps tail segments sorted with padding last


@dataclass
class SlotMeta:
    """Per-slot metadata [B, L] used by the attention rule."""

    time: torch.Tensor  # index t in the input sequence
    keep: torch.Tensor  # the slot is a concept
    seg: torch.Tensor  # cumsum(keep) at t
    valid: torch.Tensor  # the slot is a real element (not padding)
    doc: torch.Tensor  # document id (packed sequences hold several documents)
    sub: torch.Tensor | None = None  # index among the concept slots of one time (emit > 1)

    def __getitem__(self, idx) -> "SlotMeta":
        return SlicedMeta(self, idx)


class SlicedMeta:
    """``meta[idx]`` (a :class:`SlotMeta`'s fields, each indexed by ``idx``), each field indexed when first read:
    a layout's concept and tail parts are read a field or two at a time (the middle stack's plan reads
    ``valid`` and ``doc``), often not at all (a static chunked plan reads neither part)."""

    FIELDS = ("time", "keep", "seg", "valid", "doc", "sub")

    def __init__(self, meta, idx):
        self._meta, self._idx = meta, idx

    def __getattr__(self, name):
        if name not in SlicedMeta.FIELDS:
            raise AttributeError(name)
        t = getattr(self._meta, name)
        t = None if t is None else t[self._idx]
        setattr(self, name, t)  # (read once)
        return t

    def __getitem__(self, idx) -> "SlicedMeta":
        return SlicedMeta(self, idx)


def allowed(q: SlotMeta, k: SlotMeta) -> torch.Tensor:
    """Boolean attention mask [B, Lq, Lk] of the one-pass rule."""
    t_i, t_j = q.time[:, :, None], k.time[:, None, :]
    keep_i, keep_j = q.keep[:, :, None], k.keep[:, None, :]
    same_seg = q.seg[:, :, None] == k.seg[:, None, :]
    same_doc = q.doc[:, :, None] == k.doc[:, None, :]
    earlier = t_j <= t_i
    if q.sub is not None and k.sub is not None:  # several concept slots at one time: causal by sub
        earlier = (t_j < t_i) | ((t_j == t_i) & (k.sub[:, None, :] <= q.sub[:, :, None]))
    ok = earlier & (keep_j | (~keep_i & same_seg)) & same_doc & k.valid[:, None, :]
    return ok | ~q.valid[:, :, None]


class RuleBlocks:
    """The one-pass rule of ``meta`` (:func:`allowed`) for blocks of queries against prefixes of the keys, its
    per-slot parts prepared once for every block (a plan of many blocks, e.g. ``chunked``'s static chunks: each
    block then costs its slices and eight pairwise ops, not a slice of every field and the rule's thirteen).
    ``blocks(a, b, kb)`` equals ``allowed(meta[:, a:b], meta[:, :kb])`` (tested). A concept query's segment is
    -1 here, which no slot's is (segments count boundaries: >= 0; padding ``PAD_SEG``): it then matches the
    rule's ``~keep_i & same_seg`` in one comparison. Several concept slots per time (``sub``): :func:`allowed`."""

    def __init__(self, meta: SlotMeta):
        self.meta = meta
        self.length = meta.time.shape[1]
        if meta.sub is None:
            self.q = (meta.time[:, :, None], torch.where(meta.keep, -1, meta.seg)[:, :, None], meta.doc[:, :, None],
                      (~meta.valid)[:, :, None])
            self.k = tuple(t[:, None, :] for t in (meta.time, meta.keep, meta.seg, meta.doc, meta.valid))

    def __call__(self, a: int, b: int, kb: int) -> torch.Tensor:
        if self.meta.sub is not None:
            return allowed(self.meta[:, a:b], self.meta[:, :kb])
        full_q, full_k = a == 0 and b == self.length, kb == self.length  # (the tensors themselves: no view)
        t_i, seg_i, doc_i, pad_i = self.q if full_q else (t[:, a:b] for t in self.q)
        t_j, keep_j, seg_j, doc_j, valid_j = self.k if full_k else (t[:, :, :kb] for t in self.k)
        ok = (t_j <= t_i) & (keep_j | (seg_i == seg_j)) & (doc_i == doc_j) & valid_j
        return ok | pad_i


@dataclass
class PackedLayout:
    """Where every element of the deep sequence lives, and how to get back to time order."""

    num_concepts: int  # C: concept slots per row (max over the batch)
    meta: SlotMeta  # [B, L], L = C + max tail
    concept_src: torch.Tensor  # [B, C] time index of each concept slot
    tail_src: torch.Tensor  # [B, L - C] time index of each tail slot
    slot_of_time: torch.Tensor  # [B, T] which slot holds element t
    concept_rank: torch.Tensor  # [B, C] 0, 1, ... rank among the concepts of the same document
    concept_id_src: torch.Tensor | None = None  # [B, C] token giving each slot's id and position
    emit: int = 1  # concept slots per emitting token
    concept_level: torch.Tensor | None = None  # [B, C] code level of each slot (multi-level codes)
    static: bool = False  # widths fixed by (B, T, build): C = the row budget's slots, tail = T (``budget``)
    _slices: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # concept_meta, tail_meta

    def __post_init__(self):
        if self.concept_id_src is None:
            self.concept_id_src = self.concept_src

    @property
    def length(self) -> int:
        return self.meta.time.shape[1]

    @property
    def concept_boundary(self) -> int:
        """The first tail slot: the concept part is ``[0, C)`` in every row (:class:`DeepBlock`: per row)."""
        return self.num_concepts

    @property
    def concept_meta(self) -> SlotMeta:  # (sliced once per layout: each read was six slices)
        return self._sliced("concepts", slice(None, self.num_concepts))

    @property
    def tail_meta(self) -> SlotMeta:
        return self._sliced("tail", slice(self.num_concepts, None))

    def _sliced(self, name: str, part: slice) -> SlotMeta:
        """``meta[:, part]``, sliced at its first read (a dict, not ``functools.cached_property``, whose lock
        dynamo cannot trace: a whole forward compiles as one graph, ``concept.compiled``)."""
        if name not in self._slices:
            self._slices[name] = self.meta[:, part]
        return self._slices[name]


@dataclass
class DeepBlock:
    """The deep stack's sequence of a static layout with its concepts and its tail in one block: per row the
    concept slots first, the tail slots right after them, padding last. A static :class:`PackedLayout` gives the
    concepts ``C`` slots (the budget) and the tail ``T`` (a row may have no concept), ``C + T`` in all, while a
    row's real elements are ``T - n + emit * n`` for its n boundaries: here the block is as wide as the most a
    row can have, ``T + (emit - 1) * C / emit`` (``T`` for one concept per boundary), and the boundary between
    the parts is where each row's concepts end (a tensor, not a shape: nothing is read back to the host).

    The rule is the layout's (``allowed``: elements are compared by their time index, whatever their slot), and,
    concepts first, every key a query may see is at a slot no later than its own. What a deep attention plan
    reads is the layout's own: ``meta``, ``emit``, ``static``, ``length``, ``num_concepts`` (0: no part of every
    row is concepts) and ``concept_boundary`` ([B, 1]: each row's first tail slot). A backend that plans it says
    so (``AttentionBackend.plans_deep_block``); the model hands the others the layout itself
    (``ConceptModel.deep_layout``).
    """

    meta: SlotMeta  # [B, W]
    src: torch.Tensor  # [B, W] each slot's element in the layout's [concepts ; tail] (C + T slots)
    slot_of_time: torch.Tensor  # [B, T] which slot holds element t
    concept_boundary: torch.Tensor  # [B, 1] each row's concept slots (its first tail slot)
    emit: int = 1
    num_concepts: int = 0  # (no static concept part)
    static: bool = True

    @property
    def length(self) -> int:
        return self.meta.time.shape[1]


def deep_block_width(T: int, concepts: int, emit: int = 1) -> int:
    """The width of the :class:`DeepBlock` of a static layout of ``concepts`` concept slots over T tokens."""
    return T + concepts - concepts // emit


def deep_block(layout: PackedLayout) -> DeepBlock:
    """The deep sequence of the static ``layout`` as one :class:`DeepBlock` (its elements moved, their metadata
    and order kept: the concepts in time order, then the tail in time order). The deep stack's inputs and
    positions in the layout's order ``[concepts ; tail]`` go to it by one gather at ``src``; its outputs back to
    time order by ``slot_of_time``."""
    C, meta = layout.num_concepts, layout.meta
    T = meta.time.shape[1] - C
    slot = torch.arange(deep_block_width(T, C, layout.emit), device=meta.time.device)[None, :]
    concepts = meta.valid[:, :C].sum(1, keepdim=True)  # (real concept slots are the part's first ones)
    real = concepts + meta.valid[:, C:].sum(1, keepdim=True)
    is_concept = slot < concepts
    src = torch.where(is_concept, slot, C + (slot - concepts).clamp(max=max(T - 1, 0)))
    valid = slot < real
    pick = lambda t: None if t is None else t.gather(1, src)  # noqa: E731
    keep = pick(meta.keep) & valid
    block = SlotMeta(time=pick(meta.time), keep=keep, seg=torch.where(valid, pick(meta.seg), PAD_SEG),
                     valid=valid, doc=pick(meta.doc), sub=pick(meta.sub))
    # a tail element t moves from slot C + r to concepts + r (r: its rank in the tail); a concept stays
    slot_of_time = torch.where(layout.slot_of_time >= C, layout.slot_of_time - C + concepts, layout.slot_of_time)
    return DeepBlock(block, src, slot_of_time, concepts, layout.emit)


def _first_k(mask: torch.Tensor, k):
    """Time indices of the True entries of ``mask`` [B, T], in order, left-aligned, width k, and which of them
    exist. ``mask`` [n, B, T] with ``k`` n widths: the n masks' in one sort, as two tuples of n tensors."""
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    if mask.dim() == 2:
        return order[:, :k], torch.arange(k, device=mask.device)[None, :] < mask.sum(1, keepdim=True)
    present = torch.arange(max(k), device=mask.device) < mask.sum(-1, keepdim=True)
    return tuple(order[i, :, :w] for i, w in enumerate(k)), tuple(present[i, :, :w] for i, w in enumerate(k))


def budget(tokens, max_ratio: float, slack: int = 0):
    """The static concept budget: the most boundaries a row may have among its first ``tokens`` real
    tokens, ``ceil(max_ratio * tokens) + slack`` (``slack``: room for a burst at a row's start, which
    ``max_ratio="auto"`` gives; ``concept.streaming.budget``). ``tokens`` an int (the layout's width) or a
    long tensor (the cap, token by token): both compute ``max_ratio * tokens`` in IEEE float64, so they
    agree exactly."""
    if isinstance(tokens, torch.Tensor):
        return torch.ceil(tokens.double() * max_ratio).long() + slack
    return math.ceil(float(tokens) * max_ratio) + slack


def cap_boundaries(keep: torch.Tensor, valid: torch.Tensor, max_ratio: float,
                   boundaries_before: torch.Tensor | None = None,
                   tokens_before: torch.Tensor | None = None, slack: int = 0) -> torch.Tensor:
    """The policy's boundaries ``keep`` [B, n] with those over the row budget dropped: the token that is
    its row's n-th real token keeps its boundary only while the row has fewer than ``budget(n, max_ratio,
    slack)`` boundaries before it. Causal (a prefix decides the same whatever follows), so the decoder's step
    applies the same rule to one token (``n = 1``, with the row's ``boundaries_before`` / ``tokens_before``
    [B], a state the rule reached: ``boundaries_before <= budget(tokens_before)``) and decoding equals
    teacher forcing at the cap too.

    Computed for all t at once, without a host sync: with R the policy's boundaries so far and K the
    budget, the kept count obeys ``c_t = min(c_{t-1} + keep_t, K_t)`` (K never falls), whose solution is
    ``c_t = R_t + min(c_0, min_{s <= t} (K_s - R_s))``."""
    keep = keep & valid
    counted = keep.cumsum(1, dtype=torch.long)
    seen = valid.cumsum(1, dtype=torch.long)
    if tokens_before is not None:
        seen = seen + tokens_before[:, None]
    if boundaries_before is None:  # (c_0 = 0: the same sums without adding it)
        kept = counted + torch.clamp(torch.cummin(budget(seen, max_ratio, slack) - counted, dim=1).values, max=0)
        return keep & (kept > torch.cat([torch.zeros_like(kept[:, :1]), kept[:, :-1]], dim=1))
    start = boundaries_before[:, None]
    room = torch.cummin(budget(seen, max_ratio, slack) - start - counted, dim=1).values  # K_s - c_0 - R_s
    kept = counted + start + torch.clamp(room, max=0)
    before = torch.cat([start, kept[:, :-1]], dim=1)
    return keep & (kept > before)


def pack(keep: torch.Tensor, valid: torch.Tensor, doc: torch.Tensor | None = None, emit: int = 1,
         levels: int = 1, concepts: int | None = None) -> PackedLayout:
    """Build the concepts-first packed layout for ``keep`` / ``valid`` [B, T] (bool), optional
    document ids ``doc`` [B, T], and ``emit`` concept slots per emitting token (``levels`` code
    levels per concept: ``emit`` is a multiple of it).

    ``concepts``: a static layout (``budget``): ``concepts`` concept slots per row (a row's boundaries
    times ``emit`` must fit: ``cap_boundaries`` sees to it) and T tail slots, so every shape is a function
    of (B, T, build) and nothing is read back to the host. None: the widths are the batch's maxima
    (one host sync, shapes vary with the decisions)."""
    keep = keep & valid
    doc = torch.zeros_like(keep, dtype=torch.long) if doc is None else doc
    tail = valid & ~keep
    seg = keep.cumsum(1, dtype=torch.long)
    if concepts is not None:
        num_c, num_tail = concepts, keep.shape[1]
    else:
        num_c = int(keep.sum(1).max()) * emit if keep.numel() else 0
        num_tail = int(tail.sum(1).max()) if tail.numel() else 0

    if emit == 1:  # the concepts' and the tail's time indices from one sort of both masks
        (concept_src, tail_src), (concept_valid, tail_valid) = _first_k(torch.stack([keep, tail]), (num_c, num_tail))
        sub = None
    else:  # every emitting token repeated emit times, in (time, sub) order
        flat, concept_valid = _first_k(keep[:, :, None].expand(-1, -1, emit).reshape(keep.shape[0], -1), num_c)
        concept_src, concept_sub = flat // emit, flat % emit
        sub = torch.cat([concept_sub, concept_sub.new_zeros(keep.shape[0], num_tail)], dim=1)
        tail_src, tail_valid = _first_k(tail, num_tail)
    time = torch.cat([concept_src, tail_src], dim=1)
    slot_keep = torch.cat([concept_valid, torch.zeros_like(tail_valid)], dim=1)
    slot_valid = torch.cat([concept_valid, tail_valid], dim=1)
    # padding slots get a segment after every real one, so tail segments stay sorted
    slot_seg = torch.where(slot_valid, seg.gather(1, time), torch.full_like(time, PAD_SEG))

    tail_slot = tail.cumsum(1, dtype=torch.long) + (num_c - 1)  # num_c + the tail rank
    slot_of_time = torch.where(keep, (seg * emit if emit > 1 else seg) - 1, tail_slot)  # a concept's last slot
    slot_of_time = slot_of_time * valid  # (0 at padding)
    # rank of each concept among its document's concepts (documents are contiguous in a row); a slot whose
    # document differs from the slot before it starts one (slot 0's comparison, with the last slot, is moot:
    # its index is 0 either way)
    index = torch.arange(num_c, device=keep.device)[None]
    concept_doc = doc.gather(1, concept_src)
    first = concept_doc != concept_doc.roll(1, dims=1)
    concept_rank = index - torch.cummax(index * first, dim=1).values
    return PackedLayout(
        num_concepts=num_c,
        meta=SlotMeta(time=time, keep=slot_keep, seg=slot_seg, valid=slot_valid, doc=doc.gather(1, time), sub=sub),
        concept_src=concept_src,
        tail_src=tail_src,
        slot_of_time=slot_of_time,
        concept_rank=concept_rank,
        concept_id_src=None if emit == 1 else (concept_src - (emit // levels - 1) + concept_sub // levels).clamp(min=0),
        emit=emit,
        concept_level=None if levels == 1 else concept_sub % levels,
        static=concepts is not None,
    )


def document_starts(valid: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] bool: real token t is the first real token of its document (None without documents)."""
    if doc is None:
        return None
    prev = torch.cat([torch.full_like(doc[:, :1], -1), doc[:, :-1]], dim=1)
    first_real = valid.cumsum(1, dtype=torch.long) == 1
    return valid & ((doc != prev) | first_real)


def document_tokens(valid: torch.Tensor, reset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tokens before t in t's document [B, T], and in each row's last document [B] (``reset``:
    document starts [B, T]; None: one document per row). The per-document ratio trackers' counts."""
    real = valid.long()
    seen = torch.cumsum(real, dim=1)  # real tokens up to and including t
    base = torch.zeros_like(seen[:, :1])
    if reset is not None:  # counts restart at each document start
        base = torch.cummax(torch.where(reset, seen - real, 0), dim=1).values
    total = (seen - base)[:, -1] if valid.shape[1] else real.new_zeros(valid.shape[0])
    return seen - real - base, total


def tokens_since_keep(keep: torch.Tensor, valid: torch.Tensor, reset: torch.Tensor | None = None) -> torch.Tensor:
    """Real tokens after each row's last kept token (or its last document start, ``reset``) [B]: the
    step state of a policy that counts the tokens of its open chunk, after the last token, computed
    for all t at once (padding does not count)."""
    seen = valid.cumsum(1, dtype=torch.long)  # real tokens up to and including t
    if not valid.shape[1]:
        return seen.new_zeros(valid.shape[0])
    marks = torch.where(keep & valid, seen, 0)
    if reset is not None:  # a document start reopens the count before its first token
        marks = torch.maximum(marks, torch.where(reset & valid, seen - 1, 0))
    return seen[:, -1] - marks.max(dim=1).values


def time_positions(valid: torch.Tensor, doc: torch.Tensor | None = None,
                   starts: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids of real tokens (0, 1, ... restarting at each document), whatever the padding
    side, as Hugging Face does. ``starts``: ``document_starts(valid, doc)`` if already computed."""
    index = valid.cumsum(1, dtype=torch.long) - 1
    if doc is not None:
        starts = document_starts(valid, doc) if starts is None else starts
        index = index - torch.cummax(index * starts, dim=1).values  # (index * starts: where(starts, index, 0))
    return index.clamp_(min=0)
