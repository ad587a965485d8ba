"""`argmax`: deterministic hard decision (inference default).

The straight-through path uses the plain softmax, so a model can also be fine-tuned with a
deterministic sampler (this is what the exactness tests use for gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.components import upcast
from concept.contracts import Sampler


@dataclass
class ArgmaxConfig:
    straight_through: bool = True


class ArgmaxSampler(Sampler, nn.Module):
    Config = ArgmaxConfig

    def __init__(self, config: ArgmaxConfig, ctx=None):
        super().__init__()
        self.config = config
        self.straight_through = config.straight_through

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(upcast(logits), dim=-1).to(logits.dtype)
