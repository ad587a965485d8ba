"""Step-wise decoding shared by the model families: per-row selection over a decoder state, the last
real token of each row, and :class:`DenseDecoder` (the plain backbone with transformers' own
``DynamicCache``, for dense baseline runs and for comparison). Each family has its own decoder
(``concept.streaming.decoding``, ``concept.planner.decoding``).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from . import packing


def select_rows(mask: torch.Tensor, new, old):
    """Per-row select over a policy state (a tensor or a nest of tensors with batch first)."""
    def pick(a, b):
        m = mask.view(-1, *([1] * (a.dim() - 1)))
        return torch.where(m, a, b)
    return pytree.tree_map(pick, new, old)


def last_real(valid: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last real token."""
    return valid.shape[1] - 1 - valid.flip(1).to(torch.int8).argmax(1)


class DenseDecoder:
    """The plain backbone with transformers' ``DynamicCache`` (the dense baseline). With ``last_layer``
    (a dense model with MTP heads) it keeps the last fed token's output of that layer, the state
    the heads draft from."""

    def __init__(self, backbone, last_layer=None):
        self.backbone = backbone
        self.last_layer = last_layer
        self.last_hidden = None

    def _forward(self, **kwargs):
        captured = {}
        hook = None
        if self.last_layer is not None:
            hook = self.last_layer.register_forward_hook(
                lambda m, args, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out))
        try:
            out = self.backbone(past_key_values=self.cache, use_cache=True, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        return out, captured.get("h")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.mask = valid.long()
        self.pos = valid.sum(1)
        self.keep = None
        left_padded = bool(valid[:, -1].all())
        out, hidden = self._forward(input_ids=input_ids, attention_mask=self.mask,
                                    position_ids=packing.time_positions(valid), logits_to_keep=int(left_padded))
        last = last_real(valid)
        rows = torch.arange(len(valid), device=valid.device)
        if hidden is not None:
            self.last_hidden = hidden[rows, last]
        return out.logits[:, -1] if left_padded else out.logits[rows, last]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        active = torch.ones_like(tokens, dtype=torch.bool) if active is None else active
        self.mask = torch.cat([self.mask, active.long()[:, None]], dim=1)  # a finished row's entry is masked out
        out, hidden = self._forward(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.pos[:, None])
        if hidden is not None:
            self.last_hidden = torch.where(active[:, None], hidden[:, -1], self.last_hidden)
        self.pos = self.pos + active.long()
        return out.logits[:, -1]

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``n`` tokens per row [B, n] in one forward -> [B, n, V] logits; :meth:`accept` keeps a
        prefix per row. The rejected tokens' cache entries stay, masked out of every later query."""
        n = tokens.shape[1]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), n)], dim=1)
        positions = self.pos[:, None] + torch.arange(n, device=tokens.device)
        out, hidden = self._forward(input_ids=tokens, attention_mask=self.mask, position_ids=positions)
        self._pending = (n, hidden)
        return out.logits

    @torch.no_grad()
    def accept(self, count: torch.Tensor) -> None:
        n, hidden = self._pending
        self._pending = None
        count = count.clamp(0, n)
        self.mask[:, -n:] = (torch.arange(n, device=count.device)[None, :] < count[:, None]).long()
        if hidden is not None:
            rows = torch.arange(len(count), device=count.device)
            self.last_hidden = torch.where((count > 0)[:, None], hidden[rows, (count - 1).clamp(min=0)], self.last_hidden)
        self.pos = self.pos + count

    def draft_state(self) -> torch.Tensor:
        """[B, d] the state the MTP heads read for the last fed token."""
        return self.last_hidden

    def kv_stats(self) -> list[dict]:
        layers = self.backbone.config.num_hidden_layers
        k = self.cache.layers[0].keys
        entry = 2 * k.shape[1] * k.shape[3] * k.element_size()
        return [{"tokens": t, "entries": {"dense": layers * t}, "bytes": layers * t * entry,
                 "dense_bytes": layers * t * entry, "allocated_bytes": layers * self.mask.shape[1] * len(self.mask) * entry}
                for t in self.pos.tolist()]


class ReplayDecoder:
    """Decoding by the model's own forward over the whole row again at each step (no cache): exact by construction,
    and quadratic in the output's length. The default of a family that writes no decoder of its own
    (``concept.contracts.Family.decoder``). ``model(input_ids, attention_mask=...)`` must return ``logits`` whose
    position t predicts token t+1, with masked-out positions (left padding, a finished row's steps) ignored."""

    def __init__(self, model):
        self.model = model
        self.keep = None

    def _last_logits(self) -> torch.Tensor:
        logits = self.model(self.ids, attention_mask=self.valid.long()).logits
        rows = torch.arange(len(self.ids), device=self.ids.device)
        return logits[rows, last_real(self.valid)]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self.ids, self.valid = input_ids, valid.bool()
        return self._last_logits()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        active = torch.ones_like(tokens, dtype=torch.bool) if active is None else active
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.valid = torch.cat([self.valid, active[:, None]], dim=1)  # a finished row's token is masked out
        return self._last_logits()

    def kv_stats(self) -> list[dict]:
        return [{"tokens": t, "entries": {}, "bytes": 0, "dense_bytes": 0, "allocated_bytes": 0}
                for t in self.valid.sum(1).tolist()]
