"""The streaming model's step-wise decoder: a prompt's prefill, then one token per row per step (docs/decoding.md).

:class:`ConceptDecoder` runs the streaming model online. The prompt goes through the one-pass
forward, whose keys and values fill three caches; then every new token

1. goes through the shallow stack (shallow cache: every token),
2. is classified by the head, and the length policy's *step-wise* rule decides keep / NULL,
3. if it emits a concept: the deep cache drops its tail, the concept's embedding goes through
   the middle stack (middle cache: concepts only) and its output enters the deep stack (a
   policy that emits M concepts at once pushes M slots through, one after the other, with
   ids from the last M tokens); if NULL: its shallow state enters the deep stack as a tail
   token,
4. the deep output gives the next-token logits.

The logits of every step equal the teacher-forced one-pass logits with the same decisions
(``tests/test_decoding.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from .. import packing
from ..compiled import PREFILL_BUCKET
from ..contracts import DecidesWithState
from ..decoding import last_real, select_rows
from ..errors import ConceptError
from ..kv_cache import ConceptCache, DecodePattern
from ..syncs import declared


def _scored(out) -> dict:
    """The keep score a forward computed, as ``decide_with_state``'s keyword (none if it computed none)."""
    return {} if getattr(out, "keep_logit", None) is None else {"keep_logit": out.keep_logit}


class ConceptDecoder:
    """Online decoding of a :class:`concept.streaming.model.ConceptModel` with its three KV caches."""

    def __init__(self, model):
        self.model = model
        self.tail_peak = None  # [] largest deep tail held so far (entries per layer), on the device
        self._fed = []  # (keep, active) [B] of the steps since ``keep`` was last read, on the device

    @property
    def max_tail(self) -> int:
        """The largest deep tail held so far (entries per layer), read when asked."""
        return 0 if self.tail_peak is None else int(self.tail_peak)

    @property
    def keep(self) -> list[list[bool]]:
        """Each row's decisions: the prompt's, then one per token fed (read in one copy when asked)."""
        if self._fed:
            keeps, actives = (torch.stack(x, 1).tolist() for x in zip(*self._fed))
            self._fed = []
            for row, ks, fed in zip(self._keep, keeps, actives):
                row.extend(k for k, a in zip(ks, fed) if a)
        return self._keep

    @keep.setter
    def keep(self, value: list[list[bool]]) -> None:
        self._keep, self._fed = value, []

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One-pass forward over the prompts (left-padded) -> next-token logits [B, V]."""
        model, B = self.model, input_ids.shape[0]
        if model.compiled_stacks is not None:  # compiled: a few prompt widths (more left padding), a few graphs
            pad = -input_ids.shape[1] % PREFILL_BUCKET
            input_ids, valid = F.pad(input_ids, (pad, 0)), F.pad(valid, (pad, 0))
        self.cache = ConceptCache(B, input_ids.device)
        left_padded = bool(valid[:, -1].all())
        out = model(input_ids, attention_mask=valid, cache=self.cache, logits_to_keep=int(left_padded))
        self.cache.adopt(valid, out.layout, out.deep_sequence)  # (what the deep caches recorded over)
        self.pos = valid.sum(1)  # position of the next token of each row
        self.num_concepts = out.keep.sum(1) * model.emit  # concept slots so far
        self.keep = [out.keep[b, valid[b]].tolist() for b in range(B)]
        self.state = self._replay(out, valid)
        # the last M real tokens of each row (M concepts per boundary): where the next concepts take their ids from
        M = model.emit // model.levels
        src = (last_real(valid)[:, None] - (M - 1) + torch.arange(M, device=valid.device)).clamp(min=0)
        h_src = out.shallow.gather(1, src[..., None].expand(-1, -1, out.shallow.shape[-1]))
        probs, ids = model.codes(h_src, out.head_logits.gather(1, src[..., None].expand(-1, -1, out.head_logits.shape[-1])))
        positions = packing.time_positions(valid).gather(1, src)
        self.recent = (h_src, probs, ids, positions)
        # tail fusion: each row's latest concept's middle-stack update (what its next tail tokens receive)
        d = out.shallow.shape[-1]
        self.has_update = self.num_concepts > 0
        self.last_update = out.shallow.new_zeros(B, 1, d)
        if out.updates is not None:
            last = (self.num_concepts - 1).clamp(min=0)
            self.last_update = out.updates.gather(1, last[:, None, None].expand(-1, 1, d))
        self.tail_peak = self.cache.deep.tail_entries().max() if B else None
        return out.logits[:, -1] if left_padded else out.logits[torch.arange(B, device=valid.device), last_real(valid)]

    def _replay(self, out, valid):
        """The length policy's step-wise state after the prompt, by stepping its rule over the
        prefill's head outputs; its decisions must be the batched ones."""
        policy = self.model.length_policy
        if isinstance(policy, DecidesWithState):  # a scan of the step rule: the same computation as decide()
            keep, state = policy.decide_with_state(out.shallow, out.head_logits, valid, **_scored(out))
            if self.model.max_ratio:  # the static budget drops what the policy's state still counts as emitted
                keep = packing.cap_boundaries(keep.bool(), valid, self.model.max_ratio, slack=self.model.budget_slack)
            if not torch.equal(keep, out.keep):
                raise ConceptError(f"length policy {type(policy).__name__}: decide_with_state() disagrees with decide()")
            return state
        state = policy.init_state(valid.shape[0], valid.device)
        steps = []
        for t in range(valid.shape[1]):
            keep, new = policy.step(out.shallow[:, t], out.head_logits[:, t], state)
            steps.append(keep.bool() & valid[:, t])
            state = select_rows(valid[:, t], new, state)
        steps = torch.stack(steps, 1)
        if self.model.max_ratio:
            steps = packing.cap_boundaries(steps, valid, self.model.max_ratio, slack=self.model.budget_slack)
        differ = (steps != out.keep).any(0).nonzero()  # one host sync, not one per token
        if len(differ):
            raise ConceptError(
                f"length policy {type(policy).__name__}: its step-wise decision differs from its batched "
                f"one at prompt position {int(differ[0])}; decoding would not match training (fix the policy's step())")
        return state

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row [B] -> next-token logits [B, V]. Rows not ``active`` (finished
        generations) still run, batched, but nothing of theirs is kept: no cache entry, no
        change of position, policy state or decisions."""
        model, cache = self.model, self.cache
        B = tokens.shape[0]
        active = torch.ones(B, dtype=torch.bool, device=tokens.device) if active is None else active
        pos = self.pos[:, None]

        # shallow: every token
        x = model.positions.add_text_type(model.inner.embed_tokens(tokens[:, None]))
        text_pos = model.positions.text_positions(pos)
        h = model.run_stack(model.shallow, x, text_pos, DecodePattern(cache.shallow.begin(active)), cache.shallow)
        cache.shallow.commit()

        # the step-wise decision, then which concept
        head_logits = model.vocabulary.logits(h)
        keep, state = model.length_policy.step(h[:, 0], head_logits[:, 0], self.state)
        self.state = select_rows(active, state, self.state)
        keep = keep.bool() & active
        if model.max_ratio:  # the static budget (packing.cap_boundaries) for this row's (pos + 1)-th real token
            keep = keep & (self.num_concepts // model.emit < packing.budget(self.pos + 1, model.max_ratio,
                                                                            model.budget_slack))
        probs, ids = model.codes(h, head_logits)
        shifted = (torch.cat([old[:, 1:], new], dim=1) for old, new in zip(self.recent, (h, probs, ids, pos)))
        self.recent = tuple(select_rows(active, new, old) for new, old in zip(shifted, self.recent))

        # a concept drops the row's tail; its slots go through the middle stack, then the deep one
        deep_in, deep_pos = model.fuse_step(h, self.last_update, self.has_update), text_pos
        with declared("decoder concept check"):  # the middle stack runs only when some row emits a concept
            any_concept = bool(keep.any())  # (the static decoder runs it always, reading nothing)
        if any_concept:
            c, c_in, concept_pos = concept_slots(model, self.recent, self.num_concepts, pos, keep, cache)
            deep_in = torch.where(keep[:, None, None], c, deep_in)
            deep_pos = torch.where(keep[:, None], concept_pos, text_pos)
            self.last_update = torch.where(keep[:, None, None], c - c_in, self.last_update)  # the last slot's
            self.has_update = self.has_update | keep

        # deep: the last concept slot, or the NULL token joining the tail
        z = model.run_stack(model.deep, deep_in, deep_pos, DecodePattern(cache.deep.begin(active, ~keep)), cache.deep)
        cache.deep.commit()

        self.pos = self.pos + active.long()
        self.num_concepts = self.num_concepts + keep.long() * model.emit
        self._fed.append((keep, active))
        self.tail_peak = torch.maximum(self.tail_peak, cache.deep.tail_entries().max())
        return model.backbone.lm_head(model.inner.norm(z))[:, 0]

    def draft_state(self) -> torch.Tensor:
        """[B, d] the state the MTP heads read for the last fed token: its shallow state."""
        return self.recent[0][:, -1]

    # -- several tokens per row at once (multi-token decoding, concept.multitoken) ------------
    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``n`` tokens per row [B, n] in one forward of each stack -> next-token logits
        [B, n, V], exactly what ``n`` calls of :meth:`step` would give. Nothing is kept until
        :meth:`accept` says how many of them each row keeps (a draft's rejected suffix leaves no
        trace: no cache entry, no concept, no policy state). Policies emitting one concept per
        boundary only."""
        model, cache = self.model, self.cache
        if model.emit != 1:
            raise ConceptError(f"multi-token decoding needs one concept slot per boundary (this model has {model.emit}: "
                               f"a policy emitting several concepts, or multi-level codes); decode one token at a time")
        B, n = tokens.shape
        dev = tokens.device
        index = torch.arange(n, device=dev)
        causal = (index[None, :] <= index[:, None]).expand(B, n, n)  # [B, j, i]: i <= j
        pos = self.pos[:, None] + index

        # shallow: every token, causal among the new ones
        x = model.positions.add_text_type(model.inner.embed_tokens(tokens))
        text_pos = model.positions.text_positions(pos)
        mask = cache.shallow.begin_many(n, None, causal)
        h = model.run_stack(model.shallow, x, text_pos, DecodePattern(mask), cache.shallow)
        shallow_slots = cache.shallow.end_many()

        # the step-wise decisions, in order (the state after each token is kept for accept())
        head_logits = model.vocabulary.logits(h)
        keep, states = self._decisions(h, head_logits)
        probs = model.concept_probs(head_logits)
        ids = probs.argmax(-1)

        # middle: every new token's concept input runs (n is small); an element sees the cached
        # concepts, the new concepts before it and itself; only the concepts will be committed
        rank = self.num_concepts[:, None] + torch.cumsum(keep.long(), 1) - keep.long()
        c_in = model.positions.add_concept_type(model.concept_inputs(probs, ids, index.expand(B, n), h))
        mask = cache.middle.begin_many(n, None, causal & (keep[:, None, :] | torch.eye(n, dtype=torch.bool, device=dev)))
        c = model.run_stack(model.middle, c_in, model.positions.concept_positions(pos, rank, "middle"), DecodePattern(mask),
                            cache.middle)
        middle_slots = cache.middle.end_many()

        # deep: a concept, or a NULL token fused with its row's latest concept's update before it
        latest = torch.cummax(torch.where(keep, index, torch.full_like(index, -1).expand(B, n)), dim=1).values
        update = c - c_in
        before = update.gather(1, latest.clamp(min=0)[..., None].expand_as(update))
        last_update = torch.where((latest >= 0)[..., None], before, self.last_update.expand_as(update))
        tail_in = model.fuse_step(h, last_update, self.has_update[:, None] | (latest >= 0))
        deep_in = torch.where(keep[..., None], c, tail_in)
        deep_pos = torch.where(keep, model.positions.concept_positions(pos, rank, "deep"), text_pos)
        seg = torch.cumsum(keep.long(), 1)  # new concepts up to and including j
        # cached concepts always; the cached tail until a new concept; new: concepts, and the own segment
        old = ~(cache.deep.tail[:, None, :] & (seg > 0)[..., None])
        new = causal & (keep[:, None, :] | (~keep[:, :, None] & (seg[:, :, None] == seg[:, None, :])))
        mask = cache.deep.begin_many(n, old, new)
        z = model.run_stack(model.deep, deep_in, deep_pos, DecodePattern(mask), cache.deep)
        deep_slots = cache.deep.end_many()

        self._pending = dict(tokens=tokens, keep=keep, states=states, slots=(shallow_slots, middle_slots, deep_slots),
                             recent=(h, probs, ids, pos), update=update)
        return model.backbone.lm_head(model.inner.norm(z))

    def _decisions(self, h, head_logits):
        """The length policy's step rule over ``n`` new tokens in order, from the rows' current state: (the
        boundaries [B, n] under the static budget, continuing the rows' counts; the state after each token)."""
        model, state, keeps, states = self.model, self.state, [], []
        for j in range(h.shape[1]):
            k, state = model.length_policy.step(h[:, j], head_logits[:, j], state)
            keeps.append(k.bool())
            states.append(state)
        keep = torch.stack(keeps, 1)
        if model.max_ratio:  # the static budget, continuing the row's counts
            keep = packing.cap_boundaries(keep, torch.ones_like(keep), model.max_ratio, self.num_concepts // model.emit,
                                          self.pos, model.budget_slack)
        return keep, states

    @torch.no_grad()
    def accept(self, count: torch.Tensor) -> None:
        """Keep the first ``count[b]`` (0..n) tokens of row b's last :meth:`extend`, as if exactly
        they had gone through :meth:`step` one by one; forget the rest."""
        p, cache = self._pending, self.cache
        self._pending = None
        keep, (shallow_slots, middle_slots, deep_slots) = p["keep"], p["slots"]
        B, n = keep.shape
        index = torch.arange(n, device=keep.device)
        count = count.clamp(0, n)
        accepted = index[None, :] < count[:, None]
        concepts = accepted & keep
        cache.shallow.commit_many(shallow_slots, accepted)
        cache.middle.commit_many(middle_slots, concepts)
        any_concept = concepts.any(1)
        cache.deep.drop_tail(any_concept)
        last = torch.where(concepts, index, torch.full_like(index, -1).expand(B, n)).amax(1)  # last accepted concept
        cache.deep.commit_many(deep_slots, accepted & (keep | (index[None, :] > last[:, None])), tail=~keep)

        took, at = count > 0, (count - 1).clamp(min=0)
        rows = torch.arange(B, device=keep.device)
        stacked = pytree.tree_map(lambda *xs: torch.stack(xs, 1)[rows, at], *p["states"])
        self.state = select_rows(took, stacked, self.state)
        self.recent = tuple(select_rows(took, x[rows, at][:, None], old) for x, old in zip(p["recent"], self.recent))
        latest = p["update"][rows, last.clamp(min=0)][:, None]
        self.last_update = torch.where(any_concept[:, None, None], latest, self.last_update)
        self.has_update = self.has_update | any_concept
        self.pos = self.pos + count
        self.num_concepts = self.num_concepts + concepts.sum(1)
        for b, (k, c) in enumerate(zip(keep.tolist(), count.tolist())):
            self.keep[b].extend(k[:c])
        self.tail_peak = torch.maximum(self.tail_peak, cache.deep.tail_entries().max())

    def kv_stats(self) -> list[dict]:
        """Per row: KV entries held by each stack (summed over its layers), bytes, and the dense
        backbone's bytes for the same tokens (:func:`kv_stats`)."""
        return kv_stats(self)


def concept_slots(model, recent, num_concepts, pos, keep, cache):
    """The concept of the rows that emit one (``keep``) through the middle stack, slot by slot, and all but its
    last slot into the deep cache (the row's tail dropped first); ``recent``: the last tokens' (h, probs, ids,
    positions). Returns the last slot's middle output, its input and its deep positions (eager and static
    decoders alike: ``concept.streaming.static_decoding``)."""
    cache.deep.drop_tail(keep)
    for s in range(model.emit):  # slot s: level s % L of the concept from token t - M + 1 + s // L
        m, level = divmod(s, model.levels)
        h_m, probs_m, ids_m, pos_m = (x[:, m:m + 1] for x in recent)
        rank = (num_concepts + s)[:, None]
        level = None if model.levels == 1 else torch.full_like(pos, level)
        c_in = model.positions.add_concept_type(model.concept_inputs(probs_m, ids_m, torch.zeros_like(pos), h_m, level))
        middle_pos = model.positions.concept_positions(pos_m, rank, "middle")
        c = model.run_stack(model.middle, c_in, middle_pos, DecodePattern(cache.middle.begin(keep)), cache.middle)
        cache.middle.commit()
        concept_pos = model.positions.concept_positions(pos_m, rank, "deep")
        if s < model.emit - 1:  # an earlier slot: into the deep cache, its output is not read
            model.run_stack(model.deep, c, concept_pos, DecodePattern(cache.deep.begin(keep)), cache.deep)
            cache.deep.commit()
    return c, c_in, concept_pos


def kv_stats(decoder) -> list[dict]:
    """Per row of ``decoder`` (a :class:`ConceptDecoder`): KV entries held by each stack (summed over its
    layers), bytes, and the dense backbone's bytes for the same tokens."""
    model, cache = decoder.model, decoder.cache
    n_layers = dict(zip(("shallow", "middle", "deep"), model.split))
    entry = max(c.entry_bytes() for c in cache.stacks().values())
    counts = {name: (c.entries() * n_layers[name]).tolist() for name, c in cache.stacks().items()}
    tails = cache.deep.tail_entries().tolist()
    rows = []
    for b, tokens in enumerate(decoder.pos.tolist()):
        entries = {name: counts[name][b] for name in counts}
        total = sum(entries.values())
        rows.append({"tokens": tokens, "concepts": int(decoder.num_concepts[b]), "tail": tails[b],
                     "max_tail": decoder.max_tail, "entries": entries, "bytes": total * entry,
                     "dense_bytes": sum(model.split) * tokens * entry,
                     "allocated_bytes": sum(c.allocated_bytes() for c in cache.stacks().values())})
    return rows
