"""The streaming model's compiled decoding step over static KV caches (docs/decoding.md, "Compiled decoding").

:class:`StaticConceptDecoder` prefills as :class:`ConceptDecoder` does, then moves the three caches into
:class:`concept.static_decoding.StaticSlotCache` s of fixed capacity and every piece of decoder state into
preallocated tensors. Its step is ``ConceptDecoder.step`` without a branch: the middle stack (and, for a
policy emitting several concept slots, the deep stack's earlier slots) runs every step, its entries written
only where a row emits a concept (``begin(keep)``), so the graph is the same whatever the decisions. The
decisions are recorded on the device and read once, at the end.

Capacities per row, never exceeded: shallow ``S``, the prompt's real tokens + the new ones + one spare slot
(for a row that does not write) rounded up to a multiple of 64 (so a few graphs serve every length), middle
``budget(S) * emit + 1`` (``max_ratio`` and its slack), deep the two together (concepts plus a tail no longer than the tokens).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .. import packing
from ..decoding import select_rows
from ..kv_cache import DecodePattern
from ..static_decoding import CompiledStep, StaticSlotCache, capacity, kv_shape, layer_ids, static
from .decoding import ConceptDecoder, concept_slots


class StaticConceptCache:
    """The three static caches (shallow, middle, deep), as :class:`concept.kv_cache.ConceptCache`."""

    def __init__(self, model, prefilled, new_tokens: int):
        shallow = capacity(prefilled.shallow.capacity + new_tokens)  # tokens: the prompt's, the new ones
        middle = packing.budget(shallow, model.max_ratio, model.budget_slack) * model.emit + 1  # the most it can emit
        kv, dtype = kv_shape(model.backbone.config), next(model.parameters()).dtype
        self.shallow = StaticSlotCache(prefilled.shallow, shallow, layer_ids(model.shallow), kv, dtype)
        self.middle = StaticSlotCache(prefilled.middle, middle, layer_ids(model.middle), kv, dtype)
        self.deep = StaticSlotCache(prefilled.deep, shallow + middle, layer_ids(model.deep), kv, dtype)

    def stacks(self) -> dict:
        return {"shallow": self.shallow, "middle": self.middle, "deep": self.deep}


class StaticConceptDecoder(ConceptDecoder):
    """:class:`ConceptDecoder` with static caches and a step compiled in the mode of ``compile_choice`` (None:
    the same step, eager). ``new_tokens``: the most steps it will run. A model with a static budget only."""

    static = True  # generate() runs its device loop (concept.generation._device_loop)

    def __init__(self, model, new_tokens: int, compile_choice: str | None = "on"):
        super().__init__(model)
        if not model.max_ratio:
            raise ValueError("static decoding needs a static concept budget (BuildConfig.max_ratio)")
        self.new_tokens = new_tokens
        self.compile_choice = compile_choice

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        logits = super().prefill(input_ids, valid)
        B, dev = input_ids.shape[0], input_ids.device
        self.cache = StaticConceptCache(self.model, self.cache, self.new_tokens)
        for name in ("pos", "num_concepts", "has_update", "last_update"):
            setattr(self, name, static(getattr(self, name).clone()))
        self.recent = tuple(static(x.clone()) for x in self.recent)
        self.state = pytree.tree_map(lambda x: static(x.clone()), self.state)
        self.decisions = static(torch.zeros(B, self.cache.shallow.capacity, dtype=torch.bool, device=dev))
        self.fed = static(torch.zeros(B, dtype=torch.long, device=dev))  # tokens fed per row (active steps)
        self.tail_high = static(self.cache.deep.tail_entries().max().reshape(1))
        self._step = CompiledStep(self.step_eager, self.compile_choice, dev.type)
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        active = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device) if active is None else active
        return self._step(tokens, active)

    def step_eager(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """``ConceptDecoder.step`` on static caches, every change in place (what is compiled)."""
        model, cache = self.model, self.cache
        pos = self.pos[:, None].clone()  # (self.pos changes in place at the end)

        # shallow: every token
        x = model.positions.add_text_type(model.inner.embed_tokens(tokens[:, None]))
        text_pos = model.positions.text_positions(pos)
        h = model.run_stack(model.shallow, x, text_pos, DecodePattern(cache.shallow.begin(active)), cache.shallow)
        cache.shallow.commit()

        # the step-wise decision (capped by the static budget), then which concept
        head_logits = model.vocabulary.logits(h)
        keep, state = model.length_policy.step(h[:, 0], head_logits[:, 0], self.state)
        for old, new in zip(pytree.tree_leaves(self.state), pytree.tree_leaves(select_rows(active, state, self.state))):
            old.copy_(new)
        keep = keep.bool() & active
        keep = keep & (self.num_concepts // model.emit < packing.budget(self.pos + 1, model.max_ratio, model.budget_slack))
        probs, ids = model.codes(h, head_logits)
        for old, new in zip(self.recent, (h, probs, ids, pos)):
            old.copy_(torch.where(active.view(-1, *[1] * (old.dim() - 1)), torch.cat([old[:, 1:], new], dim=1), old))

        # the concept path runs for every row; only the rows emitting one (keep) write an entry
        c, c_in, concept_pos = concept_slots(model, self.recent, self.num_concepts, pos, keep, cache)
        tail_in = model.fuse_step(h, self.last_update, self.has_update)
        deep_in = torch.where(keep[:, None, None], c, tail_in)
        deep_pos = torch.where(keep[:, None], concept_pos, text_pos)
        self.last_update.copy_(torch.where(keep[:, None, None], c - c_in, self.last_update))
        self.has_update |= keep

        # deep: the last concept slot, or the NULL token joining the tail
        z = model.run_stack(model.deep, deep_in, deep_pos, DecodePattern(cache.deep.begin(active, ~keep)), cache.deep)
        cache.deep.commit()

        at = self.fed[:, None]
        self.decisions.scatter_(1, at, torch.where(active[:, None], keep[:, None], self.decisions.gather(1, at)))
        self.fed += active.long()
        self.pos += active.long()
        self.num_concepts += keep.long() * model.emit
        self.tail_high.copy_(torch.maximum(self.tail_high, cache.deep.tail_entries().max()))
        return model.backbone.lm_head(model.inner.norm(z))[:, 0]

    # -- read back once, at the end ------------------------------------------------------------
    @property
    def keep(self) -> list[list[bool]]:
        """Per row: which tokens emitted a concept (the prompt's, then the fed tokens')."""
        if not hasattr(self, "decisions"):
            return self.prompt_keep
        fed, decisions = self.fed.tolist(), self.decisions.tolist()
        return [k + d[:n] for k, d, n in zip(self.prompt_keep, decisions, fed)]

    @keep.setter
    def keep(self, value) -> None:
        self.prompt_keep = value

    @property
    def max_tail(self) -> int:
        return int(self.tail_high) if hasattr(self, "tail_high") else self.prompt_max_tail

    @max_tail.setter
    def max_tail(self, value: int) -> None:
        self.prompt_max_tail = value

    def extend(self, tokens):  # pragma: no cover - generate() never asks a static decoder for a block
        raise NotImplementedError("multi-token decoding runs on the eager decoder (leave --compile off with --mtp)")
