"""KV caches for decoding: one :class:`SlotCache` per layer stack (docs/decoding.md).

The backbone's attention layers call ``past_key_values.update(key, value, layer_idx)`` and
attend to what it returns, so a cache only has to hand back keys and values. Ours keeps, per
row, a set of *slots*: keys carry their RoPE rotation already and a decoding query may see
every real entry of its row, so the order of the entries does not matter. A new entry goes
to the row's first free slot, and dropping entries (the deep tail, when a concept is
emitted) frees their slots for reuse: the memory held is bounded by what is live, not by how
many tokens went through.

One decoding step of a stack::

    mask = cache.begin(write, tail)      # choose slots; the attention mask [B, N] of the step
    ... the stack's layers run; each calls cache.update(k, v, layer_idx) ...
    cache.commit()                       # the written slots become real entries

Rows that do not write this step (``write`` False) still run through the layers (batching);
their keys land in a free slot that stays free, so nothing they compute is kept.

During prefill (no step begun) ``update`` just records the one-pass keys and values;
:meth:`SlotCache.adopt` then says which of them are real and compacts them.
"""
from __future__ import annotations

import torch

from .attention import AttentionPattern, sdpa
from .syncs import declared


class DecodePattern(AttentionPattern):
    """Attention of new elements to the cached entries a boolean mask allows: [B, N] (the same for
    every new element) or [B, n, N] (one row per new element, several tokens at once)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def __call__(self, query, key, value, scaling):
        mask = self.mask if self.mask.dim() == 3 else self.mask[:, None, :].expand(-1, query.shape[2], -1)
        return sdpa(query, key, value, scaling, mask).transpose(1, 2)


class CacheSizes:
    """The sizes of a cache holding keys / values per layer in ``k`` / ``v`` ([B, Hkv, N, hd]) and per row which
    of the N slots hold a real entry (``valid``) and which of those are tail tokens (``tail``)."""

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def entries(self) -> torch.Tensor:
        """[B] real entries held per row (per layer)."""
        return self.valid.sum(1)

    def tail_entries(self) -> torch.Tensor:
        return (self.valid & self.tail).sum(1)

    def entry_bytes(self) -> int:
        """Bytes of one entry (key + value) in one layer, 0 before anything was stored."""
        k = next(iter(self.k.values()), None)
        return 0 if k is None else 2 * k.shape[1] * k.shape[3] * k.element_size()

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class SlotCache(CacheSizes):
    """The KV cache of one layer stack: keys / values [B, Hkv, N, hd] per layer, and per row which
    of the N slots hold a real entry (``valid``) and which of those are tail tokens (``tail``)."""

    def __init__(self, batch_size: int, device, min_grow: int = 64):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.tail = torch.zeros_like(self.valid)
        self.min_grow = min_grow
        self._step = None  # (slot, write, tail) between begin() and commit()
        self._sure = 0  # steps of begin() known to find a free slot in every row without looking (each adds <= 1)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """No step begun: ``update`` records a prefill's one-pass keys and values (a compiled stack may run)."""
        return self._step is None

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots per row (grows the masks now, the tensors when next used)."""
        if slots > self.capacity:
            pad = slots - self.capacity
            self.valid = torch.nn.functional.pad(self.valid, (0, pad))
            self.tail = torch.nn.functional.pad(self.tail, (0, pad))

    def _fit(self, layer_idx: int, like: torch.Tensor) -> None:
        k = self.k.get(layer_idx)
        if k is None:
            shape = (like.shape[0], like.shape[1], self.capacity, like.shape[3])
            self.k[layer_idx] = like.new_zeros(shape)
            self.v[layer_idx] = like.new_zeros(shape)
        elif k.shape[2] < self.capacity:
            pad = (0, 0, 0, self.capacity - k.shape[2])
            self.k[layer_idx] = torch.nn.functional.pad(k, pad)
            self.v[layer_idx] = torch.nn.functional.pad(self.v[layer_idx], pad)

    # -- prefill -------------------------------------------------------------------------
    def adopt(self, valid: torch.Tensor, tail: torch.Tensor | None = None) -> None:
        """After a recorded one-pass forward: ``valid`` [B, L] says which of the recorded slots are
        real entries to keep (``tail`` which are tail tokens); the rest are dropped and the kept
        entries are packed to the front of each row."""
        tail = torch.zeros_like(valid) if tail is None else tail & valid
        keep = int(valid.sum(1).max()) if valid.numel() else 0
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :keep]
        self.valid, self.tail = valid.gather(1, order), tail.gather(1, order)
        self._sure = 0
        for store in (self.k, self.v):
            for i, t in store.items():
                store[i] = t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])).contiguous()

    # -- decoding step -------------------------------------------------------------------
    def drop_tail(self, rows: torch.Tensor) -> None:
        """Forget the tail entries of ``rows`` [B] (a concept was emitted there)."""
        self.valid &= ~(self.tail & rows[:, None])
        self.tail &= self.valid

    def begin(self, write: torch.Tensor, tail: torch.Tensor | bool = False) -> torch.Tensor:
        """Start a step in which rows ``write`` [B] add one entry (a tail token where ``tail``).
        Returns the step's attention mask [B, N]: the row's real entries and its new one.

        Whether every row has a free slot is read on the host only when it is not known (the ``cache growth
        check``, ``concept.syncs``): a check that finds the fullest row using ``u`` of the ``N`` slots (growing
        the cache when ``u = N``, as a check at every step would) vouches for the next ``N - u`` steps."""
        if self._sure <= 0:
            with declared("cache growth check"):
                used = int(self.valid.sum(1).max()) if len(self.valid) else 0
            if used >= self.capacity:
                self.reserve(self.capacity + max(self.min_grow, self.capacity // 2))
            self._sure = self.capacity - used
        self._sure -= 1
        slot = (~self.valid).to(torch.int8).argmax(1)  # first free slot of every row
        tail = tail.expand_as(write) if isinstance(tail, torch.Tensor) else torch.full_like(write, tail)
        self._step = (slot, write, tail)
        rows = torch.arange(len(slot), device=slot.device)
        mask = self.valid.clone()
        mask[rows, slot] = write
        return mask

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by the backbone's attention layers; returns the keys and values to attend to."""
        if self._step is None:  # prefill: record the one-pass keys and values as they are
            self.k[layer_idx], self.v[layer_idx] = key, value
            return key, value
        slot = self._step[0]
        self._fit(layer_idx, key)
        rows = torch.arange(len(slot), device=slot.device)
        if slot.dim() == 2:  # several new entries per row (begin_many): [B, n] slots
            self.k[layer_idx][rows[:, None], :, slot] = key.transpose(1, 2)
            self.v[layer_idx][rows[:, None], :, slot] = value.transpose(1, 2)
        else:
            self.k[layer_idx][rows, :, slot] = key[:, :, 0]
            self.v[layer_idx][rows, :, slot] = value[:, :, 0]
        return self.k[layer_idx], self.v[layer_idx]

    def commit(self) -> None:
        slot, write, tail = self._step
        rows = torch.arange(len(slot), device=slot.device)
        self.valid[rows, slot] |= write
        self.tail[rows, slot] = torch.where(write, tail, self.tail[rows, slot])
        self._step = None

    # -- several entries per row at once (multi-token decoding) ------------------------------
    def begin_many(self, n: int, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Start a step that computes ``n`` new entries per row in ``n`` fresh slots; nothing becomes
        real until :meth:`commit_many` says which. ``old`` [B, n, N]: which of the real entries each new
        element sees (``None``: all); ``new`` [B, n, n]: which new elements it sees. Returns the
        step's attention mask [B, n, N'] (the cache may have grown)."""
        free = ~self.valid
        short = int(n - free.sum(1).min()) if free.numel() else n
        if short > 0:
            self.reserve(self.capacity + max(self.min_grow, self.capacity // 2, short))
            free = ~self.valid
        slots = torch.argsort((~free).to(torch.int8), dim=1, stable=True)[:, :n]  # the first n free slots
        self._sure = 0  # (begin() looks again)
        B, N = self.valid.shape
        mask = self.valid[:, None, :].expand(B, n, N).clone()
        if old is not None:
            mask[:, :, : old.shape[2]] &= old
        mask.scatter_(2, slots[:, None, :].expand(B, n, n), new)
        self._step = (slots, None, None)
        return mask

    def end_many(self) -> torch.Tensor:
        """After the layers ran: the [B, n] slots of the step begun by :meth:`begin_many`, for
        :meth:`commit_many` (until then the new entries are not real)."""
        slots, self._step = self._step[0], None
        return slots

    def commit_many(self, slots: torch.Tensor, accept: torch.Tensor, tail: torch.Tensor | bool = False) -> None:
        """Make the entries in ``slots`` [B, n] real where ``accept`` [B, n] (tail tokens where ``tail``);
        the others stay free, as if they had never been computed."""
        tail = torch.as_tensor(tail, device=accept.device).expand_as(accept)
        self.valid.scatter_(1, slots, self.valid.gather(1, slots) | accept)
        self.tail.scatter_(1, slots, torch.where(accept, tail, self.tail.gather(1, slots)))


class ConceptCache:
    """The three caches of the streaming model: shallow (every token), middle (concepts only) and
    deep (concepts + the current tail; the tail is dropped whenever a concept is emitted)."""

    def __init__(self, batch_size: int, device):
        self.shallow = SlotCache(batch_size, device)
        self.middle = SlotCache(batch_size, device)
        self.deep = SlotCache(batch_size, device)

    def adopt(self, valid: torch.Tensor, layout, deep=None) -> None:
        """Keep what a recorded one-pass prefill over ``valid`` [B, T] left in each stack: every real
        token (shallow), every concept (middle), and every concept plus the tail tokens after the
        row's last concept (deep). ``deep``: the sequence the deep stack ran over (the ``layout``, the default,
        or its ``packing.DeepBlock``): its slots are what the deep caches recorded. Both hold a row's concepts
        before its tail, each part in time order, so the kept entries come out the same either way."""
        meta = (layout if deep is None else deep).meta
        self.shallow.adopt(valid)
        self.middle.adopt(layout.concept_meta.valid)
        last_seg = meta.keep.sum(1, keepdim=True) // layout.emit  # seg of the tail tokens after the last concept
        self.deep.adopt(meta.valid & (meta.keep | (meta.seg == last_seg)), tail=~meta.keep)

    def stacks(self) -> dict[str, SlotCache]:
        return {"shallow": self.shallow, "middle": self.middle, "deep": self.deep}
