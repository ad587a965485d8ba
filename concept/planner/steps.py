"""The plan steps of the planner-executor: each type's head over its concepts and <EOS> (with the quota's
bias, multi-level codes' levels), the heads of a batch of rows at their current types, the unified output
vocabulary, and the input embedding of a step. A mixin of :class:`concept.planner.model.PlannerExecutorModel`,
which holds the modules it reads (``vocabularies``, ``specials``, ``positions``, ``eos_bias``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PlanSteps:
    def type_logits(self, x, i: int, level=0):
        """[..., K_i + 1] type i's head on normed states ``x``: its concepts, then <EOS_i> (+ the quota's bias).
        ``level``: the code level of the step (multi-level codes; an int or a tensor like ``x``'s leading dims)."""
        vocab = self.vocabularies[i]
        logits = vocab.logits(x, level) if vocab.levels > 1 else vocab.logits(x)
        return torch.cat([logits[..., :-1], logits[..., -1:] + self.eos_bias.of(i).to(logits.dtype)], dim=-1)

    def level(self, types, count):
        """The code level of a step of type ``types`` after ``count`` concepts of its type (0 without levels)."""
        return count % self.levels[types.clamp(min=0)]

    def plan_logits(self, h, types, count=None):
        """[B, Kmax+1] the head of each row's current type over its concepts and <EOS> (at K_t; -inf
        beyond). h: [B, d] the backbone's last hidden state (pre-norm). ``count``: concepts of the type
        already written (multi-level codes: the step's level, and <EOS> only after a complete concept)."""
        x = self.inner.norm(h)
        sizes = [t.size for t in self.settings.types]  # (Python ints: the ``sizes`` buffer would be read back)
        width = max(sizes) + 1
        out = x.new_full((x.shape[0], width), float("-inf"))
        level = None if count is None or not self.multilevel else self.level(types, count)
        for i in range(self.num_types):
            logits = self.type_logits(x, i, 0 if level is None else level)
            if level is not None:  # inside a concept: its next level, never <EOS>
                logits = torch.cat([logits[:, :-1], logits[:, -1:].masked_fill((level > 0)[:, None], float("-inf"))], -1)
            logits = F.pad(logits, (0, width - sizes[i] - 1), value=float("-inf"))
            out = torch.where((types == i)[:, None], logits, out)
        return out

    def unified_logits(self, h, phase: int | None):
        """Logits over the whole output vocabulary (``layout.output_size``), restricted to what ``phase``
        allows: None = executing (the base vocabulary), i = planning type i (its concepts and <EOS_i>)."""
        x = self.inner.norm(h)
        out = x.new_full((*x.shape[:-1], self.layout.output_size), float("-inf"))
        if phase is None:
            out[..., : self.layout.base] = self.backbone.lm_head(x)
        else:
            start = self.layout.offset(phase)
            out[..., start: self.layout.eos_id(phase) + 1] = self.type_logits(x, phase)
        return out

    def step_embedding(self, classes, types, probs=None, rank=None):
        """Input embeddings [..., d] of planner steps (``classes`` / ``types`` [...]): the concept's embedding
        or <EOS_t>'s, plus the type embedding; with ``probs`` (training) the straight-through ``e_hard + e_soft - sg(e_soft)``.
        ``rank``: the concept's 1-based place in its type (multi-level codes: its level). Returns (embedding, e_soft or None, e_hard)."""
        eos_row = self.specials.eos(types.clamp(min=0))
        hard, soft = eos_row.clone(), None
        level = self.level(types, (rank - 1).clamp(min=0)) if rank is not None and self.multilevel else None
        for i, vocab in enumerate(self.vocabularies):
            K, rows = vocab.size, types == i
            concept = rows & (classes < K)
            extra = (level,) if level is not None and vocab.levels > 1 else ()
            e = vocab.embed_hard(classes.clamp(0, K - 1), *extra)
            hard = torch.where(concept[..., None], e.to(hard.dtype), hard)
            if probs is not None:
                mix = vocab.embed_soft(probs[..., :K], *extra) + probs[..., K:K + 1] * self.specials.eos(torch.full_like(types, i))
                soft = mix if soft is None else torch.where(rows[..., None], mix, soft)
        e = hard if soft is None else hard + (soft - soft.detach())
        return self.positions.add_types(e, types.clamp(min=0) + 1), soft, hard
