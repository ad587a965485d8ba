"""The dense baseline: the backbone itself (plus LoRA when training), plain next-token CE.

It runs the backbone's layers through the same attention routing and masks as the concept
model's shallow stack (causal, padding, packed documents), so the two are compared on
exactly the same inputs. Its logits equal the Hugging Face forward (tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import packing
from .attention import CausalPlan
from .backbone import decoder
from .model import next_token_loss, run_layers


@dataclass
class DenseOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class DenseModel(nn.Module):
    def __init__(self, backbone, plan=None, tokenizer=None):
        super().__init__()
        self.backbone = backbone
        self.plan = plan
        self.tokenizer = tokenizer
        self.gradient_checkpointing = False

    def forward(self, input_ids, attention_mask=None, labels=None, document_ids=None, **_) -> DenseOutput:
        inner = decoder(self.backbone)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        pos = packing.time_positions(valid, document_ids)
        x = run_layers(inner.layers, inner.embed_tokens(input_ids), pos, CausalPlan(valid, document_ids),
                       inner.rotary_emb, self.gradient_checkpointing and self.training)
        logits = self.backbone.lm_head(inner.norm(x))
        loss = None if labels is None else next_token_loss(logits, labels, valid, document_ids)
        return DenseOutput(logits, loss)

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Generate with transformers' DynamicCache; see :func:`concept.generation.generate`."""
        from .generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)

    def new_modules(self) -> dict[str, nn.Module]:
        return {}

    def new_state_dict(self) -> dict[str, torch.Tensor]:
        return {}
