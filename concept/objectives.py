"""Training objectives and controllers: small objects the trainer composes through one protocol
(:class:`Objective`); optional regularisers are separate, named, and off unless configured.

A loss objective is called on every micro-batch::

    objective(model, batch, out, teacher) -> scalar tensor, already weighted

and logged under ``objective.name`` in metrics.jsonl (averaged over the gradient-accumulation
micro-batches: the term it added to the loss); ``objective.teacher_needs`` names the parts of the
frozen backbone's forward it reads (``logits`` / ``deep_input`` / ``final``; empty: no teacher).
``batch`` is the dict of ``input_ids`` / ``attention_mask`` / ``document_ids``, ``out`` the
model's output, ``teacher`` a ``concept.teacher.TeacherOutput`` or None. A controller (``adds_term =
False``) adds no term; it acts through the other hooks (``before_step``, ``stats``, ``device_step``,
``log_stats``, ``after_step``, ``finish``, ``state_dict``); ``before_step`` and ``finish`` see the run
through a :class:`StepContext`.
The trainer's loss is ``ce_weight * CE + sum of the terms``; it never branches on which objectives there
are: a family (``Family.objectives``) or a baseline chooses them.

The objectives every kind of model shares (:func:`common`):

| name | what | option |
|---|---|---|
| ``distill_kl`` | weight x T^2 x KL(teacher || student) on next-token distributions | ``--distill``, ``--distill-temperature`` |
| ``align`` | weight x hidden-state distance to the teacher (MSE / scale or 1 - cos) | ``--align``, ``--align-at``, ``--align-loss`` |
| ``mtp`` | weight x mean over the MTP heads of KL(teacher at t+i || head i at t) + ce x CE | ``--mtp``, ``--mtp-ce`` |

The streaming family's are in ``concept.streaming.objectives`` (the ratio controller, ratio loss,
usage, placement), the planner-executor's in ``concept.planner.objectives`` and ``concept.planner.hard_em``.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .mtp import mtp_pairs


@dataclass(frozen=True)
class StepContext:
    """What :meth:`Objective.before_step` and :meth:`Objective.finish` see of a training run (not the trainer):
    the step, the model, and the few ways to run it outside the training step."""
    step: int  # the steps trained so far (before_step: the 0-based number of the step about to run)
    steps: int  # the run's last step (``--steps``)
    model: torch.nn.Module
    dist: Any  # concept.distributed.Dist: the processes (rank, world size, collectives)
    micro_batches: int  # micro-batches per optimizer step, over all processes (``batch(step * micro_batches + j)``)
    batch: Callable[[int], dict]  # training batch ``index`` on the device (the same rows on every rank)
    forward: Callable[[dict], Any]  # the model alone on a batch, under autocast (no objectives, no teacher)
    gathered: Callable[[], AbstractContextManager]  # FSDP2: the root's parameters gathered for such a forward
    note: Callable[[str], None]  # a note for the user (the CLI prints it)


class Objective:
    """The base of every object the trainer composes: a loss term, a controller, or both. Each hook is a
    no-op here; an objective overrides the ones it needs, and the trainer calls them all in order.

    ``name`` is its key in metrics.jsonl; ``adds_term`` says whether ``__call__`` returns a term of the loss
    (logged under ``name``); ``teacher_needs`` the parts of the frozen backbone's forward it reads;
    ``legacy_key`` where checkpoints of older versions kept its state in ``state.json``, if they did."""

    name: str = "objective"
    adds_term: bool = True
    teacher_needs: frozenset[str] = frozenset()
    legacy_key: str | None = None

    def __call__(self, model, batch: dict, out, teacher=None) -> torch.Tensor | None:
        """The weighted loss term of a micro-batch (``adds_term`` objectives)."""
        return None

    def prepare(self, model, batch: dict, step: int) -> dict:
        """Before a micro-batch's forward: the batch, with what the objective adds (e.g. Hard-EM's plans)."""
        return batch

    def before_step(self, context: StepContext) -> None:
        """Before an optimizer step's micro-batches (e.g. point a controller at this step's target)."""

    def stats(self, model, batch: dict, out) -> dict[str, float]:
        """Statistics of a micro-batch, summed over the step's micro-batches and processes; keys starting
        with ``_`` are inputs of the other hooks only (:meth:`device_step`, :meth:`log_stats`), the others are
        logged (as means). Numbers or device scalars: the trainer sums the latter on the device and reads a
        step's values once (no host sync inside the step, ``concept.syncs``)."""
        return {}

    def device_step(self, model, means: dict[str, torch.Tensor], totals: dict[str, torch.Tensor],
                    skipped: torch.Tensor) -> dict:
        """After the optimizer step, with the step's statistics as float64 device scalars (means over
        micro-batches, and totals; nothing is read back): act on the device, leaving the state as it was where
        ``skipped`` (a 0-dim bool tensor: the step's loss or gradients were not finite, the optimizer did not
        step), and return what to log: numbers, or device scalars the trainer reads with the step's log, later
        (``concept.train_step.StepRunner.read_log``). Prefer it to :meth:`after_step`."""
        return {}

    def log_stats(self, means: dict[str, float], totals: dict[str, float]) -> dict[str, float]:
        """What to log that is worked out from the step's statistics read on the host (means over micro-batches,
        and totals; e.g. a ratio of two of them, absent where its denominator is 0), called when the step's log
        is read (every ``--log-every`` steps). It does not act on anything, so it never makes the trainer read a
        step's log sooner: :meth:`after_step` does."""
        return {}

    def after_step(self, model, means: dict[str, float], totals: dict[str, float]) -> dict[str, float]:
        """After the optimizer step, with the step's statistics read on the host (means over micro-batches, and
        totals): act (e.g. move a controller's bias) and return what to log. An objective that overrides it makes
        the trainer read every step's log before the next step (a host sync per step): :meth:`device_step`
        (to act) and :meth:`log_stats` (to log what the statistics give) do not."""
        return {}

    def finish(self, context: StepContext) -> dict[str, float]:
        """After the last step (e.g. a final calibration); returns what to log with that step."""
        return {}

    def state_dict(self) -> dict | None:
        """Its state for a checkpoint (JSON), or None when it keeps none."""
        return None

    def load_state_dict(self, state: dict, model) -> None:
        """Restore :meth:`state_dict`'s state; raise ValueError / TypeError / KeyError if it does not fit."""

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """One state from every process's (under torchrun); the same on every rank by default."""
        return states[0]


def overrides(objective, hook: str) -> bool:
    """Whether ``objective`` has its own ``hook`` (the trainer skips costly set-up around no-op hooks)."""
    return getattr(type(objective), hook) is not getattr(Objective, hook)


def zero(like: torch.Tensor) -> torch.Tensor:
    """A zero loss term on ``like``'s device (an objective with nothing to add on this batch)."""
    return torch.zeros((), dtype=torch.float32, device=like.device)


def pair_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the positions of ``mask`` (0 where there are none), computed on every
    position and masked: no boolean indexing, so no host sync (``concept.syncs``). Masked-out values must
    be finite (``where`` keeps their NaN out of the sum, not out of the gradient)."""
    return torch.where(mask, values, 0).sum() / mask.sum().clamp_min(1)


def valid_mask(batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()


def real_tokens(batch: dict, out) -> torch.Tensor:
    """[B, T] bool: the batch's real tokens, the forward's own mask where its output carries one (``out.valid``,
    nothing recomputed), else :func:`valid_mask`."""
    valid = getattr(out, "valid", None)
    return valid_mask(batch) if valid is None else valid


def next_token_pairs(valid: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T-1] bool: position t predicts token t+1 (both real, same document); the pairs
    ``concept.streaming.model.next_token_loss`` averages its CE over."""
    pair = valid[:, 1:] & valid[:, :-1]
    if document_ids is not None:
        pair = pair & (document_ids[:, 1:] == document_ids[:, :-1])
    return pair


@dataclass
class DistillObjective(Objective):
    """weight x T^2 x KL(p_teacher || p_student) of the next-token distributions at temperature T,
    averaged over the CE's pairs (real positions whose next token is real and of the same document)."""
    weight: float
    temperature: float = 1.0
    name: str = "distill_kl"
    teacher_needs: frozenset[str] = frozenset({"logits"})

    def __call__(self, model, batch, out, teacher=None):
        pair = next_token_pairs(valid_mask(batch), batch.get("document_ids"))
        T = self.temperature
        student = F.log_softmax(out.logits[:, :-1].float() / T, dim=-1)
        target = F.log_softmax(teacher.logits[:, :-1].float() / T, dim=-1)
        kl = F.kl_div(student, target, log_target=True, reduction="none").sum(-1)  # [B, T-1]
        return self.weight * T * T * pair_mean(kl, pair)


@dataclass
class AlignObjective(Objective):
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
        valid = valid_mask(batch)
        if self.at == "deep-input":
            student, target, mask = out.deep_input, teacher.deep_input, valid & ~out.keep
        else:
            student, target, mask = out.hidden, teacher.final, valid
        if student is None:
            raise TypeError(f"{type(out).__name__} has no {'deep_input' if self.at == 'deep-input' else 'hidden'} "
                            f"states to align")
        s, t = student.float(), target.float()
        if self.loss == "cosine":
            distance = pair_mean(1 - F.cosine_similarity(s, t, dim=-1), mask)
        else:  # (means over the masked positions' elements: the d's cancel)
            distance = pair_mean((s - t).pow(2).sum(-1), mask) / pair_mean(t.pow(2).sum(-1), mask).clamp_min(1e-12)
        return self.weight * distance


@dataclass
class MTPObjective(Objective):
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
        valid, T = valid_mask(batch), ids.shape[1]
        h = model.mtp_state(out).detach()
        total = zero(batch["input_ids"])
        for i in range(heads.k):
            pair = mtp_pairs(valid, batch.get("document_ids"), i)  # t predicts t+1+i
            log_p = F.log_softmax(heads.logits(h[:, : T - 1 - i], i).float(), dim=-1)
            target = F.log_softmax(teacher.logits[:, i: T - 1].float(), dim=-1)  # the backbone's at t+i
            kl = F.kl_div(log_p, target, log_target=True, reduction="none").sum(-1)
            nll = -log_p.gather(-1, ids[:, 1 + i:, None])[..., 0]
            total = total + pair_mean(kl, pair) + self.ce * pair_mean(nll, pair)
        return self.weight * total / heads.k


@dataclass
class TemperatureSchedule(Objective):
    """A controller (no term): before each step, the training sampler's Gumbel temperature ``tau`` goes linearly
    from ``start`` at step 0 to ``end`` at the last of ``steps`` (``step()``: the step about to run; a pure
    function of it, so resume is exact). A family with a tempered sampler adds it (``--tau-start``,
    ``--tau-end``: ``concept.code_options``)."""
    sampler: object
    start: float
    end: float
    steps: int
    step: object  # () -> the (0-based) step about to run
    name: str = "temperature"
    adds_term = False

    def before_step(self, context: StepContext) -> None:
        self.sampler.tau = self.start + (self.end - self.start) * self.step() / max(1, self.steps - 1)


def common(config, has_mtp: bool = False, align_at: str = "final") -> list[Objective]:
    """The objectives every model kind shares, in a fixed order: distillation, alignment (``align_at``: where,
    the family's choice; ``final`` needs no deep stack), the MTP heads (for a model that has them). A family adds
    its own around them (``Family.objectives``)."""
    found: list[Objective] = []
    if config.distill:
        found.append(DistillObjective(config.distill, config.distill_temperature))
    if config.align:
        found.append(AlignObjective(config.align, align_at, config.align_loss))
    if has_mtp and config.mtp:
        found.append(MTPObjective(config.mtp, config.mtp_ce))
    return found


def usage_kl(concept_logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Anti-collapse regulariser (docs/policies.md): KL(p_bar || uniform) = log K - H(p_bar), where p_bar
    is the mean concept distribution over the tokens that emitted a concept. Zero when the batch
    uses every concept equally; log K when it always picks the same one; 0, with no gradient, when no token
    emitted. Every position's distribution is computed and masked (no boolean indexing: no host sync)."""
    p = torch.softmax(concept_logits.float(), dim=-1).flatten(0, -2)
    mask = keep.flatten()
    p_bar = torch.where(mask[:, None], p, 0).sum(0) / mask.sum().clamp_min(1)
    return (p_bar * torch.log(p_bar.clamp_min(1e-12) * p_bar.shape[-1])).sum()
