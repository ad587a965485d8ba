"""`update`: parameter-free. A tail token also receives its segment's latest concept's middle-stack
update ``u = middle(c) - c`` (what the middle layers added to that concept), as if it had gone
through the middle stack alongside it::

    deep input of tail token t = h_t + u_{tau(t)}        (h_t alone before a document's first concept)

At a ratio of 1 there is no tail, so the model is unchanged there; below it, the tail states
move from layer ``Ls`` statistics towards the layer ``Ls + Lm`` statistics the deep stack expects.
"""
from __future__ import annotations

from torch import nn

from concept.config import NoOptions
from concept.contracts import TailFusion


class UpdateFusion(TailFusion, nn.Module):
    Config = NoOptions
    needs_update = True
    flops_per_token = 0.0

    def __init__(self, config=None, ctx=None):
        super().__init__()

    def forward(self, tail, update, has):
        """tail, update [B, L, d]; has [B, L] bool (the token's segment has a concept in its document)."""
        return tail + update * has[..., None].to(tail.dtype)
