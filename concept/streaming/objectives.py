"""The streaming family's loss terms (``concept.objectives`` has the protocol and the shared ones):

| name | what | option |
|---|---|---|
| ``ratio_loss`` | H-Net / DLCM boundary loss towards the (scheduled) target ratio | ``--ratio-control loss|both``, ``--ratio-loss-weight`` |
| ``usage_kl`` | weight x KL(mean concept distribution || uniform), anti-collapse | ``--usage-weight`` |
| ``ratio_control`` | the controller of concepts per token: the policy's NULL bias (PI), its target, the final calibration | ``--ratio-control``, ``--pi-ki``, ``--calibration-batches`` |
| ``placement`` | weight x BCE(keep logit, "t is among the r positions where skipping the middle stack costs most") | ``--placement`` |
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..contracts import RatioControlled, Tempered, TracksRatio
from ..objectives import Objective, next_token_pairs, pair_mean, real_tokens, usage_kl, valid_mask, zero
from ..syncs import declared
from . import gap
from .calibration import decision_inputs
from .ratio import PIController, RatioLoss


@dataclass
class RatioObjective(Objective):
    """The ratio loss (``concept.streaming.ratio.RatioLoss``) towards ``target()`` (the ratio schedule's value
    at the current step). At a target of 1 it is undefined (N / (N - 1)) and constant in effect:
    it adds 0 and the ratio controller alone holds every token as a concept."""
    weight: float
    target: Callable[[], float]
    name: str = "ratio_loss"

    def __call__(self, model, batch, out, teacher=None):
        target = float(self.target())
        if target >= 1.0:
            return zero(batch["input_ids"])
        boundary = model.length_policy.boundary_prob(out.head_logits, out.shallow,
                                                     keep_logit=getattr(out, "keep_logit", None))  # (the forward's)
        return RatioLoss(target, self.weight)(out.keep, boundary, real_tokens(batch, out))


@dataclass
class UsageObjective(Objective):
    """weight x KL(mean concept distribution over the emitting tokens || uniform) (``usage_kl``)."""
    weight: float
    name: str = "usage_kl"

    def __call__(self, model, batch, out, teacher=None):  # (0, and no gradient, where no token emitted)
        return self.weight * usage_kl(out.head_logits[..., : model.vocabulary.size], out.keep)


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
class PlacementObjective(Objective):
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
        valid, doc = valid_mask(batch), batch.get("document_ids")
        pair = next_token_pairs(valid, doc)  # [B, T-1]: position t predicts the real token t+1
        ratio = float(self.target())
        if ratio >= 1.0:  # every token a concept: nothing to place (no pair: the masked mean is 0, no gradient)
            return zero(batch["input_ids"])
        with torch.no_grad():
            skip = model.skip_middle(batch["input_ids"], batch.get("attention_mask"), doc)
            gain = depth_gain(teacher.logits[:, :-1], skip[:, :-1])
            label = top_fraction(gain, pair, ratio)
        h = out.shallow.detach()  # a router term: it trains the head, never the states it reads (as MoD's predictor)
        logit = model.length_policy.keep_logit(model.vocabulary.logits(h), h)[:, :-1]
        bce = F.binary_cross_entropy_with_logits(logit.float(), label.float(), reduction="none")
        return self.weight * pair_mean(bce, pair)  # (the mean over the pairs, without indexing them: no host sync)


class RatioControl(Objective):
    """The streaming model's concepts-per-token control (docs/training.md, "Objective and ratio control"), composed by the
    trainer like every objective; it adds no loss term (the ratio loss is :class:`RatioObjective`). During
    training it alone writes the length policy's ``null_bias`` and ``target_ratio``.

    * ``before_step``: the policy and the PI controller aim at the ratio schedule's target of the step; at the
      first step the controller calibrates the NULL bias on the first batch;
    * ``stats``: per micro-batch the emitted concepts and, when it tracks, the controller's statistics;
    * ``device_step``: the realised ratio, logged with the target, the NULL bias and the temperature, then the
      PI update of the bias, on the device (nothing read back; a skipped step leaves it as it was);
    * ``finish``: the final target, and the NULL bias re-estimated on ``--calibration-batches`` training
      batches with the final weights (the batches after the last step: resume stays exact).

    ``pi``: None with ``--ratio-control none`` (or a policy without a bias to move); ``tracking``: the
    controller moves the bias every step (``pi`` / ``both``), else it only calibrates."""

    name = "ratio_control"
    adds_term = False
    legacy_key = "pi"  # (older checkpoints kept the controller's state in state.json under this key)

    def __init__(self, target: Callable[[], float], final_target: float, pi: PIController | None, tracking: bool,
                 calibration_batches: int):
        self.target, self.final_target, self.pi, self.tracking = target, final_target, pi, tracking
        self.calibration_batches = calibration_batches
        self.step_target = final_target

    def set_target(self, model, target: float) -> None:
        """Point the controller (and a policy that tracks a target itself) at ``target``."""
        if self.pi is not None:
            self.pi.target = target
        policy = model.length_policy
        if isinstance(policy, TracksRatio):
            gap.set_target(policy, target)  # (no device read at the next decision)

    def before_step(self, context) -> None:
        model = context.model
        self.step_target = self.target()
        self.set_target(model, self.step_target)
        if self.pi is not None and self.pi.base is None:  # first step: calibrate the NULL bias on this batch
            with declared("NULL bias calibration"):  # (once per run: the quantile is read to the host)
                with torch.no_grad(), context.gathered():
                    b = context.batch(0)  # the same rows on every rank: the same bias
                    out = context.forward(b)
                self.pi.calibrate(model.length_policy, out.head_logits, b["attention_mask"].bool(), out.shallow)

    def stats(self, model, batch, out) -> dict[str, torch.Tensor]:
        """Device scalars (the trainer reads a step's values once, after its micro-batches): the emitted concept
        slots (and with a static budget the slots it dropped: ``capped`` per token in the log), the NULL bias the
        step ran with and, when it tracks, the controller's statistics."""
        policy = model.length_policy
        bias = (policy.null_bias.detach() if isinstance(policy, RatioControlled)
                else out.keep.new_zeros((), dtype=torch.float32))
        found = {"_kept": out.keep.sum() * getattr(model, "emit", 1), "_null_bias": bias}  # (no tensor from host data)
        if getattr(out, "capped", None) is not None:  # a static budget: the policy's boundaries it dropped
            found["_capped"] = out.capped * getattr(model, "emit", 1)
        if self.pi is not None and self.tracking:  # the controller's statistics, from every micro-batch
            valid = real_tokens(batch, out)
            keep_logit = getattr(out, "keep_logit", None)  # (the forward's: computed once)
            found["_quantile"], found["_spread"] = self.pi.statistics(
                model.length_policy, out.head_logits.detach(), valid, out.shallow.detach(),
                None if keep_logit is None else keep_logit.detach())
        return found

    def device_step(self, model, means: dict[str, torch.Tensor], totals: dict[str, torch.Tensor],
                    skipped: torch.Tensor) -> dict:
        tokens = totals["tokens"].clamp(min=1)
        ratio = totals["_kept"] / tokens
        row = {"ratio": ratio, "target_ratio": self.step_target,
               **({"capped": totals["_capped"] / tokens} if "_capped" in totals else {}),
               "null_bias": means["_null_bias"],  # (the same on every micro-batch: their mean is it, exactly)
               "tau": model.sampler.tau if isinstance(model.sampler, Tempered) else None}
        if self.pi is not None and self.tracking:  # on the device: the next step runs with the new bias, unread
            self.pi.apply_on_device(model.length_policy, means["_quantile"], means["_spread"], ratio, skipped)
        return row

    def finish(self, context) -> dict[str, float]:
        model = context.model
        self.set_target(model, self.final_target)  # the curriculum's end: the model is saved with the final target
        if self.pi is None:
            return {}
        if self.calibration_batches >= 1:
            was_training = model.training
            model.eval()  # the decisions the evaluated model will make (e.g. no LoRA dropout)
            try:
                with torch.no_grad(), context.gathered():  # only the shallow stack and the head are needed
                    # the same rows on every rank
                    batches = (context.batch(context.step * context.micro_batches + i)
                               for i in range(self.calibration_batches))
                    logits, valid, reset, h = decision_inputs(model, batches)
                    reached = self.pi.calibrate_exact(model.length_policy, logits, valid, reset, h=h)
            finally:
                model.train(was_training)
            if abs(reached - self.final_target) > 0.05 * self.final_target:
                context.note(f"the final calibration reached {reached:.4f} concepts per token, not the "
                             f"target {self.final_target}: the length policy cannot reach it with these settings")
        return {"null_bias_calibrated": float(model.length_policy.null_bias)}

    def state_dict(self) -> dict | None:
        return self.pi.state_dict() if self.pi is not None else None

    def load_state_dict(self, state: dict, model) -> None:
        if self.pi is not None and state:
            self.pi.load_state_dict(state)
