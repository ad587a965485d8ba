"""`hidden-projection`: latent feedback. The concept input mixes the concept embedding with a
learned projection of the emitting token's shallow hidden state (docs/policies.md)::

    h_hat = normalize(W h)                       (L2; W: d -> d, learned)
    e_in  = a * e + sqrt(1 - a^2) * (g * h_hat)   (a = sigmoid(gate), g: learned scale)

``a`` starts at ``gate_init`` (near 1), so training starts close to the plain concept
embedding; ``g`` starts at the typical norm of the backbone's token embeddings, so both
terms have the same scale. The hard id is chosen as by `argmax` (straight-through through
the softmax). The projection is part of the model at inference too (whatever the eval
sampler). Its parameters train at ``lr`` when set (default: the trainer's ``--lr-new``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from concept.components import upcast
from concept.contracts import Mixes, Sampler


@dataclass
class HiddenProjectionConfig:
    gate_init: float = 0.95  # a at step 0
    lr: float = 0.0  # learning rate of the projection, gate and scale (0: the trainer's --lr-new)

    def validate(self) -> list[str]:
        problems = []
        if not 0 < self.gate_init < 1:
            problems.append(f"gate_init: must be in (0, 1), got {self.gate_init}")
        if self.lr < 0:
            problems.append(f"lr: must be >= 0 (0: use --lr-new), got {self.lr}")
        return problems


class HiddenProjectionSampler(Sampler, Mixes, nn.Module):
    Config = HiddenProjectionConfig
    straight_through = True

    def __init__(self, config: HiddenProjectionConfig, ctx):
        super().__init__()
        self.config = config
        self.learning_rate = config.lr or None
        self.proj = nn.Linear(ctx.hidden_size, ctx.hidden_size, bias=False)
        nn.init.normal_(self.proj.weight, std=ctx.hidden_size ** -0.5)
        self.gate = nn.Parameter(torch.tensor(math.log(config.gate_init / (1 - config.gate_init))))
        self.scale = nn.Parameter(torch.tensor(1.0))

    @staticmethod
    def check_compatible(config, components) -> list[str]:
        evaluation = components.get("eval_sampler")
        if evaluation is not None and evaluation.name == "hidden-projection":
            return ["it is a training sampler whose projection the model keeps at inference; as --eval-sampler it "
                    "has nothing to add (use argmax)"]
        return []

    def init_from_backbone(self, token_embedding: torch.Tensor) -> None:
        with torch.no_grad():
            self.scale.fill_(float(token_embedding.float().norm(dim=-1).mean()))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(upcast(logits), dim=-1).to(logits.dtype)

    def mix(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Concept embeddings e [..., d] and the emitting tokens' shallow states h [..., d]."""
        a = torch.sigmoid(self.gate)
        h_hat = F.normalize(self.proj(h.to(self.proj.weight.dtype)), dim=-1)
        return (a * e + torch.sqrt(1 - a * a) * (self.scale * h_hat)).to(e.dtype)
