"""Ratio control: keep the realised concepts-per-token at a target (docs/training.md, "Objective and ratio control").

Two tools, selectable and combinable (``--ratio-control pi|loss|both|none``), plus the length
policies' per-document tracker (``tracker_ahead`` / ``concept_price``, below):

* ``RatioLoss`` — the batch-level boundary loss of H-Net / DLCM. With N = 1/target,
  F the fraction of real tokens that emitted a concept (no gradient) and G the mean
  boundary probability P(keep) (differentiable)::

      L = N / (N - 1) * ((N - 1) * F * G + (1 - F) * (1 - G))

  Its gradient in G is zero exactly when F = 1/N, so it pushes the head's NULL logit
  until the realised ratio matches the target.
* ``PIController`` — MrT5-style control of the policy's ``null_bias`` buffer (added to the
  NULL logit), made scale-free: the keep log-odds of a fresh head are tightly clustered,
  so a fixed-gain controller on the raw bias overshoots (the ratio jumps between ~0 and 1).
  The feed-forward part is the bias that gives exactly the target on the current batch
  (the (1 - target) quantile of the keep log-odds), smoothed by an EMA; the integral part
  corrects the remaining error in units of the batch's keep log-odds spread::

      bias = EMA(quantile) + ki * std(keep log-odds) * sum(ratio - target)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..contracts import RatioControlled

@dataclass
class RatioLoss:
    target: float
    weight: float = 1.0

    def __call__(self, keep: torch.Tensor, boundary_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n = 1.0 / self.target
        real = valid.sum()  # (masked means: no boolean indexing, nothing read back to the host)
        F = ((keep & valid).sum() / real).float().detach()
        G = torch.where(valid, boundary_prob, 0.0).sum() / real
        return self.weight * n / (n - 1.0) * ((n - 1.0) * F * G + (1.0 - F) * (1.0 - G))


@dataclass
class PIController:
    target: float
    momentum: float = 0.8  # EMA of the per-batch quantile (the proportional / feed-forward part)
    ki: float = 0.05  # integral gain, in units of the keep log-odds spread
    ema: float | None = None
    integral: float = 0.0

    @property
    def base(self) -> float | None:
        return self.ema

    def _quantile(self, policy, head_logits: torch.Tensor, valid: torch.Tensor, h=None) -> tuple[float, float]:
        with torch.no_grad():
            keep_logit = policy.keep_logit(head_logits, h)[valid].float() + policy.null_bias  # without the bias
            if policy.bias_for_ratio is not None:  # a policy whose ratio is not P(keep logit >= bias)
                return float(policy.bias_for_ratio(head_logits, h, valid, self.target)), float(keep_logit.std())
            return float(torch.quantile(keep_logit, 1.0 - self.target)), float(keep_logit.std())

    def calibrate(self, policy, head_logits: torch.Tensor, valid: torch.Tensor, h=None) -> None:
        """Set the bias so that exactly ``target`` of these real tokens emit a concept (used on the
        first batch, and at the end of training over many training batches, the way BatchNorm
        statistics are re-estimated: the per-step bias is tuned to noisy small batches)."""
        self.ema, _ = self._quantile(policy, head_logits, valid, h)
        with torch.no_grad():
            policy.null_bias.fill_(self.ema)

    def calibrate_exact(self, policy, head_logits: torch.Tensor, valid: torch.Tensor, reset=None, iters: int = 30,
                        h=None) -> float:
        """Bisect the bias so that the *realised* ratio of ``policy.decide`` (which adds the
        concepts forced by a maximum run of NULLs) equals the target on these rows [N, T].
        Returns the ratio reached (a target the policy cannot reach ends at the nearest bound)."""
        self.calibrate(policy, head_logits.flatten(0, 1), valid.flatten(), None if h is None else h.flatten(0, 1))
        with torch.no_grad():
            spread = float(policy.keep_logit(head_logits, h)[valid].float().std())
            lo, hi = self.ema - 4 * spread - 1.0, self.ema + 4 * spread + 1.0
            for _ in range(iters):  # the realised ratio falls as the bias rises
                mid = 0.5 * (lo + hi)
                policy.null_bias.fill_(mid)
                ratio = float(policy.decide(h, head_logits, valid, reset)[valid].float().mean())
                lo, hi = (mid, hi) if ratio > self.target else (lo, mid)
            self.ema, self.integral = 0.5 * (lo + hi), 0.0
            policy.null_bias.fill_(self.ema)
            return float(policy.decide(h, head_logits, valid, reset)[valid].float().mean())

    def update(self, policy, head_logits: torch.Tensor, valid: torch.Tensor, ratio: float, h=None) -> float:
        """After a step with realised ``ratio``: move the bias for the next step."""
        return self.apply(policy, *self.statistics(policy, head_logits, valid, h), ratio)

    def statistics(self, policy, head_logits: torch.Tensor, valid: torch.Tensor,
                   h=None, keep_logit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the bias that would give exactly ``target`` on this batch, the keep log-odds spread): what
        :meth:`apply` needs, averaged by the trainer over micro-batches and processes. Device scalars (the
        values :meth:`_quantile` computes, masked instead of indexed): nothing is read back during the step.
        ``keep_logit``: ``policy.keep_logit(head_logits, h)`` already computed (the forward's)."""
        with torch.no_grad():
            score = policy.keep_logit_given(keep_logit, head_logits, h)
            keep_logit = score.float() + policy.null_bias  # without the bias
            spread = masked_std(keep_logit, valid)
            if policy.bias_for_ratio is not None:  # a policy whose ratio is not P(keep logit >= bias)
                bias = policy.bias_for_ratio(head_logits, h, valid, self.target, keep_logit=score)
                return torch.as_tensor(bias, device=head_logits.device), spread
            hidden = torch.where(valid, keep_logit, torch.full_like(keep_logit, float("nan")))
            return nanquantile(hidden.flatten(), 1.0 - self.target), spread

    def apply(self, policy, quantile: float, spread: float, ratio: float) -> float:
        """Move the bias for the next step from a step's statistics and its realised ``ratio``."""
        self.ema = quantile if self.ema is None else self.momentum * self.ema + (1 - self.momentum) * quantile
        self.integral += ratio - self.target
        bias = self.ema + self.ki * spread * self.integral
        with torch.no_grad():
            policy.null_bias.fill_(bias)
        return bias

    def apply_on_device(self, policy, quantile: torch.Tensor, spread: torch.Tensor, ratio: torch.Tensor,
                        skipped: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` on float64 device scalars, nothing read back: the same float64 operations in the same
        order (so the same bias, bit for bit), the state (``ema``, ``integral``) kept as device scalars; where
        ``skipped`` (a 0-dim bool tensor) the state and the bias stay as they were."""
        with torch.no_grad():
            def scalar(value):  # the state: a Python float after calibrate / load_state_dict (no copy to the device)
                return value if isinstance(value, torch.Tensor) else quantile.new_full((), value)

            ema = quantile if self.ema is None else self.momentum * scalar(self.ema) + (1 - self.momentum) * quantile
            integral = scalar(self.integral) + (ratio - self.target)
            bias = ema + self.ki * spread * integral
            if self.ema is not None:
                ema = torch.where(skipped, scalar(self.ema), ema)
            self.ema, self.integral = ema, torch.where(skipped, scalar(self.integral), integral)
            policy.null_bias.copy_(torch.where(skipped, policy.null_bias, bias.to(policy.null_bias.dtype)))
        return bias

    def state_dict(self) -> dict:  # (floats, as JSON: a float64 device scalar reads back exactly)
        return {"ema": None if self.ema is None else float(self.ema), "integral": float(self.integral)}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.integral = state["ema"], state["integral"]


def nanquantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.nanquantile(x, q)`` of a 1-D ``x`` (linear interpolation; NaN where every element is NaN), the same
    ops in the same order, so the same value bit for bit, without the range check of ``q`` that torch 2.11 (the GPU
    image's) runs on the device and reads back (``aten::equal``: a host sync in every training step there; ``q`` is
    a Python float, checked here on the host)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile must be in [0, 1], got {q}")
    ordered = x.sort().values  # (NaN last)
    count = ordered.isnan().logical_not_().sum(-1, keepdim=True)
    ranks = torch.scalar_tensor(q, dtype=x.dtype, device=x.device) * (count - 1)
    ranks = ranks.masked_fill_(ranks < 0, 0)  # (no element: rank 0, a NaN)
    below = ranks.long()
    weights = ranks - below
    values = ordered.gather(-1, below)
    return values.lerp_(ordered.gather(-1, ranks.ceil_().long()), weights).squeeze_(-1)


def masked_std(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x[valid].std()`` without the boolean index (no host sync): two passes in float64, as torch's CPU
    kernel accumulates float32 too, rounded to ``x``'s dtype."""
    n = valid.sum().double()
    xd = torch.where(valid, x.double(), 0.0)
    mean = xd.sum() / n
    var = torch.where(valid, (xd - mean) ** 2, 0.0).sum() / (n - 1)
    return var.sqrt().to(x.dtype)


def track_problems(track) -> list[str]:
    """What is wrong with a tracker gain ``track`` (a length policy's config value), as config problems."""
    if isinstance(track, bool) or not isinstance(track, (int, float)) or not math.isfinite(track) or track < 0:
        return [f"track: must be a finite number >= 0 (0 = no ratio tracker), got {track!r}"]
    return []


def tracker_ahead(keep_logit: torch.Tensor, tokens: torch.Tensor, track: float) -> torch.Tensor:
    """The per-document ratio tracker's score before the concepts are paid for (the `null` and `mtp`
    policies' ``track``): ``keep_logit + track * tokens``, ``tokens`` the document's real tokens
    before t. Token t emits a concept when

        tracker_ahead(keep_logit, tokens, track) - concept_price(track, target) * concepts >= 0

    i.e. ``keep_logit + track * lag >= 0`` with ``lag = tokens - concepts / target``: how many
    tokens the document is behind the schedule of one concept every 1 / target tokens (negative:
    ahead). ``track`` is in keep-logit units per token of lag, so a domain whose keep logits are
    shifted by ``s`` settles at a lag of about ``-s / track`` tokens: a ratio error of about
    ``s / (track * N)`` on an N-token document, whatever the target. The part that does not
    depend on earlier decisions is computed for every t at once by the batched scans; the scans
    and the step rules use these same float ops, so they agree exactly."""
    return keep_logit + track * tokens.float()


def concept_price(track: float, target: torch.Tensor) -> torch.Tensor:
    """What one emitted concept takes off the tracker's score: ``track / target`` keep-logit units
    (the 1 / target tokens of lag a concept pays for)."""
    return track / target.float()


def ratio_controllable(policy) -> bool:
    """The policy has a bias the ratio controller can move (``null_bias`` + ``keep_logit``)."""
    return isinstance(policy, RatioControlled)


def scheduled_ratio(step: int, steps: int, target: float, start: float = 1.0, warmup: float = 0.0) -> float:
    """The ratio curriculum: the target concepts-per-token at (0-based) ``step`` of ``steps``.

    Over the first ``warmup`` fraction of the steps the target moves from ``start`` to ``target``
    linearly in 1 / ratio (tokens per concept k = 1 / ratio goes linearly from 1 / start to
    1 / target), then it is held at ``target``. A pure function of the step, so resume stays exact.
    ``warmup`` 0 (or ``start == target``): ``target`` from step 0."""
    span = warmup * steps
    if span <= 0 or start == target:
        return target
    progress = min(1.0, step / span)
    k = 1.0 / start + (1.0 / target - 1.0 / start) * progress
    return target if progress >= 1.0 else 1.0 / k
