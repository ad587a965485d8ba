"""`fixed`: ``emit`` concepts every ``every`` tokens, whatever the text (fixed-K chunking).

``keep_t`` is true for the last token of every chunk of ``every`` tokens, counted from the
start of each document (left padding does not count). That token emits ``emit`` (M >= 1)
concept slots, all at its time position; slot m takes its concept id from the head's
output at the chunk's token ``t - M + 1 + m`` (so ``every >= emit``). The realised ratio is
exactly ``emit / every`` concepts per token on long documents, so there is nothing to
control and nothing to learn in the policy. The head has no NULL class. The deep tail never
holds more than ``every - 1`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.contracts import DecidesWithState, LengthPolicy
from concept.packing import time_positions, tokens_since_keep


@dataclass
class FixedPolicyConfig:
    every: int = 4  # tokens per chunk; the chunk's last token emits the concepts
    emit: int = 1  # concepts per chunk (M), with ids from the chunk's last M tokens

    def validate(self) -> list[str]:
        problems = []
        if self.every < 1:
            problems.append(f"every: must be >= 1, got {self.every}")
        if self.emit < 1:
            problems.append(f"emit: must be >= 1, got {self.emit}")
        elif self.every >= 1 and self.emit > self.every:
            problems.append(f"emit ({self.emit}) must be <= every ({self.every}): each concept of a chunk takes its "
                            f"id from one of the chunk's last {self.emit} tokens")
        return problems


class FixedPolicy(LengthPolicy, DecidesWithState, nn.Module):
    Config = FixedPolicyConfig
    uses_null_class = False

    def __init__(self, config: FixedPolicyConfig, ctx=None):
        super().__init__()
        self.config = config
        self.every = config.every
        self.emit = config.emit

    @property
    def max_boundary_rate(self) -> float:
        """The most boundaries per real token this rule emits, whatever the text: one per ``every`` (each
        document's first n tokens hold floor(n / every)), the static budget ``max_ratio=auto`` takes
        (``concept.streaming.budget``); the cap never binds it."""
        return 1.0 / self.every

    def decide(self, h, head_logits, valid, reset=None) -> torch.Tensor:
        """Batched: position in the document (restarting at each ``reset``) -> keep [B, T]."""
        doc = None if reset is None else torch.cumsum(reset.long(), dim=1)
        pos = time_positions(valid, doc)
        return ((pos + 1) % self.every == 0) & valid

    def decide_with_state(self, h, head_logits, valid, reset=None):
        """``decide`` and the step state after the last token (the open chunk's tokens), both for
        all t at once: a decoder's prefill needs no step-by-step replay of the prompt."""
        keep = self.decide(h, head_logits, valid, reset)
        return keep, tokens_since_keep(keep, valid, reset)

    def init_state(self, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, dtype=torch.long, device=device)  # tokens of the open chunk

    def step(self, h_t, head_logits_t, count):
        count = count + 1
        keep = count == self.every
        return keep, torch.where(keep, torch.zeros_like(count), count)
