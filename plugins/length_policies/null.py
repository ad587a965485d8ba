"""`null`: the ConceptHead has a NULL class; token t emits a concept when P(not NULL) >= 1/2.

The boundary decision is deterministic (the same rule in training and inference, as in
H-Net's router), so the concepts-per-token ratio realised in training is the one seen at
evaluation. ``P(keep) = sigmoid(logsumexp(concept logits) - (NULL logit + null_bias))``;
``null_bias`` is a buffer that a ratio controller moves (``concept.streaming.ratio``) and is saved
with the model. The concept *identity* is chosen separately by the sampler.

A maximum run of consecutive NULLs bounds the deep tail: after ``max_run`` NULLs in a row
the next token is forced to emit a concept. ``max_run`` is an integer, ``auto`` (the default:
``ceil(2 / target_ratio)``, 16 at the default target; ``concept.streaming.gap``) or ``none`` (no forcing).

**Ratio tracker** (``track``, default 0.25; 0 = off; see ``docs/results.md``, "Second domain").
A bias calibrated on one domain gives another ratio on another domain (a head trained on
code emits fewer concepts on prose, one trained on code emits more on Markdown READMEs). The
tracker is a causal, per-document feedback on the realised ratio: along each document, before
token t,

    lag_t = (real tokens before t) - (concepts emitted before t) / target_ratio

(0 at each document start: how many tokens the document is behind its schedule of one concept
every 1 / target_ratio tokens), and token t emits a concept when

    keep_logit[t] + track * lag_t >= 0      or      max_run NULLs in a row.

A document that falls behind the target lowers its own threshold, one that runs ahead raises
it, while *where* the concepts go is still decided by the head. ``track`` is in keep-logit units
per token of lag (``concept.streaming.ratio.tracker_ahead``): a domain whose keep logits are shifted by
``s`` settles at a lag of about ``-s / track`` tokens, a ratio error of about ``s / (track * N)``
on an N-token document, the same relative error at every target. ``target_ratio`` is a buffer
saved with the model (default ``concept.streaming.operating_point.DEFAULT_TARGET_RATIO``); the trainer sets it to
the current (scheduled) target. ``keep_logit`` / ``boundary_prob`` (what the ratio controller
and the ratio loss read) exclude the lag term. Weights saved before the tracker existed (no
``target_ratio``) load with the tracker off: they were trained and calibrated without it.
Gain 0.25 (the default) was chosen by measurement (``benchmarks/ratio_drift.py`` and trained
runs, ``docs/results.md``): it is the gain of 1 per concept chosen at target 0.25, where the
keep logits of SmolLM2's head have a spread of about 5; at target 0.125 it holds package
READMEs, a domain no run trained on, within +11–12 % on 128-token rows (+3–4 % on 512) where the
same gain per concept left +22 %, while a gain of 0.5 (+5 %) cost about 0.25 bits at the demo
budget.

Batched vs step-wise. With ``track == 0`` the batched rule is vectorised (no loop over t):
with ``last`` the index of the latest natural boundary (or the token before a document
start), a NULL at offset ``d = t - last - 1`` in its run is forced exactly when
``d % (max_run + 1) == max_run``. With ``track > 0`` each decision depends on the earlier
ones, so the batched decision is a scan over t of the step rule itself (``_advance``). The
score is computed for all t at once and turned into an integer per token (how many concepts the
document may have emitted before t for t to pass the test, in the step rule's own float ops);
the scan then runs over integers: on CUDA as a Triton kernel, one program per row looping over t
(``concept.streaming.device_scan``: no host synchronisation), elsewhere on the host
(``concept.streaming.host_scan``: one device synchronisation per forward, well under a microsecond
per token), where a loop of tensor ops cost a dozen kernel launches per token. The state is the
NULL run and the integer counts behind the lag, so the scan and ``step`` decide the same thing and
agree exactly. Padding does not advance a row's state; a document start resets it. With
``track == 0`` the step state is the NULL run alone, as before. ``decide_with_state``
(decisions + final state, what the decoder's prefill reads) exists for both: the scan's state,
or, without the tracker, the NULL run computed for all t at once (no replay of the prompt).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.contracts import DecidesWithState, DifferentiableBoundary, LengthPolicy, RatioControlled, TracksRatio
from concept.packing import document_tokens, tokens_since_keep
from concept.streaming import gap
from concept.streaming.host_scan import allowance, interval_admits
from concept.streaming.scan import DeviceRule, host_rule, scan_rule
from concept.streaming.ratio import concept_price, track_problems, tracker_ahead


@host_rule("null_tracker_scan")
def tracker_rule(params: tuple, dtypes: tuple):
    """The kernel ``concept::null_tracker_scan``'s rule on one row's numbers (``concept.streaming.scan``): a token
    emits when the document's concepts so far lie in its allowance interval ``bound_t`` (``allowance``) or after
    ``max_run`` NULLs; the state is (the NULL run, the concepts)."""
    (max_run,) = params

    def rule(state, bound_t):
        run, concepts = state
        if interval_admits(concepts, bound_t) or run >= max_run:
            return True, (0, concepts + 1)
        return False, (run + 1, concepts)

    return rule, (0, 0)


@dataclass
class NullPolicyConfig:
    max_run: int | str = gap.AUTO  # longest run of NULL tokens (bounds the deep tail): N, auto (2 / target), none
    track: float = 0.25  # ratio tracker gain: keep-logit units per token of per-document lag (0 = off)

    def validate(self) -> list[str]:
        problems = gap.problems("max_run", self.max_run)
        problems += track_problems(self.track)
        return problems


class NullPolicy(LengthPolicy, DecidesWithState, RatioControlled, DifferentiableBoundary, TracksRatio, nn.Module):
    Config = NullPolicyConfig
    uses_null_class = True
    learned_placement = True  # keep[t] thresholds a trainable per-token score (--placement trains where concepts go)

    def __init__(self, config: NullPolicyConfig, ctx):
        super().__init__()
        self.config = config
        self.null_index = ctx.concept_vocab_size
        self.register_buffer("null_bias", torch.zeros(()))
        self.register_buffer("target_ratio", torch.tensor(DEFAULT_TARGET_RATIO))
        self.track = float(config.track)  # the tracker gain (0 = off: the original vectorised rule)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "target_ratio" not in state_dict:
            # weights saved before the tracker existed: that model was trained and calibrated
            # without it (and at a target this module does not know), so it decides without it
            state_dict[prefix + "target_ratio"] = self.target_ratio.detach().clone()
            self.track = 0.0
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def max_run(self) -> int:
        """The longest run of NULLs now (``max_run`` resolved against the target ratio; ``concept.streaming.gap``)."""
        return gap.resolve(self.config.max_run, self)

    def keep_logit(self, head_logits: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Log-odds that a token emits a concept: logsumexp(concepts) - (NULL + bias)."""
        logits = head_logits.float()
        concepts = torch.logsumexp(logits[..., : self.null_index], dim=-1)
        return concepts - (logits[..., self.null_index] + self.null_bias)

    def boundary_prob(self, head_logits: torch.Tensor, h: torch.Tensor | None = None,
                      keep_logit: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.keep_logit_given(keep_logit, head_logits))

    # -- decisions ------------------------------------------------------------------------
    def init_state(self, batch_size: int, device):
        """The current run of NULLs [B]; with the tracker also the real tokens and the concepts
        so far in the document: (run, tokens, concepts)."""
        run = torch.zeros(batch_size, dtype=torch.long, device=device)
        return (run, run.clone(), run.clone()) if self.track else run

    def _advance(self, keep_logit_t: torch.Tensor, state):
        """The tracker's step rule: one token per row -> (keep [B], next state)."""
        run, tokens, concepts = state
        price = concept_price(self.track, self.target_ratio)
        keep = (tracker_ahead(keep_logit_t, tokens, self.track) - price * concepts.float() >= 0) | (run >= self.max_run)
        return keep, (torch.where(keep, torch.zeros_like(run), run + 1), tokens + 1, concepts + keep.long())

    def step(self, h_t, head_logits_t, state):
        logit = self.keep_logit(head_logits_t)
        if self.track:
            return self._advance(logit, state)
        keep = (logit >= 0) | (state >= self.max_run)
        return keep, torch.where(keep, torch.zeros_like(state), state + 1)

    def _vectorised(self, keep_logit, valid, reset):
        natural = (keep_logit >= 0) & valid
        boundary = natural | ~valid  # padding acts as a boundary, so runs start at the first real token
        t = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
        marks = torch.where(boundary, t, torch.full_like(t, -1))
        if reset is not None:  # a run restarts at each document start
            marks = torch.maximum(marks, torch.where(reset & valid, t - 1, torch.full_like(t, -1)))
        last = torch.cummax(marks, dim=1).values
        offset = t - last - 1
        forced = ~boundary & (offset % (self.max_run + 1) == self.max_run)
        return natural | forced

    def _scan(self, h, keep_logit, valid, reset=None):
        """Batched tracker decisions: a scan over t of the step rule ``_advance`` (padding does not
        advance a row's state; a document start resets it), run on the host
        (``concept.streaming.host_scan``). The real tokens before t (the state's ``tokens``) do not
        depend on the decisions, so the score is computed for all t at once, and so is the most
        concepts a document may have emitted before t for t to pass the tracker's test
        (``allowance``: the step rule's own float ops, turned into an integer): the scan carries the
        NULL run and the concept count as integers. Returns keep [B, T] and the step state after
        the last token. On CUDA the scan is a Triton kernel (no host sync; ``concept.streaming.scan``)."""
        B, T = valid.shape
        before, total = document_tokens(valid, reset)
        ahead = tracker_ahead(keep_logit.detach(), before, self.track)
        bound = allowance(ahead, concept_price(self.track, self.target_ratio), T)
        device, dtypes = DeviceRule("null_tracker_scan", (self.max_run,)), (torch.long, torch.long)
        keep, (run, concepts) = scan_rule(device, [bound], valid, reset, dtypes)
        return keep, (run, total, concepts)

    def decide_with_state(self, h, head_logits, valid, reset=None, keep_logit=None):
        """``decide`` and the step state after the last token, both for all t at once (what a
        decoder's prefill needs: no step-by-step replay of the prompt)."""
        keep_logit = self.keep_logit_given(keep_logit, head_logits)
        if self.track:
            return self._scan(h, keep_logit, valid, reset)
        keep = self._vectorised(keep_logit, valid, reset)
        return keep, tokens_since_keep(keep, valid, reset)

    def decide(self, h, head_logits, valid, reset=None, keep_logit=None) -> torch.Tensor:
        """Batched: head_logits [B, T, K+1], valid [B, T], reset [B, T] (document starts) -> keep [B, T];
        ``keep_logit`` [B, T]: ``keep_logit(head_logits)`` already computed."""
        keep_logit = self.keep_logit_given(keep_logit, head_logits)
        if self.track:
            return self._scan(h, keep_logit, valid, reset)[0]
        return self._vectorised(keep_logit, valid, reset)
