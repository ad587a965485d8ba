"""Multi-token prediction (MTP) heads: k small heads, head i predicts token t+1+i from a state at t.

Each head is a Medusa-style residual block read through the backbone's own final norm and LM
head (frozen, shared)::

    logits_i(h_t) = lm_head(norm(h_t + SiLU(W_i h_t + b_i)))          W_i, b_i zero at init

so at init every head is the backbone's "logit lens" on ``h`` (head 0 is then exactly the
`entropy` policy's predictor), and training moves each one towards the token i steps further.
Per token and head: 2 d^2 FLOPs for the block plus the LM head's 2 d V (SmolLM2: 0.7 + 57 MFLOP).

Trained by self-distillation (``concept.objectives.MTPObjective``): KL to the frozen backbone's
own next-token distribution at t+i (which predicts token t+1+i), plus a weighted CE on the real
token. The states they read are detached: the heads learn to read the model, never to change it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MTPHeads(nn.Module):
    def __init__(self, hidden_size: int, k: int):
        super().__init__()
        self.k = k
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(k))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.readout: Callable[[torch.Tensor], torch.Tensor] | None = None  # norm + LM head, bound by the model

    def bind(self, readout: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.readout = readout

    def state(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Head i's state (before the norm and LM head)."""
        return h + F.silu(self.blocks[i](h))

    def logits(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """[..., V] head i's logits for token t+1+i from states h [..., d]."""
        if self.readout is None:
            raise RuntimeError("MTP heads: no readout bound (build the model through concept.build)")
        return self.readout(self.state(h, i))

    def top1(self, h: torch.Tensor, i: int = 0, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-1 probability, token) [...] of head i, without gradient, ``block`` states per LM-head
        matmul so the [N, V] probabilities are never all held."""
        flat = h.detach().reshape(-1, h.shape[-1])
        probs, tokens = [], []
        with torch.no_grad():
            for part in flat.split(block):
                p, tok = torch.softmax(self.logits(part, i).float(), dim=-1).max(-1)
                probs.append(p)
                tokens.append(tok)
        if not probs:
            return flat.new_zeros(h.shape[:-1]), torch.zeros(h.shape[:-1], dtype=torch.long, device=h.device)
        return torch.cat(probs).view(h.shape[:-1]), torch.cat(tokens).view(h.shape[:-1])


def mtp_pairs(valid: torch.Tensor, document_ids: torch.Tensor | None, i: int) -> torch.Tensor:
    """[B, T - 1 - i] bool: position t may be trained to predict token t+1+i (every token from t to
    t+1+i is real and of t's document)."""
    T = valid.shape[1]
    ok = valid[:, : T - 1 - i].clone()
    for j in range(1, i + 2):
        ok &= valid[:, j: T - 1 - i + j]
        if document_ids is not None:
            ok &= document_ids[:, j: T - 1 - i + j] == document_ids[:, : T - 1 - i]
    return ok
