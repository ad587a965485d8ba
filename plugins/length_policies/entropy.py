"""`entropy`: chunks follow the backbone's confidence (an MTP / ConfAdapt-style heuristic).

The confidence of token t is the top-1 probability of the next-token distribution that the
backbone's own LM head reads off the *shallow* state (the "logit lens":
``softmax(lm_head(norm(h_t)))``, no new parameters). A chunk stays open while the model is
confident and ends at the first token whose confidence falls below ``tau``, with at least
``min_chunk`` and at most ``max_chunk`` tokens per chunk::

    length = tokens in the open chunk, including t
    keep_t = (length >= min_chunk and confidence_t < tau)  or  length == max_chunk

Cost: one LM-head matmul per token on the shallow state (2 * d * V FLOPs, as much as the
final LM head; for SmolLM2 about 57 MFLOP per token), computed in chunks of tokens so the
[T, V] probabilities are never held. It is a heuristic: after only a few layers the lens
is a weak predictor, so the confidence is a cheap proxy for "the next token is easy", not a
calibrated probability. Nothing in the policy trains; the ratio is set by ``tau``, ``min_chunk``
and ``max_chunk``. The head has no NULL class. ``max_chunk`` is an integer, ``auto`` (the default:
``ceil(2 / r)`` for the project's default target r = 0.125, i.e. 16; the policy has no target of its own)
or ``none`` (``concept.streaming.gap``).

The rule is sequential (the minimum length depends on the previous boundary), so the
batched decision is a scan of the step rule over t on the batched confidences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.contracts import DecidesWithState, LengthPolicy, ReadsPredictor
from concept.streaming import chunks, gap


@dataclass
class EntropyPolicyConfig:
    tau: float = 0.5  # a token with top-1 probability below tau ends its chunk
    min_chunk: int = 1
    max_chunk: int | str = gap.AUTO  # bounds the deep tail (max_chunk - 1 tokens): N, auto (2 / target), none
    block: int = 256  # tokens per LM-head matmul when computing confidences

    def validate(self) -> list[str]:
        return chunks.validate(self)


class EntropyPolicy(LengthPolicy, DecidesWithState, ReadsPredictor, nn.Module):
    Config = EntropyPolicyConfig
    uses_null_class = False
    needs_predictor = True  # the model binds ``predictor(h) -> next-token logits`` (its LM head)

    def __init__(self, config: EntropyPolicyConfig, ctx=None):
        super().__init__()
        self.config = config
        self.predictor = None

    @property
    def max_chunk(self) -> int:
        """The longest chunk (``max_chunk`` resolved; ``concept.streaming.gap``)."""
        return gap.resolve(self.config.max_chunk, self)

    def confidence(self, h: torch.Tensor) -> torch.Tensor:
        """Top-1 next-token probability [...] of the logit lens on shallow states h [..., d]."""
        if self.predictor is None:
            raise RuntimeError("entropy policy: no predictor bound (build the policy through concept.build)")
        flat = h.detach().reshape(-1, h.shape[-1])
        with torch.no_grad():
            out = [torch.softmax(self.predictor(part).float(), dim=-1).amax(-1) for part in flat.split(self.config.block)]
            return torch.cat(out).view(h.shape[:-1]) if out else flat.new_zeros(h.shape[:-1])

    def init_state(self, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, dtype=torch.long, device=device)  # tokens of the open chunk

    def step(self, h_t, head_logits_t, count):
        return chunks.advance(self.confidence(h_t) < self.config.tau, count, self.config.min_chunk, self.max_chunk)

    def decide_with_state(self, h, head_logits, valid, reset=None):
        """Batched: confidences in one go, then a scan of the step rule over t (``concept.streaming.chunks``)."""
        return chunks.scan(self.confidence(h) < self.config.tau, valid, self.config.min_chunk, self.max_chunk, reset)

    def decide(self, h, head_logits, valid, reset=None) -> torch.Tensor:
        return self.decide_with_state(h, head_logits, valid, reset)[0]
