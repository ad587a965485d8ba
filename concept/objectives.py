"""Training objectives: small loss objects the trainer composes (SPEC §2.1: "optional
regularisers are separate, named, and off unless configured").

The protocol is one call::

    objective(model, batch, out, teacher) -> scalar tensor, already weighted

with ``objective.name`` the key the trainer logs in metrics.jsonl (averaged over the
gradient-accumulation micro-batches: the term it added to the loss) and
``objective.teacher_needs`` the parts of the frozen backbone's forward it reads
(``logits`` / ``deep_input`` / ``final``; empty: no teacher). ``batch`` is the dict of
``input_ids`` / ``attention_mask`` / ``document_ids``, ``out`` the student's output
(``ConceptOutput`` or ``DenseOutput``), ``teacher`` a ``concept.teacher.TeacherOutput`` or None.
The trainer's loss is ``ce_weight * CE + sum(objective(...) for each objective)``; it never
branches on which objectives are there.

| name | what | option |
|---|---|---|
| ``ratio_loss`` | H-Net / DLCM boundary loss towards the (scheduled) target ratio | ``--ratio-control loss|both``, ``--ratio-loss-weight`` |
| ``usage_kl`` | weight x KL(mean concept distribution || uniform), anti-collapse | ``--usage-weight`` |
| ``distill_kl`` | weight x T^2 x KL(teacher || student) on next-token distributions | ``--distill``, ``--distill-temperature`` |
| ``align`` | weight x hidden-state distance to the teacher (MSE / scale or 1 - cos) | ``--align``, ``--align-at``, ``--align-loss`` |
| ``mtp`` | weight x mean over the MTP heads of KL(teacher at t+i || head i at t) + ce x CE | ``--mtp``, ``--mtp-ce`` |
| ``placement`` | weight x BCE(keep logit, "t is among the r positions where skipping the middle stack costs most") | ``--placement`` |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from .mtp import mtp_pairs
from .ratio import RatioLoss, usage_kl

ALIGN_AT = ("deep-input", "final")
ALIGN_LOSSES = ("mse", "cosine")


class Objective(Protocol):
    name: str
    teacher_needs: frozenset[str]

    def __call__(self, model, batch: dict, out, teacher=None) -> torch.Tensor: ...


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


def _valid(batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()


def next_token_pairs(valid: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T-1] bool: position t predicts token t+1 (both real, same document); the pairs
    ``concept.model.next_token_loss`` averages its CE over."""
    pair = valid[:, 1:] & valid[:, :-1]
    if document_ids is not None:
        pair = pair & (document_ids[:, 1:] == document_ids[:, :-1])
    return pair


@dataclass
class RatioObjective:
    """The ratio loss (``concept.ratio.RatioLoss``) towards ``target()`` (the ratio schedule's value
    at the current step). At a target of 1 it is undefined (N / (N - 1)) and constant in effect:
    it adds 0 and the ratio controller alone holds every token as a concept."""
    weight: float
    target: Callable[[], float]
    name: str = "ratio_loss"
    teacher_needs: frozenset[str] = frozenset()

    def __call__(self, model, batch, out, teacher=None):
        target = float(self.target())
        if target >= 1.0:
            return _zero(out.logits)
        boundary = model.length_policy.boundary_prob(out.head_logits, out.shallow)
        return RatioLoss(target, self.weight)(out.keep, boundary, _valid(batch))


@dataclass
class UsageObjective:
    """weight x KL(mean concept distribution over the emitting tokens || uniform) (``usage_kl``)."""
    weight: float
    name: str = "usage_kl"
    teacher_needs: frozenset[str] = frozenset()

    def __call__(self, model, batch, out, teacher=None):
        if not bool(out.keep.any()):
            return _zero(out.logits)
        return self.weight * usage_kl(out.head_logits[..., : model.vocabulary.size], out.keep)


@dataclass
class DistillObjective:
    """weight x T^2 x KL(p_teacher || p_student) of the next-token distributions at temperature T,
    averaged over the CE's pairs (real positions whose next token is real and of the same document)."""
    weight: float
    temperature: float = 1.0
    name: str = "distill_kl"
    teacher_needs: frozenset[str] = frozenset({"logits"})

    def __call__(self, model, batch, out, teacher=None):
        pair = next_token_pairs(_valid(batch), batch.get("document_ids"))
        if not bool(pair.any()):
            return _zero(out.logits)
        T = self.temperature
        student = F.log_softmax(out.logits[:, :-1][pair].float() / T, dim=-1)
        target = F.log_softmax(teacher.logits[:, :-1][pair].float() / T, dim=-1)
        kl = F.kl_div(student, target, log_target=True, reduction="batchmean")
        return self.weight * T * T * kl


@dataclass
class AlignObjective:
    """weight x distance between the student's hidden states and the teacher's.

    ``deep-input``: the streaming model's deep-stack input at its tail positions (real tokens
    that emitted no concept: ``out.deep_input``) against the backbone's own input of layer
    ``Ls + Lm`` at the same positions; ``final``: the last layer's output before the final norm
    (``out.hidden``) against the backbone's, at every real position. ``mse`` is the squared
    error divided by the teacher states' mean square (scale-free: 1 = as far as predicting
    zeros), ``cosine`` the mean of 1 - cos."""
    weight: float
    at: str = "deep-input"
    loss: str = "cosine"
    name: str = "align"
    teacher_needs: frozenset[str] = field(default=frozenset())

    def __post_init__(self):
        self.teacher_needs = frozenset({"deep_input" if self.at == "deep-input" else "final"})

    def __call__(self, model, batch, out, teacher=None):
        valid = _valid(batch)
        if self.at == "deep-input":
            student, target, mask = out.deep_input, teacher.deep_input, valid & ~out.keep
        else:
            student, target, mask = out.hidden, teacher.final, valid
        if student is None:
            raise TypeError(f"{type(out).__name__} has no {'deep_input' if self.at == 'deep-input' else 'hidden'} "
                            f"states to align")
        if not bool(mask.any()):
            return _zero(out.logits)
        s, t = student[mask].float(), target[mask].float()
        if self.loss == "cosine":
            distance = (1 - F.cosine_similarity(s, t, dim=-1)).mean()
        else:
            distance = (s - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)
        return self.weight * distance


@dataclass
class MTPObjective:
    """Self-distillation of the MTP heads (``concept.mtp``): head i at t is pulled towards the frozen
    backbone's own next-token distribution at t+i (its prediction of token t+1+i), plus ``ce`` x the
    CE on the real token t+1+i; averaged over the heads, weighted. The heads read their states
    (``model.mtp_state``: the streaming model's shallow states, the dense model's last hidden states)
    detached, so this term trains the heads only."""
    weight: float
    ce: float = 0.5
    name: str = "mtp"
    teacher_needs: frozenset[str] = frozenset({"logits"})

    def __call__(self, model, batch, out, teacher=None):
        heads, ids = model.mtp_heads, batch["input_ids"]
        valid, T = _valid(batch), ids.shape[1]
        h = model.mtp_state(out).detach()
        total = _zero(out.logits)
        for i in range(heads.k):
            pair = mtp_pairs(valid, batch.get("document_ids"), i)  # t predicts t+1+i
            if not bool(pair.any()):
                continue
            log_p = F.log_softmax(heads.logits(h[:, : T - 1 - i][pair], i).float(), dim=-1)
            target = F.log_softmax(teacher.logits[:, i: T - 1][pair].float(), dim=-1)  # the backbone's at t+i
            kl = F.kl_div(log_p, target, log_target=True, reduction="batchmean")
            total = total + kl + self.ce * F.nll_loss(log_p, ids[:, 1 + i:][pair])
        return self.weight * total / heads.k


def depth_gain(teacher_logits: torch.Tensor, skip_logits: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(teacher_t || skip_t): how far the model's prediction at t falls from the frozen
    backbone's when t is a tail token with no concept (the middle stack skipped). It depends on
    the tokens up to t only, like the decision it supervises."""
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - F.log_softmax(skip_logits.float(), dim=-1))).sum(-1)


def top_fraction(score: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """[B, N] bool: in each row, the round(fraction * n) positions of ``mask`` with the highest
    ``score`` (n = the row's masked positions; ties at the cut are all kept)."""
    k = torch.round(mask.sum(1).float() * fraction).long()  # [B]
    ranked = score.float().masked_fill(~mask, float("-inf")).sort(dim=1, descending=True).values
    cut = ranked.gather(1, (k - 1).clamp(min=0)[:, None])  # the k-th largest score of each row
    return mask & (k[:, None] > 0) & (score.float() >= cut)


@dataclass
class PlacementObjective:
    """Learned placement: train the length policy's keep score (``keep_logit``, read from the
    shallow state, so the same decision exists at decoding time) to emit concepts where the model
    needs its middle stack most.

    At a concept the next token is predicted through the full depth; at a tail token from
    ``Ls + Ld`` layers plus attention to the concepts. Which positions lose most as tail tokens is
    measured on the batch: ``depth_gain`` = KL(frozen backbone || this model with the middle stack
    skipped, ``model.skip_middle``) at every position, no gradient. The label of position t is 1
    when t is among the ``target()`` fraction of its row's positions with the largest gain (t and
    t+1 real and of one document, as the CE's pairs), and the term is
    ``weight * BCE(keep_logit[t], label[t])``, with the keep logit recomputed from the detached
    shallow states: the term trains the head (where concepts go), never the states it reads. The
    ratio controller still sets how many concepts there are; this term only decides where. Cost per step: the teacher's forward and the
    ``Ls + Ld``-layer skip-middle forward, both without gradient, and two KLs over the vocabulary."""
    weight: float
    target: Callable[[], float]
    name: str = "placement"
    teacher_needs: frozenset[str] = frozenset({"logits"})

    def __call__(self, model, batch, out, teacher=None):
        valid, doc = _valid(batch), batch.get("document_ids")
        pair = next_token_pairs(valid, doc)  # [B, T-1]: position t predicts the real token t+1
        ratio = float(self.target())
        if ratio >= 1.0 or not bool(pair.any()):  # every token a concept: nothing to place
            return _zero(out.logits)
        with torch.no_grad():
            skip = model.skip_middle(batch["input_ids"], batch.get("attention_mask"), doc)
            gain = depth_gain(teacher.logits[:, :-1], skip[:, :-1])
            label = top_fraction(gain, pair, ratio)
        h = out.shallow.detach()  # a router term: it trains the head, never the states it reads (as MoD's predictor)
        logit = model.length_policy.keep_logit(model.vocabulary.logits(h), h)[:, :-1]
        return self.weight * F.binary_cross_entropy_with_logits(logit[pair].float(), label[pair].float())


def from_config(config, streaming: bool, ratio_loss: bool, target: Callable[[], float],
                has_mtp: bool = False, planned=None) -> list[Objective]:
    """The objectives a ``TrainConfig`` asks for, in a fixed order (ratio, usage, distillation,
    alignment, MTP heads: for a model that has them, placement). ``planned``: a planner-executor
    model, whose objectives are ``concept.plan_objectives``'."""
    if planned is not None:
        from . import plan_objectives

        return plan_objectives.from_config(config, planned)
    objectives: list[Objective] = []
    if streaming and ratio_loss:
        objectives.append(RatioObjective(config.ratio_loss_weight, target))
    if streaming and config.usage_weight:
        objectives.append(UsageObjective(config.usage_weight))
    if config.distill:
        objectives.append(DistillObjective(config.distill, config.distill_temperature))
    if config.align:
        objectives.append(AlignObjective(config.align, config.align_at, config.align_loss))
    if has_mtp and config.mtp:
        objectives.append(MTPObjective(config.mtp, config.mtp_ce))
    if streaming and config.placement:
        objectives.append(PlacementObjective(config.placement, target))
    return objectives
