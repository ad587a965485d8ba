"""`threshold` ("sum + threshold"): accumulate a learned per-token score since the last boundary;
emit a concept when the sum reaches the threshold, then start again from zero.

    p_t = sigmoid(w . rms_norm(h_t) + b - null_bias)          (the learned score, in (0, 1))
    S_t = S_{t-1} + p_t  (S = 0 after a boundary or at a document start)
    keep_t = S_t >= threshold  or  max_run NULLs in a row

(``max_run``: an integer, ``auto`` = ``ceil(2 / target_ratio)``, 16 at the default target, or ``none``;
``concept.streaming.gap``. ``target_ratio`` is a buffer the trainer and the build's calibration set.)

A chunk therefore ends after about ``threshold / mean(p)`` tokens: confident "this token
completes something" scores close chunks fast. ``null_bias`` is the ratio controller's knob
(as for `null`); ``keep_logit`` / ``boundary_prob`` expose the score to the controller and
to the H-Net ratio loss.

Differentiable path (straight-through): the decision is hard, so the LM loss reaches the
score through a gate on the concept input, ``e * (1 + g - stopgrad(g))`` with
``g = sigmoid(sharpness * (S_t - threshold))`` at the emitting token. Its forward value is
exactly 1; its gradient tells the score projection whether ending the chunk earlier or
later would have helped (H-Net's confidence-weighted straight-through, applied to the sum).
The head has no NULL class under this policy (``uses_null_class = False``).

The rule is sequential (the sum resets at boundaries), so the batched decision is a scan of
the step-wise rule over t: they agree by construction. The scan is one Triton kernel on CUDA and a
host loop elsewhere (``concept.streaming.scan``); the network itself still runs in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from concept.components import rms_normalize
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.contracts import DecidesWithState, DifferentiableBoundary, Gated, LengthPolicy, RatioControlled, TracksRatio
from concept.streaming import gap
from concept.streaming.scan import DeviceRule, host_rule, scan_rule


@host_rule("threshold_scan")
def threshold_rule(params: tuple, dtypes: tuple):
    """The kernel ``concept::threshold_scan``'s rule on one row's numbers (``concept.streaming.scan``): p added to
    the running total in the total's dtype (``numpy.float32`` for float32 sums, as the tensor rule adds); a token
    emits once the total reaches ``threshold`` or after ``max_run`` tokens without; the state is (total, run)."""
    number = np.float64 if dtypes[0] == torch.float64 else np.float32
    threshold, max_run, zero = number(params[0]), params[1], number(0.0)

    def rule(state, p_t):
        total, run = state
        total = total + number(p_t)
        if total >= threshold or run >= max_run:
            return True, (zero, 0)
        return False, (total, run + 1)

    return rule, (zero, 0)


@dataclass
class ThresholdPolicyConfig:
    threshold: float = 1.0  # emit when the accumulated score reaches this
    max_run: int | str = gap.AUTO  # longest run of NULL tokens (bounds the deep tail): N, auto (2 / target), none
    sharpness: float = 4.0  # slope of the straight-through gate around the threshold
    init_score: float = 0.25  # initial mean score (about threshold / init_score tokens per chunk)

    def validate(self) -> list[str]:
        problems = []
        if not self.threshold > 0:
            problems.append(f"threshold: must be > 0, got {self.threshold}")
        problems += gap.problems("max_run", self.max_run)
        if not self.sharpness > 0:
            problems.append(f"sharpness: must be > 0, got {self.sharpness}")
        if not 0 < self.init_score < 1:
            problems.append(f"init_score: must be in (0, 1), got {self.init_score}")
        return problems


class ThresholdPolicy(LengthPolicy, DecidesWithState, RatioControlled, DifferentiableBoundary, TracksRatio, Gated, nn.Module):
    Config = ThresholdPolicyConfig
    uses_null_class = False
    reads_hidden = True  # the score reads the shallow state h (ratio calibration must keep it)

    def __init__(self, config: ThresholdPolicyConfig, ctx):
        super().__init__()
        self.config = config
        self.threshold = config.threshold
        self.score = nn.Linear(ctx.hidden_size, 1)
        nn.init.normal_(self.score.weight, std=ctx.hidden_size ** -0.5)
        nn.init.constant_(self.score.bias, float(torch.logit(torch.tensor(config.init_score))))
        self.register_buffer("null_bias", torch.zeros(()))
        self.register_buffer("target_ratio", torch.tensor(DEFAULT_TARGET_RATIO))  # what max_run=auto derives from

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "target_ratio" not in state_dict:  # saved before max_run=auto: the default target (16, as then)
            state_dict[prefix + "target_ratio"] = self.target_ratio.detach().clone().fill_(DEFAULT_TARGET_RATIO)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def max_run(self) -> int:
        """The longest run of NULLs now (``max_run`` resolved against the target ratio; ``concept.streaming.gap``)."""
        return gap.resolve(self.config.max_run, self)

    # -- the score ------------------------------------------------------------------------
    def keep_logit(self, head_logits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Log-odds of the per-token score p_t."""
        return self.score(rms_normalize(h).to(self.score.weight.dtype))[..., 0].float() - self.null_bias

    def boundary_prob(self, head_logits: torch.Tensor, h: torch.Tensor,
                      keep_logit: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.keep_logit_given(keep_logit, head_logits, h))

    def bias_for_ratio(self, head_logits, h, valid, target: float, keep_logit=None) -> torch.Tensor:
        """The ratio controller's feed-forward bias: a chunk closes after about threshold / mean(p)
        tokens, so aim at mean(p) = target * threshold (bisection on this batch's scores, on the device:
        a float64 scalar, nothing read back). ``keep_logit``: the score already computed."""
        with torch.no_grad():
            s = (self.keep_logit_given(keep_logit, head_logits, h) + self.null_bias).float()
            goal = min(target * self.threshold, 0.999)
            real, far = valid.sum(), torch.full_like(s, float("inf"))
            lo = torch.where(valid, s, far).min().double() - 30.0
            hi = torch.where(valid, s, -far).max().double() + 30.0
            for _ in range(50):  # the mean score falls as the bias rises
                mid = 0.5 * (lo + hi)
                above = torch.where(valid, torch.sigmoid(s - mid.float()), torch.zeros_like(s)).sum() / real > goal
                lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
            return 0.5 * (lo + hi)

    # -- decisions ------------------------------------------------------------------------
    def init_state(self, batch_size: int, device):
        return (torch.zeros(batch_size, device=device), torch.zeros(batch_size, dtype=torch.long, device=device))

    def _advance(self, p_t, state):
        total, run = state
        total = total + p_t
        keep = (total >= self.threshold) | (run >= self.max_run)
        zero = torch.zeros_like(total)
        return keep, (torch.where(keep, zero, total), torch.where(keep, torch.zeros_like(run), run + 1))

    def step(self, h_t, head_logits_t, state):
        return self._advance(self.boundary_prob(head_logits_t, h_t).detach(), state)

    def decide_with_state(self, h, head_logits, valid, reset=None, keep_logit=None):
        """Batched: a scan of the step rule over t in the tensor rule's own float arithmetic, so both
        agree exactly: on CUDA a Triton kernel adding in p's dtype in order (no host sync), elsewhere on
        the host (``numpy.float32`` for float32 sums; ``concept.streaming.scan``). Padding does not
        advance a row's state; a document start resets it. Returns keep [B, T] and the state after the
        last token (``keep_logit``: the score already computed)."""
        p = self.boundary_prob(head_logits, h, keep_logit).detach()
        dtype = torch.promote_types(torch.get_default_dtype(), p.dtype)  # what init_state's sum + p_t is in
        device, dtypes = DeviceRule("threshold_scan", (float(self.threshold), self.max_run)), (dtype, torch.long)
        return scan_rule(device, [p.to(dtype)], valid, reset, dtypes)

    def decide(self, h, head_logits, valid, reset=None, keep_logit=None) -> torch.Tensor:
        return self.decide_with_state(h, head_logits, valid, reset, keep_logit)[0]

    def gate(self, h, head_logits, keep, valid, reset=None) -> torch.Tensor:
        """[B, T] soft boundary value at each token, differentiable in the score: the
        straight-through gate for the concept inputs (its forward value is not used)."""
        p = self.boundary_prob(head_logits, h)
        t = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
        starts = keep.roll(1, dims=1)
        starts[:, 0] = True
        if reset is not None:
            starts = starts | reset
        total = torch.cumsum(p * valid, dim=1)
        before = torch.cat([torch.zeros_like(total[:, :1]), total[:, :-1]], dim=1)  # sum up to t - 1
        last = torch.cummax(torch.where(starts, t, torch.zeros_like(t)), dim=1).values
        chunk_sum = total - before.gather(1, last)
        return torch.sigmoid(self.config.sharpness * (chunk_sum - self.threshold))
