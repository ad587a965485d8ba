"""What each token of the streaming model emits: the length policy's boundaries (capped by the static
budget), the concept codes the sampler picks (greedily or by a beam over multi-level codes) and the inputs
of the concepts emitted (hard embedding with a straight-through soft part, a latent-feedback mix, the
identity start's gate). A mixin of :class:`concept.streaming.model.ConceptModel`, which holds the modules
it reads (``vocabulary``, ``length_policy``, ``sampler``, ``eval_sampler``, ``concept_gate``) and the budget
(``max_ratio``, ``budget_slack``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import packing
from ..components import upcast
from ..contracts import Mixes, RatioControlled


class ConceptEmission:
    def decide(self, h, valid, keep=None, reset=None):
        """Head -> length policy (keep) and sampler (which concept); with a static budget (``max_ratio``) the
        boundaries over it are dropped (``packing.cap_boundaries``), forced ``keep`` included.
        Returns (head_logits, probs over the K concepts, keep, the concept id of every token): see ``codes``."""
        head_logits = self.vocabulary.logits(h)
        keep = self.boundaries(h, head_logits, valid, keep, reset)[1]
        probs, ids = self.codes(h, head_logits)
        return head_logits, probs, keep, ids

    def keep_score(self, h, head_logits):
        """The length policy's keep logit [B, T] (``RatioControlled.keep_logit``: its bias included, differentiable
        in the head), None for a policy without one. A forward computes it once and hands it to the decision, the
        ratio loss and the ratio controller's statistics (``ConceptOutput.keep_logit``), which each computed it."""
        policy = self.length_policy
        return policy.keep_logit(head_logits, h) if isinstance(policy, RatioControlled) else None

    def boundaries(self, h, head_logits, valid, keep=None, reset=None, keep_logit=None):
        """(the length policy's boundaries on real tokens, or the forced ``keep``; those the static budget
        keeps of them), both [B, T] bool: the same tensor without a budget. ``keep_logit``: the policy's keep
        score, already computed (``keep_score``)."""
        if keep is None:
            given = {} if keep_logit is None else {"keep_logit": keep_logit}
            keep = self.length_policy.decide(h, head_logits, valid, reset, **given)
        chosen = keep.bool() & valid
        max_ratio = self.max_ratio
        if not max_ratio:
            return chosen, chosen
        return chosen, packing.cap_boundaries(chosen, valid, max_ratio, slack=self.budget_slack)

    def codes(self, h, head_logits):
        """Which concept each token would emit: the sampler's probabilities over the K codes and the
        chosen id, [B, T, K] / [B, T]. With L code levels, [B, T, L, K] / [B, T, L]: level l reads the
        query that the codes of levels < l left (the codebook's ``before``), greedily, or at inference
        by a beam of ``vocabulary.beam`` over the levels (``level_search``; its probabilities are one-hot)."""
        probs = self.concept_probs(head_logits)
        if self.levels == 1:
            return probs, probs.argmax(-1)
        if not self.training and self.level_beam > 1:
            ids = self.level_search(h, head_logits, self.level_beam)
            return F.one_hot(ids, self.vocabulary.size).to(probs.dtype), ids
        all_probs, ids = [probs], [probs.argmax(-1)]
        for level in range(1, self.levels):
            p = self.concept_probs(self.vocabulary.logits(h, level, torch.stack(ids, -1)))
            all_probs.append(p)
            ids.append(p.argmax(-1))
        return torch.stack(all_probs, -2), torch.stack(ids, -1)

    def level_search(self, h, head_logits, width: int) -> torch.Tensor:
        """[..., L] the codes of highest total log-probability ``sum_l log p_l(id_l | ids_<l)`` under the
        head, by a beam of ``width`` over the levels (exhaustive when ``width >= K ** (L - 1)``)."""
        K = self.vocabulary.size
        score, ids = upcast(head_logits[..., :K]).log_softmax(-1).topk(min(width, K), -1)  # [..., W]
        ids = ids[..., None]  # [..., W, levels so far]
        for level in range(1, self.levels):
            state = h[..., None, :].expand(*ids.shape[:-1], h.shape[-1])
            logp = upcast(self.vocabulary.logits(state, level, ids)[..., :K]).log_softmax(-1)  # [..., W, K]
            total = (score[..., None] + logp).flatten(-2)
            score, best = total.topk(min(width, total.shape[-1]), -1)  # sorted: the best first
            beams = ids.gather(-2, (best // K)[..., None].expand(*best.shape, ids.shape[-1]))
            ids = torch.cat([beams, (best % K)[..., None]], -1)
        return ids[..., 0, :]

    def concept_probs(self, head_logits):
        """The sampler's probabilities over the K concepts (the NULL column is not passed)."""
        sampler = self.sampler if self.training else self.eval_sampler
        return sampler(head_logits[..., : self.vocabulary.size])

    def concept_inputs(self, probs, concept_ids, src, h, level=None, perturb_codes=None):
        """Inputs of the concepts emitted at time indices ``src`` [B, C]: the hard embedding with a
        straight-through soft part (e_hard + e_soft - sg(e_soft)), or the soft mixture for a
        sampler without a hard step; a latent-feedback sampler then mixes in the shallow state.
        Multi-level codes: ``probs`` [B, T, L, K], ``concept_ids`` [B, T, L] and ``level`` [B, C], the
        code level of each slot. ``perturb_codes``: ``f(e [B, C, d], level) -> e`` replaces the discrete
        embeddings before the continuous part joins them (diagnostics: the code-only controls).

        The inputs join the residual stream in its dtype, ``h``'s (the embedding's: bf16 with a bf16 base),
        cast once here: the trainable modules that make them compute in their own (fp32) dtype, and the
        middle and deep stacks then run in the backbone's compute dtype, as a dense model's layers do (a
        no-op in fp32)."""
        sampler = self.sampler if self.training else self.eval_sampler
        at = lambda x, index: x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731
        pick, by_level = src, {}
        if level is not None:  # token t's level l at t * L + l
            probs, concept_ids = probs.flatten(1, 2), concept_ids.flatten(1, 2)
            pick, by_level = src * self.levels + level, {"level": level}
        if sampler.hard:
            e = self.vocabulary.embed_hard(concept_ids.gather(1, pick).clamp(min=0), **by_level)
            if sampler.straight_through and torch.is_grad_enabled():
                e_soft = self.vocabulary.embed_soft(at(probs, pick), **by_level)
                e = e + (e_soft - e_soft.detach())
        else:
            e = self.vocabulary.embed_soft(at(probs, pick), **by_level)
        if perturb_codes is not None:
            e = perturb_codes(e, level)
        if isinstance(self.sampler, Mixes):  # e.g. `hidden-projection`, in training and at inference
            e = self.sampler.mix(e, at(h, src))
        if self.concept_gate is not None:  # identity start: the shallow state + the gated embedding
            e = self.concept_gate(at(h, src), e)
        return e.to(h.dtype)
