"""The planner-executor's training objectives (docs/planner_executor.md), small loss objects the trainer composes
like ``concept.objectives`` (same protocol: ``objective(model, batch, out, teacher) -> weighted term``,
logged by ``name``), plus the ``PlannerQuotaController``.

| name | what | option |
|---|---|---|
| ``commitment`` | weight x mean over planned concepts of ‖e_soft − sg(e_hard)‖² / mean ‖e_hard‖²: the sampler's soft mixture agrees with the hard choice | ``--commitment`` |
| ``plan_usage`` | weight x mean over types of KL(mean concept distribution of the type ‖ uniform), anti-collapse | ``--usage-weight`` |
| ``eos`` | weight x mean over the steps where ``max_len`` forced an <EOS_i> of −log p(<EOS_i>): the planner learns to end a type itself | ``--eos-weight`` |
| ``plan_mtp`` | weight x mean over the MTP heads j of CE(head j at step s, the plan's step s + j); only with ``planner.mtp`` > 1 | ``--plan-mtp`` |
| ``quota`` | weight x ((mean over rows of Σ_steps (1 − p(<EOS>))) − budget)² / budget², a differentiable surrogate of the total plan length against the budget (``quota: per-type``: the mean of that over the types, each against its share) | ``--quota-weight`` |
| ``context_curriculum`` | no term: with ``--task continue --curriculum``, the planner's context shrinks with the rows (logged as ``context_len``) | ``--curriculum`` |

The ``PlannerQuotaController`` is the integral half of the length control: after every step it moves
the bias on every <EOS_i> logit (``model.eos_bias``, a buffer saved with the run) by
``ki x (realised mean plan length − budget) / budget``, from the step's plan lengths reduced over every
micro-batch and process. With ``--set planner.quota=per-type`` each type has its own bias and its own
share of the budget (in proportion to its ``max_len``), so a type cannot end itself early: with
``--usage-weight`` (whose term only sees the concepts a type emits) the planner can then not lower the
term by writing fewer concepts. Objectives with statistics (``stats``) report them to the trainer, which sums
them like the loss terms and hands the means back through ``device_step`` (as device scalars) and ``log_stats``
(read with the step's log).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import codes
from ..objectives import Objective, pair_mean, usage_kl, zero
from ..syncs import upload
from ..train_config import curriculum_len
from .hard_em import HardEMObjective


def eos_probs(model, plan) -> torch.Tensor:
    """[B, S] p(<EOS>) of every step under the planner's logits (before max_len forcing)."""
    logp = F.log_softmax(plan.logits.float(), dim=-1)
    K = model.sizes[plan.types.clamp(min=0)]
    return logp.gather(-1, K[..., None]).squeeze(-1).exp()


@dataclass
class CommitmentObjective(Objective):
    weight: float
    name: str = "commitment"

    def __call__(self, model, batch, out, teacher=None):
        plan = out.plan
        mask = plan.concepts
        if plan.soft is None:
            return zero(out.plan.classes)
        soft, hard = plan.soft.float(), plan.hard.float().detach()  # (masked means: no concept gives 0, no gradient)
        return self.weight * pair_mean((soft - hard).pow(2).sum(-1), mask) / pair_mean(hard.pow(2).sum(-1),
                                                                                       mask).clamp_min(1e-12)


@dataclass
class PlanUsageObjective(Objective):
    """weight x mean over the types of KL(the type's mean concept distribution over its emitted concepts ‖
    uniform). It acts on the concepts each type emits; a type that emitted none in the batch counts as fully
    collapsed (log K, a constant without gradient), so ending a type does not lower the term."""
    weight: float
    name: str = "plan_usage"

    def __call__(self, model, batch, out, teacher=None):
        plan, total = out.plan, zero(out.plan.classes)
        sizes = [t.size for t in model.settings.types]
        for i, size in enumerate(sizes):  # (chosen on the device: a type with no concept gets log K, no gradient)
            mask = plan.concepts & (plan.types == i)
            total = total + torch.where(mask.any(), usage_kl(plan.logits[..., :size], mask), math.log(size))
        return self.weight * total / len(sizes)


@dataclass
class EOSObjective(Objective):
    weight: float
    name: str = "eos"

    def __call__(self, model, batch, out, teacher=None):
        plan = out.plan
        mask = plan.forced
        if mask is None:
            return zero(out.plan.classes)
        return self.weight * pair_mean(-torch.log(eos_probs(model, plan).clamp_min(1e-12)), mask)  # (0 if none)


@dataclass
class PlanMTPObjective(Objective):
    """MTP concepts (``planner.mtp`` = k): weight x mean over heads j = 1..k-1 of the CE of head j, read at the
    state that predicts step s, on the plan's step s + j (its type's vocabulary; forced <EOS> excluded). The
    states are the planner's teacher-forced ones on the trained plan (one extra forward when the plan was
    written k steps per forward), detached: the heads learn to read the planner, never to change it."""
    weight: float
    name: str = "plan_mtp"

    def __call__(self, model, batch, out, teacher=None):
        plan = out.plan
        if plan.head is not None and model.settings.mtp > 1:  # written k steps per forward: force it (without
            with torch.no_grad():  # looking whether the MTP heads wrote a step: the same states if they did not)
                u, u_valid, _, _ = model.split_example(batch["input_ids"], batch.get("attention_mask"))
                plan = model.planner_forced(u, u_valid, plan)
        hidden, total, heads = plan.hidden.detach(), zero(out.plan.classes), model.settings.mtp
        before = plan.before(model.num_types)
        for j in range(1, min(heads, plan.classes.shape[1])):  # every step, masked (no boolean indexing)
            mask = plan.active[:, j:] & ~plan.forced[:, j:]
            state = model.mtp_heads.state(hidden[:, :-j].flatten(0, 1), j - 1)
            types = plan.types[:, j:].flatten().clamp(min=0)  # (a step no row took: any finite row, masked out)
            logits = model.plan_logits(state, types, before[:, j:].flatten())
            ce = F.cross_entropy(logits.float(), plan.classes[:, j:].flatten().clamp(min=0), reduction="none")
            total = total + pair_mean(ce, mask.flatten())  # (0, no gradient, where no step)
        return self.weight * total / max(1, heads - 1)


@dataclass
class PlannerQuotaController:
    """Integral control of the plan length: after each step, ``eos_bias += ki x (length − budget) / budget``
    (clamped to ±20) for the total length (``quota: total``, one bias), or for each type's length against its
    share of the budget (``quota: per-type``, ``budget`` a list: one bias per type). Its state is the bias
    buffer itself, so resume is exact."""
    budget: float | list[float]
    ki: float = 0.05
    limit: float = 20.0

    @property
    def per_type(self) -> bool:
        return isinstance(self.budget, list)

    def apply(self, model, length: torch.Tensor, skipped: torch.Tensor) -> None:
        """On the device, nothing read back: ``length`` the step's mean plan length (a device scalar, or one per
        type); where ``skipped`` (a 0-dim bool tensor) the bias stays as it was."""
        with torch.no_grad():
            bias = model.eos_bias.value
            budget = upload(self.budget, bias.dtype, bias.device)  # (pinned, non-blocking: no sync)
            moved = (bias + self.ki * (length.to(bias.dtype) - budget) / budget).clamp(-self.limit, self.limit)
            bias.copy_(torch.where(skipped, bias, moved))


@dataclass
class QuotaObjective(Objective):
    weight: float
    controller: PlannerQuotaController
    name: str = "quota"

    def __call__(self, model, batch, out, teacher=None):
        """The expected length's squared relative error: of the total, or (per-type) the mean over the types."""
        plan = out.plan
        budget = self.controller.budget
        going = (1 - eos_probs(model, plan)) * plan.active
        if self.controller.per_type:
            error = [((going * (plan.types == i)).sum(1).mean() - b).pow(2) / b ** 2 for i, b in enumerate(budget)]
            return self.weight * torch.stack(error).mean()
        return self.weight * (going.sum(1).mean() - budget).pow(2) / budget ** 2

    def stats(self, model, batch, out) -> dict[str, float]:
        """Summed by the trainer over micro-batches and processes, then averaged (``device_step``)."""
        lengths = out.plan.lengths(model.num_types).float()
        u = out.u_valid.sum(1).clamp(min=1).float()
        row = {"plan_len": lengths.sum(1).mean(), "plan_per_token": (lengths.sum(1) / u).mean()}  # (device scalars)
        row.update({f"plan_len/{t.name}": lengths[:, i].mean() for i, t in enumerate(model.settings.types)})
        return row

    def device_step(self, model, means: dict[str, torch.Tensor], totals: dict[str, torch.Tensor],
                    skipped: torch.Tensor) -> dict:
        """The controller moves the <EOS> bias on the device (its values logged as device scalars, read with the
        step's log)."""
        types, per_type = model.settings.types, self.controller.per_type
        length = torch.stack([means[f"plan_len/{t.name}"] for t in types]) if per_type else means["plan_len"]
        self.controller.apply(model, length, skipped)
        bias = model.eos_bias.value.detach()
        if not per_type:
            return {"eos_bias": bias.clone()}
        return {"eos_bias": bias.mean(), **{f"eos_bias/{t.name}": bias[i].clone() for i, t in enumerate(types)}}


class ContextCurriculum(Objective):
    """``--task continue`` with ``--curriculum``: while rows are shorter than ``--seq-len``, the planner reads
    the same share of each row (``--context-len`` in proportion, at least 1 token, at most the row less one),
    logged as ``context_len``; after the step, and for evaluation and saving, the full ``--context-len``."""

    name = "context_curriculum"
    adds_term = False

    def __init__(self, config):
        self.config = config

    def before_step(self, context) -> None:
        cfg, length = self.config, curriculum_len(self.config, context.step)
        context.model.context_len = min(length - 1, max(1, round(cfg.context_len * length / cfg.seq_len)))

    def device_step(self, model, means, totals, skipped) -> dict:  # (host values only: no log read needed)
        used, model.context_len = model.context_len, self.config.context_len
        return {"context_len": used}


def from_config(config, model, step) -> list:
    """The planner-executor's objectives a ``TrainConfig`` asks for (the sampler's temperature schedule first;
    the quota always: its controller keeps the plan length near the budget even at weight 0). ``step()``: the
    step about to run."""
    objectives: list = codes.temperature_schedule(model.sampler, config, step)
    if config.task == "continue" and config.curriculum:
        objectives.append(ContextCurriculum(config))
    if config.commitment and config.plan_training == "gumbel":  # (Hard-EM feeds hard embeddings: no soft sample)
        objectives.append(CommitmentObjective(config.commitment))
    if config.usage_weight:
        objectives.append(PlanUsageObjective(config.usage_weight))
    if config.eos_weight:
        objectives.append(EOSObjective(config.eos_weight))
    if model.settings.mtp > 1 and config.plan_mtp:
        objectives.append(PlanMTPObjective(config.plan_mtp))
    if config.plan_training == "hard-em":
        objectives.append(HardEMObjective(config.plan_ce, beam=config.beam, every=config.estep_every,
                                          prior=config.estep_prior))
    objectives += codes.controllers(model, config.kmeans_init, config.revive_after, config.seed)  # revival, k-means
    settings = model.settings
    budget = settings.type_targets if settings.quota == "per-type" else settings.target
    objectives.append(QuotaObjective(config.quota_weight, PlannerQuotaController(budget, settings.quota_ki)))
    return objectives
