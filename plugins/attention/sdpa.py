"""`sdpa`: the reference backend. A dense boolean [L, L] mask from the one-pass rule into
``scaled_dot_product_attention``. Exact on any device, O(T^2) memory."""
from __future__ import annotations

from dataclasses import dataclass

from einops import rearrange

from concept.attention import AttentionPattern, sdpa
from concept.contracts import AttentionBackend
from concept.packing import PackedLayout, allowed


@dataclass
class SDPAConfig:
    pass


class DenseMaskPattern(AttentionPattern):
    def __init__(self, layout: PackedLayout):
        self.mask = allowed(layout.meta, layout.meta)

    def __call__(self, query, key, value, scaling):
        return rearrange(sdpa(query, key, value, scaling, self.mask), "b h l d -> b l h d")


class SDPABackend(AttentionBackend):
    Config = SDPAConfig
    supports_backward = True
    plans_deep_block = True  # (the rule over any layout)

    def __init__(self, config: SDPAConfig | None = None, ctx=None):
        self.config = config

    def plan(self, layout: PackedLayout) -> AttentionPattern:
        return DenseMaskPattern(layout)
