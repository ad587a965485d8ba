"""`time`: every element keeps its original token position (RoPE). Exact for the streaming model:
a concept's or tail token's offset inside Z_t never depends on t."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.contracts import PositionScheme


@dataclass
class TimeConfig:
    pass


class TimePositions(PositionScheme, nn.Module):
    Config = TimeConfig

    def __init__(self, config: TimeConfig | None = None, ctx=None):
        super().__init__()
        self.config = config

    def text_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos

    def concept_positions(self, pos: torch.Tensor, rank: torch.Tensor, stack: str) -> torch.Tensor:
        return pos

    def add_text_type(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_concept_type(self, x: torch.Tensor) -> torch.Tensor:
        return x
