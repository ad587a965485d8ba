"""`none`: a tail token enters the deep stack as its shallow state (the per-step definition, docs/architecture.md)."""
from __future__ import annotations

from torch import nn

from concept.config import NoOptions
from concept.contracts import TailFusion


class NoFusion(TailFusion, nn.Module):
    Config = NoOptions
    needs_update = False  # the model need not compute the concepts' middle-stack updates
    flops_per_token = 0.0

    def __init__(self, config=None, ctx=None):
        super().__init__()

    def forward(self, tail, update, has):
        return tail
