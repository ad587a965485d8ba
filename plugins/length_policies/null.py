"""`null`: the ConceptHead has a NULL class; token t emits a concept when P(not NULL) >= 1/2.

The boundary decision is deterministic (the same rule in training and inference, as in
H-Net's router), so the concepts-per-token ratio realised in training is the one seen at
evaluation. ``P(keep) = sigmoid(logsumexp(concept logits) - (NULL logit + null_bias))``;
``null_bias`` is a buffer that a ratio controller moves (``concept.ratio``) and is saved
with the model. The concept *identity* is chosen separately by the sampler.

A maximum run of consecutive NULLs bounds the deep tail: after ``max_run`` NULLs in a row
the next token is forced to emit a concept. The batched rule is vectorised (no loop over
t): with ``last`` the index of the latest natural boundary (or the token before a document
start), a NULL at offset ``d = t - last - 1`` in its run is forced exactly when
``d % (max_run + 1) == max_run``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class NullPolicyConfig:
    max_run: int = 16  # longest run of consecutive NULL tokens (bounds the deep tail)

    def validate(self) -> list[str]:
        return [] if self.max_run >= 1 else [f"max_run: must be >= 1, got {self.max_run}"]


class NullPolicy(nn.Module):
    Config = NullPolicyConfig
    uses_null_class = True

    def __init__(self, config: NullPolicyConfig, ctx):
        super().__init__()
        self.config = config
        self.max_run = config.max_run
        self.null_index = ctx.concept_vocab_size
        self.register_buffer("null_bias", torch.zeros(()))

    def keep_logit(self, head_logits: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Log-odds that a token emits a concept: logsumexp(concepts) - (NULL + bias)."""
        logits = head_logits.float()
        concepts = torch.logsumexp(logits[..., : self.null_index], dim=-1)
        return concepts - (logits[..., self.null_index] + self.null_bias)

    def boundary_prob(self, head_logits: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.keep_logit(head_logits))

    def decide(self, h, head_logits, valid, reset=None) -> torch.Tensor:
        """Batched: head_logits [B, T, K+1], valid [B, T], reset [B, T] (document starts) -> keep [B, T]."""
        natural = (self.keep_logit(head_logits) >= 0) & valid
        boundary = natural | ~valid  # padding acts as a boundary, so runs start at the first real token
        t = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
        marks = torch.where(boundary, t, torch.full_like(t, -1))
        if reset is not None:  # a run restarts at each document start
            marks = torch.maximum(marks, torch.where(reset & valid, t - 1, torch.full_like(t, -1)))
        last = torch.cummax(marks, dim=1).values
        offset = t - last - 1
        forced = ~boundary & (offset % (self.max_run + 1) == self.max_run)
        return natural | forced

    def init_state(self, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, dtype=torch.long, device=device)  # current run of NULLs

    def step(self, h_t, head_logits_t, run):
        keep = (self.keep_logit(head_logits_t) >= 0) | (run >= self.max_run)
        return keep, torch.where(keep, torch.zeros_like(run), run + 1)
