"""`null`: the ConceptHead has a NULL class; a token emits a concept unless the sampled class is NULL.

A maximum run of consecutive NULLs bounds the deep tail: when ``max_run`` NULLs in a row
have been seen, the next token is forced to emit a concept (its id is the best non-NULL
class). The batched rule is vectorised (no loop over t): with ``last`` the index of the
latest natural boundary, a NULL at offset ``d = t - last - 1`` inside its run is forced
exactly when ``d % (max_run + 1) == max_run``.
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

    def __init__(self, config: NullPolicyConfig, ctx=None):
        super().__init__()
        self.config = config
        self.max_run = config.max_run
        self.null_index = ctx.concept_vocab_size if ctx is not None else None

    def decide(self, h: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Batched: index [B, T] sampled classes (NULL = K), valid [B, T] -> keep [B, T] bool."""
        natural = (index != self.null_index) & valid
        boundary = natural | ~valid  # padding acts as a boundary, so runs start at the first real token
        t = torch.arange(index.shape[1], device=index.device).expand_as(index)
        last = torch.cummax(torch.where(boundary, t, torch.full_like(t, -1)), dim=1).values
        offset = t - last - 1
        forced = ~boundary & (offset % (self.max_run + 1) == self.max_run)
        return natural | forced

    def init_state(self, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, dtype=torch.long, device=device)  # current run of NULLs

    def step(self, h_t: torch.Tensor, index_t: torch.Tensor, run: torch.Tensor):
        keep = (index_t != self.null_index) | (run >= self.max_run)
        return keep, torch.where(keep, torch.zeros_like(run), run + 1)
