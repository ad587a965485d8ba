"""The streaming concept model, readable top to bottom.

    tokens --embed--> shallow (Ls layers, every token, causal)
           --head--> sampler --> length policy: keep[t], concept ids
           concepts --> middle (Lm layers, concepts only, causal among concepts)
           tail tokens --tail fusion--> (+ their segment's latest concept's middle update)
           [concepts ; tail tokens] --> deep (Ld layers, packed one-pass mask) --> norm --> LM head

A concept's input is, with the identity start (the default), the emitting token's shallow
state plus its discrete embedding behind a gate that starts at zero: with every token a
concept the model is then exactly the backbone (tested). With multi-level codes (a `codebook`
vocabulary with L levels) a concept is L consecutive concept slots, one code level each.

The backbone's decoder layers are reused unchanged; their attention is routed through
``concept.attention`` with a plan object per stack. One forward pass is O(T): there is no
loop over positions (see ``concept.packing`` for the layout and the mask rule). What each token
emits (its boundary, its codes, its concept's input) is ``concept.streaming.emission``'s part.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .. import packing
from ..attention import CausalPattern
from ..backbone import decoder
from ..codes import CodeUse
from ..contracts import Gated, ReadsPredictor
from ..generation import GenerationMixin
from ..hub import HubMixin
from ..lazy import Deferred, LazyField
from ..losses import head_next_token_loss
from ..resolved import Resolved
from . import budget
from .emission import ConceptEmission
from .stacks import StackRuns


@dataclass
class ConceptOutput:
    logits: torch.Tensor = LazyField()  # [B, T, V] next-token logits for every position (computed when first read)
    keep: torch.Tensor  # [B, T] bool: token t emitted a concept
    concept_ids: torch.Tensor  # [B, T] concept id where keep, else -1
    head_logits: torch.Tensor  # [B, T, K(+1)] ConceptHead output
    loss: torch.Tensor | None = None  # mean next-token CE over real positions, when labels are given
    layout: packing.PackedLayout | None = None
    shallow: torch.Tensor | None = None  # [B, T, d] shallow states h (what the head read)
    deep_input: torch.Tensor | None = LazyField(None)  # [B, T, d] the deep stack's input element of each position t
    # (gathered to time order when first read: the alignment objective reads it, a training step need not)
    hidden: torch.Tensor | None = None  # [B, T, d] the deep stack's output at t (before the final norm)
    updates: torch.Tensor | None = None  # [B, C, d] each concept slot's middle-stack update (tail fusion)
    codes: torch.Tensor | None = None  # [B, T, L] every level's code where keep, else -1 (multi-level codes)
    capped: torch.Tensor | None = None  # [] the policy's boundaries the static budget dropped (None: no budget)
    keep_logit: torch.Tensor | None = None  # [B, T] the length policy's keep score, computed once (``keep_score``)
    valid: torch.Tensor | None = None  # [B, T] bool: the real tokens (the attention mask the forward read)
    # the sequence the deep stack ran over (``layout`` or its ``packing.DeepBlock``), where a KV cache recorded the
    # stacks (a prefill: ``ConceptCache.adopt`` reads the deep caches' slots by it); None otherwise
    deep_sequence: packing.PackedLayout | packing.DeepBlock | None = None


def in_time_order(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x`` [B, S, d] over the deep stack's slots, gathered to time order: ``slots`` [B, T] is each position's slot."""
    return x.gather(1, slots[..., None].expand(-1, -1, x.shape[-1]))


class ConceptGate(nn.Module):
    """Identity start: a concept's input is ``h_src + gate * e`` (the emitting token's shallow state
    plus its discrete embedding), with ``gate`` [d] starting at 0: the discrete path opens as it trains.

    ``relative`` (``--concept-input identity-scaled``): the gate is measured in units of the shallow state,
    ``h_src + gate * e * rms(h_src) / rms(e)`` per concept (the embedding's direction, at the state's scale), so a gate of 0.1 adds an embedding of a tenth
    of the state's RMS whatever the two scales (SmolLM2's shallow states have RMS ~9, the embeddings ~0.06:
    an absolute gate must grow ~150x further before the id matters)."""

    def __init__(self, hidden_size: int, relative: bool = False):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(hidden_size))
        self.relative = relative

    def forward(self, h, e):
        h = h.to(e.dtype)
        if self.relative:
            rms = lambda x: x.float().pow(2).mean(-1, keepdim=True).sqrt()  # noqa: E731
            e = e * (rms(h) / rms(e).clamp_min(1e-6)).to(e.dtype)
        return h + self.gate.to(e.dtype) * e


class ConceptModel(ConceptEmission, StackRuns, Resolved, GenerationMixin, HubMixin, nn.Module):
    family = "streaming"  # its `concept.families` entry (concept.streaming.family.Streaming)

    def __init__(self, backbone, split, vocabulary, length_policy, sampler, eval_sampler, positions, attention,
                 tail_fusion=None, identity_start=False, relative_gate=False, resolution=None, tokenizer=None):
        super().__init__()
        self.backbone = backbone  # HF *ForCausalLM, frozen
        self.vocabulary = vocabulary
        self.length_policy = length_policy
        self.sampler = sampler
        self.eval_sampler = eval_sampler
        self.positions = positions
        self.attention = attention  # backend object (no parameters)
        self.tail_fusion = tail_fusion
        self.concept_gate = ConceptGate(backbone.config.hidden_size, relative_gate) if identity_start else None
        self.split = tuple(split)
        self.levels = vocabulary.levels  # code levels per concept (multi-level codebooks)
        self.level_beam = getattr(getattr(vocabulary, "config", None), "beam", 1)  # inference search over levels
        self.emit = length_policy.emit * self.levels  # concept slots per emitting token
        self.resolution = resolution  # the build resolution (config + provenance; concept.resolved)
        # static shapes: a row's n-th real token keeps its boundary only within ceil(max_ratio * n): the build's
        # setting (a number, "auto", "none"; concept.streaming.budget), resolved at each forward (``max_ratio``)
        self.budget_setting = getattr(getattr(resolution, "config", None), "max_ratio", 0.0) or 0.0
        self.tokenizer = tokenizer
        inner = decoder(backbone)
        n_shallow, n_middle, _ = self.split
        self.shallow = list(inner.layers[:n_shallow])  # views: the modules stay registered in the backbone
        self.middle = list(inner.layers[n_shallow:n_shallow + n_middle])
        self.deep = list(inner.layers[n_shallow + n_middle:])
        self.gradient_checkpointing = False  # recompute layer activations in backward to save memory
        self.compiled_stacks = None  # --compile: the stacks' compiled run_layers (concept.compiled)
        # a static layout's deep stack over one block of concepts and tail (``packing.DeepBlock``) where the
        # attention backend plans it; False: over the layout's [concepts ; tail] (the same outputs; benchmarks
        # and tests compare the two)
        self.deep_block = True
        if isinstance(length_policy, ReadsPredictor):  # e.g. `entropy`: the backbone's own next-token lens
            length_policy.predictor = lambda h: self.backbone.lm_head(self.inner.norm(h))

    # -- pieces --------------------------------------------------------------------------
    @property
    def max_ratio(self) -> float:
        """The static budget now (0.0: none): the build's ``max_ratio`` resolved against the length policy
        (``auto``: from its target ratio, read on the host; ``concept.streaming.budget``)."""
        return budget.resolve(self.budget_setting, self.length_policy)

    @max_ratio.setter
    def max_ratio(self, value) -> None:
        self.budget_setting = value

    @property
    def budget_slack(self) -> int:
        """Boundaries a row may have beyond ``ceil(max_ratio * n)`` (``auto``: a burst at a row's start)."""
        return budget.slack(self.budget_setting, self.length_policy)

    @contextmanager
    def budget_off(self):
        """The model without its static budget inside the block (the dynamic layout): for forced decisions that
        ask for more boundaries than any budget holds, e.g. the keep-all control (every token a concept)."""
        saved, self.budget_setting = self.budget_setting, 0.0
        try:
            yield self
        finally:
            self.budget_setting = saved

    @property
    def inner(self) -> nn.Module:
        return decoder(self.backbone)

    @property
    def mtp_heads(self):
        """The MTP heads (``concept.mtp.MTPHeads``) of a length policy that has them (`mtp`), else None."""
        return getattr(self.length_policy, "heads", None)

    @staticmethod
    def mtp_state(out: ConceptOutput) -> torch.Tensor:
        """The states the MTP heads read: the shallow states (see plugins/length_policies/mtp.py)."""
        return out.shallow

    def concept_slots(self, T: int) -> int | None:
        """Concept slots per row of a static layout over T tokens (``max_ratio``), None without a budget."""
        return min(T, packing.budget(T, self.max_ratio, self.budget_slack)) * self.emit if self.max_ratio else None

    def deep_layout(self, layout):
        """The deep stack's sequence: the static ``layout``'s :class:`~concept.packing.DeepBlock` (as wide as the
        tokens with one concept per boundary, where the layout is the budget's concept slots wider) if the
        attention backend plans one, else the layout itself. A prefill's KV caches record the deep stack over it
        and keep its real entries in the same order either way (``ConceptCache.adopt``: each row's concepts, then
        its tail, which both sequences hold in that order)."""
        if not (layout.static and self.plans_deep_block()):
            return layout
        return packing.deep_block(layout)

    def plans_deep_block(self) -> bool:
        """Whether a static layout's deep stack runs over its :class:`~concept.packing.DeepBlock` (``deep_block``
        and an attention backend that plans one)."""
        return self.deep_block and getattr(self.attention, "plans_deep_block", False)

    def fuse_tail(self, tail, updates, layout):
        """Tail states [B, L, d] entering the deep stack, fused with their segment's latest concept's
        middle-stack update (``updates`` [B, C, d]; none before a document's first concept)."""
        if self.tail_fusion is None or not self.tail_fusion.needs_update:
            return tail
        meta = layout.tail_meta
        if layout.num_concepts == 0:
            return self.tail_fusion(tail, torch.zeros_like(tail), torch.zeros_like(meta.valid))
        seg = torch.where(meta.valid, meta.seg, 0)
        last = (seg * layout.emit - 1).clamp(min=0)  # the segment's latest concept: the last slot of its boundary
        has = meta.valid & (seg >= 1) & (layout.concept_meta.doc.gather(1, last) == meta.doc)
        update = updates.gather(1, last[..., None].expand(-1, -1, updates.shape[-1]))
        return self.tail_fusion(tail, update, has)

    def deep_inputs(self, h, c, updates, layout, deep):
        """The deep stack's inputs [B, L, d]: the middle stack's concepts ``c`` and the tail tokens' shallow states
        ``h`` (fused with their segment's update), in the layout's order ``[concepts ; tail]``, or moved to its
        deep block (``deep``, each row's concepts, then its tail)."""
        tail = h.gather(1, layout.tail_src[..., None].expand(-1, -1, h.shape[-1]))
        z_in = torch.cat([c, self.fuse_tail(tail, updates, layout)], dim=1)
        if deep is layout:
            return z_in
        return z_in.gather(1, deep.src[..., None].expand(-1, -1, z_in.shape[-1]))

    def fuse_step(self, h, update, has):
        """Decoding: NULL tokens' deep inputs [B, n, d] from their shallow states, the row's latest
        concept's middle update before each ([B, 1 or n, d]) and whether there is one ([B] or [B, n])."""
        if self.tail_fusion is None or not self.tail_fusion.needs_update:
            return h
        has = has[:, None].expand(-1, h.shape[1]) if has.dim() == 1 else has
        return self.tail_fusion(h, update.to(h.dtype).expand_as(h), has)

    def middle_inputs(self, probs, token_ids, h, head_logits, keep, valid, starts, layout, perturb=None,
                      perturb_codes=None):
        """The packed concepts' inputs to the middle stack [B, C, d] (``concept_inputs``; in training times the
        straight-through gate of a gated policy's soft boundary; ``perturb`` / ``perturb_codes``: the
        diagnostics' controls, see ``forward``), with the concept type added."""
        codes = None if perturb_codes is None else lambda e, level: perturb_codes(e, layout.concept_meta.valid, level)
        c = self.concept_inputs(probs, token_ids, layout.concept_id_src, h, layout.concept_level, codes)
        if self.training and torch.is_grad_enabled() and isinstance(self.length_policy, Gated):
            # straight-through gate of the policy's soft boundary (forward value exactly 1)
            g = self.length_policy.gate(h, head_logits, keep, valid, starts).gather(1, layout.concept_src)
            c = c * (1 + (g - g.detach()))[..., None].to(c.dtype)
        if perturb is not None:
            c = perturb(c, layout.concept_meta.valid)
        return self.positions.add_concept_type(c)

    # -- forward -------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, keep=None, labels=None, document_ids=None,
                concept_ids=None, cache=None, logits_to_keep=0, perturb=None, perturb_codes=None) -> ConceptOutput:
        """Logits for every position in one O(T) pass.

        attention_mask [B, T]: 1 for real tokens (either padding side). keep [B, T]: force the
        decisions. document_ids [B, T]: several documents packed in a row (attention, positions
        and runs of NULLs never cross a document boundary). concept_ids [B, T] ([B, T, L] with L code
        levels): replace the concept ids read from the tokens where it is >= 0 (diagnostics, e.g. shuffled concepts). cache: a
        ``concept.kv_cache.ConceptCache`` that records each stack's keys and values (prefill).
        logits_to_keep: compute logits for the last n positions only (0: all), as in transformers.
        perturb: ``f(inputs [B, C, d], valid [B, C]) -> inputs`` replaces the concepts' whole inputs
        before the middle stack (diagnostics: the ΔNLL controls). perturb_codes: ``f(e [B, C, d], valid [B, C],
        level [B, C] | None) -> e`` replaces only their discrete embeddings, each slot keeping its continuous
        part (the identity start's shallow state, a latent-feedback sampler's mix): the code-only controls.
        """
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        doc = document_ids
        starts = packing.document_starts(valid, doc)
        pos = packing.time_positions(valid, doc, starts)
        static = bool(self.max_ratio)  # shapes from (B, T, build) alone, nothing read back to the host
        plain = attention_mask is None and doc is None

        # shallow: every token, causal
        h = self.shallow_states(input_ids, valid, doc, pos, None if cache is None else cache.shallow,
                                causal=True if plain else (False if static else None))

        # concept decisions (every token's would-be concept: with emit > 1 ids also come from earlier tokens)
        head_logits = self.vocabulary.logits(h)
        keep_logit = self.keep_score(h, head_logits) if keep is None else None  # (the decision, ratio loss, PI read it)
        chosen, keep = self.boundaries(h, head_logits, valid, keep, starts, keep_logit)  # (with what the cap dropped)
        probs, token_ids = self.codes(h, head_logits)
        capped = (chosen.sum() - keep.sum()) if static else None
        if concept_ids is not None:
            token_ids = torch.where(concept_ids >= 0, concept_ids, token_ids)
        emitted = torch.where(keep.view(*keep.shape, *(1,) * (token_ids.dim() - 2)), token_ids, -1)
        layout = packing.pack(keep, valid, doc, self.emit, self.levels, self.concept_slots(input_ids.shape[1]))
        deep = self.deep_layout(layout)  # the deep stack's sequence: the layout, or its deep block

        # middle: concepts only, causal among concepts
        c = self.middle_inputs(probs, token_ids, h, head_logits, keep, valid, starts, layout, perturb, perturb_codes)
        (middle_pos, middle_rope), (deep_pos, deep_rope) = self.concept_stack_positions(c, pos, layout, deep)
        c, updates = self.run_middle(c, layout, middle_pos, doc, static, None if cache is None else cache.middle,
                                     middle_rope)

        # deep: [concepts ; tail tokens] with the one-pass mask, original positions
        z_in = self.deep_inputs(h, c, updates, layout, deep)
        z = self.run_stack(self.deep, z_in, deep_pos, self.attention.plan(deep),
                           None if cache is None else cache.deep, deep_rope)

        # back to time order; element t predicts token t + 1
        slots = deep.slot_of_time[:, -logits_to_keep:] if logits_to_keep else deep.slot_of_time
        z = in_time_order(z, slots)
        states, head = self.inner.norm(z), self.backbone.lm_head
        loss = None if labels is None else head_next_token_loss(states, head, labels, valid, doc, self.compiled_stacks)
        multi = self.levels > 1
        return ConceptOutput(Deferred(head, states, watch=head), keep, emitted[..., 0] if multi else emitted, head_logits, loss, layout, h,
                             Deferred(in_time_order, z_in, slots), z, updates, emitted if multi else None,
                             capped, keep_logit, valid, None if cache is None else deep)

    def skip_middle(self, input_ids, attention_mask=None, document_ids=None) -> torch.Tensor:
        """Logits [B, T, V] of every position as a tail token with no concept before it: the backbone
        with its middle stack skipped (shallow -> tail fusion without an update -> deep, plain causal
        attention). Equal to ``forward(keep=all False).logits`` (tested), without the head, the sampler
        or the packing; the placement objective reads it to see where the middle stack is needed."""
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        pos = packing.time_positions(valid, document_ids)
        causal = False if self.max_ratio else None  # static shapes: the mask built without looking (no host sync)
        h = self.shallow_states(input_ids, valid, document_ids, pos, causal=causal)
        x = self.fuse_step(h, torch.zeros_like(h[:, :1]), torch.zeros_like(valid))
        z = self.run_stack(self.deep, x, self.positions.text_positions(pos), CausalPattern(valid, document_ids, causal))
        return self.backbone.lm_head(self.inner.norm(z))

    # -- anti-collapse (concept.codes) ----------------------------------------------------------
    def code_vocabularies(self) -> list[tuple[str, nn.Module]]:
        return [("", self.vocabulary)]

    def code_uses(self, out: ConceptOutput) -> list[CodeUse]:
        """The codes of the tokens that emitted a concept, per level, with the shallow states the head read: every
        token's, masked by ``keep`` (fixed shapes, no host sync)."""
        keep, states = out.keep.flatten(), out.shallow.flatten(0, 1)
        if self.levels == 1:
            return [CodeUse("concept", self.vocabulary, 0, out.concept_ids.flatten(), states, mask=keep)]
        codes = out.codes.flatten(0, 1)
        return [CodeUse("concept" if level == 0 else f"concept@{level}", self.vocabulary, level, codes[:, level],
                        states, codes[:, :level] if level else None, keep) for level in range(self.levels)]

    # -- parameters ----------------------------------------------------------------------
    def new_modules(self) -> dict[str, nn.Module]:
        """The modules concept adds to the backbone (trainable; saved with a run)."""
        modules = (("vocabulary", self.vocabulary), ("length_policy", self.length_policy), ("sampler", self.sampler),
                   ("positions", self.positions), ("tail_fusion", self.tail_fusion), ("concept_gate", self.concept_gate))
        return {name: m for name, m in modules if m is not None}

    def new_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, m in self.new_modules().items() for k, v in m.state_dict().items()}
