"""Decoding with the planner-executor (docs/planner_executor.md): prefill ``u`` and write the plan with the planner's
KV cache, then start a fresh executor cache from the plan alone and generate the text.

``concept.generation.generate`` drives it like the other decoders (``prefill`` -> first logits,
``step`` -> next logits), so sampling, stop strings, streaming and batching are shared. The planner
uses the model's eval sampler (argmax by default). Every step's logits equal the teacher-forced
executor's on the same plan and text (tested), and a batch of prompts gives each row what it gives
alone (tested).
"""
from __future__ import annotations

import torch

from ..attention import CausalPattern
from ..kv_cache import DecodePattern
from .model import describe_plan


class PlannedDecoder:
    def __init__(self, model):
        self.model = model
        self.plan = None
        self.plans: list[list[dict]] | None = None  # per row: the plan, type by type (names and concept ids)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        m = self.model
        self.plan = m.planner(input_ids, valid, sample=False)  # the planner's own cache, dropped afterwards
        self.plans = [describe_plan(m, self.plan, b) for b in range(len(input_ids))]
        self.cache = DynamicCache()  # the executor's: the plan block, then the text
        x, self.keys, pos = m.plan_block(self.plan)
        h = m.run(x, pos, CausalPattern(self.keys), self.cache)
        self.pos = torch.ones(len(input_ids), dtype=torch.long, device=input_ids.device)  # y_k sits at k + 1
        self.text = torch.zeros_like(self.pos)  # text tokens fed so far, per row
        self.block_len, self.u_len = self.keys.sum(1), valid.sum(1)
        return m.text_logits(h[:, -1])

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        m = self.model
        active = torch.ones_like(tokens, dtype=torch.bool) if active is None else active
        self.keys = torch.cat([self.keys, active[:, None]], dim=1)  # a finished row's entry is masked out
        h = m.run(m.embed_text(tokens[:, None]), self.pos[:, None], DecodePattern(self.keys), self.cache)
        self.pos = self.pos + active.long()
        self.text = self.text + active.long()
        return m.text_logits(h[:, -1])

    def kv_stats(self) -> list[dict]:
        """Per row: the executor's KV entries (plan block + text) against a dense model's on ``u`` + text."""
        layers = len(self.model.inner.layers)
        k = self.cache.layers[0].keys
        entry = 2 * k.shape[1] * k.shape[3] * k.element_size()
        rows = []
        for n, t, u in zip(self.block_len.tolist(), self.text.tolist(), self.u_len.tolist()):
            dense = u + t
            rows.append({"tokens": n + t, "entries": {"executor": layers * (n + t)}, "bytes": layers * (n + t) * entry,
                         "dense_bytes": layers * dense * entry, "allocated_bytes": layers * self.keys.shape[1] * entry})
        return rows
