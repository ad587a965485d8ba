"""Running the streaming model's three stacks: each with its position ids, attention plan and RoPE table (the
shallow stack over every token; the middle stack over the packed concepts; the deep stack's positions), through
the backbone's own decoder layers (``concept.backbone.run_layers``) or, with ``--compile``, the stacks' compiled
graphs. A mixin of :class:`concept.streaming.model.ConceptModel`, which holds the stacks and modules it reads
(``shallow`` / ``middle`` / ``deep``, ``positions``, ``tail_fusion``, ``compiled_stacks``)."""
from __future__ import annotations

import torch

from .. import packing
from ..attention import CausalPattern
from ..backbone import rope_tables, run_layers


class StackRuns:
    def run_stack(self, stack, x, position_ids, attention_plan, cache=None, cos_sin=None):
        """``stack``'s layers on ``x``; ``cos_sin``: the RoPE table of ``position_ids`` if built already
        (:meth:`rope_tables`; a compiled stack builds its own inside its graph)."""
        checkpointing = self.gradient_checkpointing and self.training
        if self.compiled_stacks is not None and (cache is None or cache.recording):  # (decoding steps: eager)
            # (inside a whole forward's graph the stack is traced by its layers, its name unread: torch 2.11's dynamo
            # cannot trace ``is`` between two lists)
            name = None if torch.compiler.is_compiling() else next(
                n for n, s in (("shallow", self.shallow), ("middle", self.middle), ("deep", self.deep)) if s is stack)
            return self.compiled_stacks(name, stack, x, position_ids, attention_plan, self.inner.rotary_emb,
                                        checkpointing, cache)
        if cos_sin is not None and cos_sin[0].dtype != x.dtype:  # (a table for another dtype: its own)
            cos_sin = None
        return run_layers(stack, x, position_ids, attention_plan, self.inner.rotary_emb, checkpointing, cache,
                          cos_sin=cos_sin)

    def rope_tables(self, x, *position_ids) -> list:
        """The RoPE tables of several stacks' position ids for inputs like ``x``, built in one call of the
        backbone's rotary embedding (``concept.backbone.rope_tables``); Nones where the stacks are compiled
        (each graph builds its own)."""
        if self.compiled_stacks is not None:
            return [None] * len(position_ids)
        return rope_tables(self.inner.rotary_emb, x, list(position_ids))

    def shallow_states(self, input_ids, valid, doc=None, pos=None, cache=None, causal=None):
        """h after the shallow stack [B, T, d] (what the ConceptHead reads). ``causal``: whether plain causal
        attention is exact (no padding before a real token, one document); None: found out (a host sync)."""
        pos = packing.time_positions(valid, doc) if pos is None else pos
        x = self.positions.add_text_type(self.inner.embed_tokens(input_ids))
        return self.run_stack(self.shallow, x, self.positions.text_positions(pos), CausalPattern(valid, doc, causal),
                              cache)

    def run_middle(self, c, layout, middle_pos, doc, static: bool, cache=None, cos_sin=None):
        """The middle stack over the packed concepts (at ``middle_pos``; ``cos_sin``: their RoPE table, if built),
        causal among them: (its output [B, C, d], what it added to each concept when the tail fusion reads it,
        else None). No concepts: ``c`` unchanged."""
        if not layout.num_concepts:
            return c, None
        meta = layout.concept_meta
        # the concept block is left-aligned: causal attention is exact for its real slots with one document
        middle_plan = CausalPattern(meta.valid, None if doc is None else meta.doc,
                                    True if doc is None else (False if static else None))
        out = self.run_stack(self.middle, c, middle_pos, middle_plan, cache, cos_sin)
        updates = out - c if self.tail_fusion is not None and self.tail_fusion.needs_update else None
        return out, updates

    def deep_positions(self, pos, concept_pos, layout):
        """Position ids of the packed deep sequence: each element keeps its own position."""
        return torch.cat([
            self.positions.concept_positions(concept_pos, layout.concept_rank, "deep"),
            self.positions.text_positions(pos.gather(1, layout.tail_src)),
        ], dim=1)

    def concept_stack_positions(self, c, pos, layout, deep):
        """((positions, RoPE table) of the middle stack, the same of the deep stack) for the packed concepts
        ``c`` and the tail: both tables built in one rotary call (:meth:`rope_tables`). ``deep``: the deep
        stack's sequence, the layout or its ``packing.DeepBlock``, whose slots take the layout's positions at
        their elements."""
        concept_pos = pos.gather(1, layout.concept_id_src)
        middle_pos = self.positions.concept_positions(concept_pos, layout.concept_rank, "middle")
        deep_pos = self.deep_positions(pos, concept_pos, layout)
        if deep is not layout:
            deep_pos = deep_pos.gather(1, deep.src)
        middle_rope, deep_rope = self.rope_tables(c, middle_pos, deep_pos)
        return (middle_pos, middle_rope), (deep_pos, deep_rope)
