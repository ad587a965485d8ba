"""`bridge`: a learned map for the tail states, started at zero so the model begins at the
parameter-free rule (``base``)::

    x   = [rms(h_t) ; rms(u)]                  (u: the segment's latest concept's middle update, 0 if none)
    out = base(h_t, u) + W_out act(W_in x)     (hidden > 0; W_out starts at 0)
    out = base(h_t, u) + W_out x               (hidden = 0: a linear bridge; W_out starts at 0)

It stands in for what the skipped middle layers would have computed for the tail token itself,
from the token's shallow state and its latest concept. Pre-train it alone against the
backbone's own deep-stack inputs (``concept train --train-only new --align 1``: a dense
per-token target, cheap), then train everything. Its parameters learn at ``lr`` when set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from concept.components import rms_normalize
from concept.contracts import TailFusion

BASES = ("update", "none")


@dataclass
class BridgeConfig:
    base: str = "update"  # the parameter-free rule the bridge starts from: update | none
    hidden: int = 1024  # width of the MLP (0: a linear bridge)
    lr: float = 0.0  # learning rate of the bridge (0: the trainer's --lr-new)

    def validate(self) -> list[str]:
        problems = []
        if self.base not in BASES:
            problems.append(f"base: one of {', '.join(BASES)}, got {self.base!r}")
        if self.hidden < 0:
            problems.append(f"hidden: must be >= 0 (0: linear), got {self.hidden}")
        if self.lr < 0:
            problems.append(f"lr: must be >= 0 (0: use --lr-new), got {self.lr}")
        return problems


class BridgeFusion(TailFusion, nn.Module):
    Config = BridgeConfig
    needs_update = True

    def __init__(self, config: BridgeConfig, ctx):
        super().__init__()
        self.config = config
        self.learning_rate = config.lr or None
        d = ctx.hidden_size
        if config.hidden:
            self.inp = nn.Linear(2 * d, config.hidden)
            self.act = nn.GELU()
            self.out = nn.Linear(config.hidden, d)
        else:
            self.inp, self.act = None, None
            self.out = nn.Linear(2 * d, d)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @property
    def flops_per_token(self) -> float:
        return 2.0 * sum(m.weight.numel() for m in (self.inp, self.out) if m is not None)

    def forward(self, tail, update, has):
        has = has[..., None].to(tail.dtype)
        u = update * has
        base = tail + u if self.config.base == "update" else tail
        x = torch.cat([rms_normalize(tail), rms_normalize(u) * has], dim=-1).to(self.out.weight.dtype)
        if self.inp is not None:
            x = self.act(self.inp(x))
        return base + self.out(x).to(tail.dtype)
