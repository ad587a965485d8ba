"""`mtp`: chunks stay open while the model's MTP heads confidently predict what comes next.

The policy owns ``heads`` MTP heads (``concept.mtp.MTPHeads``: head i predicts token t+1+i from
the shallow state at t, trained by self-distillation from the frozen backbone). Its boundary
rule is ConfAdapt's acceptance rule turned into a chunker: at token t the heads would draft
t+1, t+2, ... and ConfAdapt accepts the longest prefix whose top-1 probabilities are >= tau;
when not even the first drafted token is confident, the text ahead is hard, and the chunk
closes at t (a concept is emitted there). With min / max chunk lengths::

    length = tokens in the open chunk, including t
    keep_t = (length >= min_chunk and confidence_t < tau)  or  length == max_chunk

where confidence_t is head 0's top-1 probability at t. Heads 1..k-1 draft further ahead for
multi-token decoding; they do not change a boundary.

Why the shallow state: the decision at t must be known before the middle and deep stacks
run (the one-pass forward packs the deep sequence from all decisions at once), and the deep
output at t itself depends on the decisions up to t. The shallow state is the one state the
batched decision and the step-wise one (decoding) both have, identically.

Ratio control works through a bias: ``keep_logit = log((1 - c) / c) - null_bias`` and
``tau = sigmoid(-null_bias)``, so the trainer's controller and its final calibration move tau
like the `null` policy's NULL bias (the ratio loss does not apply: the decision has no gradient;
the heads learn from the MTP objective only). A per-document ratio tracker (``track``, default 0.25,
as the `null` policy's: ``track`` times the document's lag ``tokens - concepts / target`` so far is
added to the keep logit, ``concept.streaming.ratio.tracker_ahead``) holds the ratio on text whose confidences
differ from the training data's. The rule is sequential (a minimum length), so the batched
decision is a scan of the step rule over t on batched confidences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.contracts import DecidesWithState, LengthPolicy, RatioControlled, ReadsPredictor, TracksRatio
from concept.mtp import MTPHeads
from concept.packing import document_tokens
from concept.streaming import chunks, gap
from concept.streaming.host_scan import allowance
from concept.streaming.scan import DeviceRule, scan_rule
from concept.streaming.ratio import concept_price, track_problems, tracker_ahead


@dataclass
class MTPPolicyConfig:
    heads: int = 4  # k: head i predicts token t+1+i
    tau: float = 0.5  # initial confidence threshold (the ratio controller moves it)
    min_chunk: int = 1
    max_chunk: int | str = gap.AUTO  # bounds the deep tail (max_chunk - 1 tokens): N, auto (2 / target), none
    block: int = 256  # tokens per LM-head matmul when computing confidences
    lr: float = 0.0  # the heads' learning rate (0: --lr-new)
    track: float = 0.25  # per-document ratio tracker gain per token of lag, as the `null` policy's (0 = off)

    def validate(self) -> list[str]:
        problems = chunks.validate(self)
        problems += track_problems(self.track)
        if self.heads < 1:
            problems.insert(0, f"heads: must be >= 1 (k, the tokens predicted at once), got {self.heads}")
        if self.lr < 0:
            problems.append(f"lr: must be >= 0 (0: --lr-new), got {self.lr}")
        return problems


class MTPPolicy(LengthPolicy, DecidesWithState, RatioControlled, TracksRatio, ReadsPredictor, nn.Module):
    Config = MTPPolicyConfig
    uses_null_class = False
    needs_predictor = True  # the model binds the backbone's norm + LM head: the heads' readout
    reads_hidden = True  # the confidence reads the shallow state h (ratio calibration must keep it)

    def __init__(self, config: MTPPolicyConfig, ctx=None):
        super().__init__()
        self.config = config
        self.heads = MTPHeads(ctx.hidden_size, config.heads)
        self.register_buffer("null_bias", torch.tensor(math.log((1 - config.tau) / config.tau)))
        self.register_buffer("target_ratio", torch.tensor(DEFAULT_TARGET_RATIO))  # the trainer sets it (the tracker's target)
        self.track = float(config.track)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "target_ratio" not in state_dict:  # saved before the tracker existed: decide without it
            state_dict[prefix + "target_ratio"] = self.target_ratio.detach().clone()
            self.track = 0.0
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def predictor(self):
        return self.heads.readout

    @predictor.setter
    def predictor(self, readout) -> None:
        self.heads.bind(readout)

    @property
    def learning_rate(self) -> float | None:
        return self.config.lr or None

    @property
    def max_chunk(self) -> int:
        """The longest chunk (``max_chunk`` resolved against the target ratio; ``concept.streaming.gap``)."""
        return gap.resolve(self.config.max_chunk, self)

    @property
    def tau(self) -> float:
        """The confidence threshold the bias stands for."""
        return float(torch.sigmoid(-self.null_bias))

    def confidence(self, h: torch.Tensor) -> torch.Tensor:
        """Head 0's top-1 next-token probability [...] on shallow states h [..., d] (no gradient)."""
        return self.heads.top1(h, 0, self.config.block)[0]

    def keep_logit(self, head_logits, h) -> torch.Tensor:
        """> 0 where the confidence is below tau: log((1 - c) / c) - null_bias."""
        c = self.confidence(h).clamp(1e-7, 1 - 1e-7)
        return torch.log1p(-c) - torch.log(c) - self.null_bias

    def init_state(self, batch_size: int, device):
        """The open chunk's length [B]; with the tracker also the document's real tokens and concepts
        so far: (length, tokens, concepts)."""
        count = torch.zeros(batch_size, dtype=torch.long, device=device)
        return (count, count.clone(), count.clone()) if self.track else count

    def step(self, h_t, head_logits_t, state):
        cfg, logit = self.config, self.keep_logit(head_logits_t, h_t)
        if not self.track:
            return chunks.advance(logit > 0, state, cfg.min_chunk, self.max_chunk)
        count, tokens, concepts = state
        price = concept_price(self.track, self.target_ratio)
        unsure = tracker_ahead(logit, tokens, self.track) - price * concepts.float() > 0
        keep, count = chunks.advance(unsure, count, cfg.min_chunk, self.max_chunk)
        return keep, (count, tokens + 1, concepts + keep.long())

    def decide_with_state(self, h, head_logits, valid, reset=None, keep_logit=None):
        """Batched: confidences in one go, then a scan of the step rule over t (``concept.streaming.chunks``; with
        the tracker, the per-document lag joins the score as in the `null` policy)."""
        cfg, logit = self.config, self.keep_logit_given(keep_logit, head_logits, h)
        if not self.track:
            return chunks.scan(logit > 0, valid, cfg.min_chunk, self.max_chunk, reset)
        T = valid.shape[1]
        before, total = document_tokens(valid, reset)
        ahead = tracker_ahead(logit, before, self.track)
        bound = allowance(ahead, concept_price(self.track, self.target_ratio), T, strict=True)
        device = DeviceRule("tracked_chunk_scan", (cfg.min_chunk, self.max_chunk))
        dtypes = (torch.long, torch.long)
        keep, (count, concepts) = scan_rule(device, [bound], valid, reset, dtypes)
        return keep, (count, total, concepts)

    def decide(self, h, head_logits, valid, reset=None, keep_logit=None) -> torch.Tensor:
        return self.decide_with_state(h, head_logits, valid, reset, keep_logit)[0]
