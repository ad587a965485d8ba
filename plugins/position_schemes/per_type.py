"""`per-type`: each token type counts its own positions; one shared RoPE; a learned type embedding.

Normal text keeps the backbone's positions (0, 1, 2, ...); concepts are numbered by their
rank among concepts, starting at ``offset``. A learned type embedding (zero-initialised, so
the base model is unchanged at step 0) is added to text inputs and to concept inputs so
the stacks can tell the types apart. 2D-RoPE was considered and rejected (docs/policies.md).

The planner-executor family (``concept.planner.model``) has one embedding row per concept type
(``add_types``) and numbers each type's block from 1 (its separator at 0) in the executor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.contracts import PositionScheme


@dataclass
class PerTypeConfig:
    offset: int = 0  # fixed position offset of the concept type
    type_embedding: bool = True

    def validate(self) -> list[str]:
        return [] if self.offset >= 0 else [f"offset: must be >= 0, got {self.offset}"]


class PerTypePositions(PositionScheme, nn.Module):
    Config = PerTypeConfig
    TEXT, CONCEPT = 0, 1

    def __init__(self, config: PerTypeConfig, ctx):
        super().__init__()
        self.config = config
        # row 0: text; row i: concept type i (the streaming model has one concept type)
        self.type_embedding = nn.Embedding(1 + getattr(ctx, "num_types", 1), ctx.hidden_size) \
            if config.type_embedding else None
        if self.type_embedding is not None:
            nn.init.zeros_(self.type_embedding.weight)

    def text_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos

    def concept_positions(self, pos: torch.Tensor, rank: torch.Tensor, stack: str) -> torch.Tensor:
        return rank + self.config.offset

    def _add(self, x: torch.Tensor, kind: int) -> torch.Tensor:
        return x if self.type_embedding is None else x + self.type_embedding.weight[kind].to(x.dtype)

    def add_text_type(self, x: torch.Tensor) -> torch.Tensor:
        return self._add(x, self.TEXT)

    def add_concept_type(self, x: torch.Tensor) -> torch.Tensor:
        return self._add(x, self.CONCEPT)

    def add_types(self, x: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """x [..., d] plus the type embedding of ``types`` [...] (0: text, i >= 1: concept type i)."""
        return x if self.type_embedding is None else x + self.type_embedding(types).to(x.dtype)
