"""`gumbel-st`: Gumbel-softmax with the straight-through estimator (training default).

Forward is hard (the argmax of the perturbed probabilities); backward flows through the
soft, temperature-scaled probabilities: ``e = e_hard + (e_soft - stopgrad(e_soft))``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.components import upcast
from concept.contracts import Sampler, Tempered


@dataclass
class GumbelConfig:
    tau: float = 1.0  # temperature; lower is closer to one-hot

    def validate(self) -> list[str]:
        return [] if self.tau > 0 else [f"tau: temperature must be > 0, got {self.tau}"]


class GumbelSTSampler(Sampler, Tempered, nn.Module):
    Config = GumbelConfig
    straight_through = True

    def __init__(self, config: GumbelConfig, ctx=None):
        super().__init__()
        self.config = config
        self.init_temperature(config.tau)  # a training schedule may change it

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        uniform = torch.rand_like(logits, dtype=torch.float32).clamp_(1e-10, 1.0 - 1e-7)
        gumbel = -torch.log(-torch.log(uniform))
        return torch.softmax((upcast(logits) + gumbel) / self.temperature, dim=-1).to(logits.dtype)
