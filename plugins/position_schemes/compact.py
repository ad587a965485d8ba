"""`compact` (ablation): inside the middle stack concepts are numbered 0, 1, ..., C-1 (their
rank in the document); everywhere else (shallow, deep) every element keeps its time
position. The middle stack then sees a dense, gap-free position sequence, as if the
concepts were a text of their own, while the deep stack still lines concepts up with the
tokens around them. No type embedding. Exact for the streaming model (ranks do not depend
on the query position).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.contracts import PositionScheme


@dataclass
class CompactConfig:
    pass


class CompactPositions(PositionScheme, nn.Module):
    Config = CompactConfig

    def __init__(self, config: CompactConfig | None = None, ctx=None):
        super().__init__()
        self.config = config

    def text_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos

    def concept_positions(self, pos: torch.Tensor, rank: torch.Tensor, stack: str) -> torch.Tensor:
        return rank if stack == "middle" else pos

    def add_text_type(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_concept_type(self, x: torch.Tensor) -> torch.Tensor:
        return x
