"""`codebook`: weight-tied codebook (semantic-ID style, SPEC §2.5).

One table of K code vectors (``code_dim`` wide) serves both directions:

    input  e(id)  = proj_in(codebook[id])                       (code_dim -> model width)
    logits(h)     = scale * normalize(proj_out(rms_norm(h))) . normalize(codebook)^T
                    (+ a NULL logit from its own linear map, when the policy uses one)

so the head's cross-entropy gradient reaches the codebook rows that the input side uses.
Logits are cosine similarities times a learned scale (initialised at ``logit_scale``): the
keep decision and the choice of code depend on directions, not on norms. The soft input is
``proj_in(probs @ codebook)``.

Collapse (a few codes taking every token) is the known failure of codebooks: watch
``concept eval``'s usage perplexity and train with ``--usage-weight`` (a KL from the batch's
mean code distribution to uniform, ``concept.training``). Only one level of codes is built;
multi-level codes with beam search over levels are not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from concept.components import rms_normalize


@dataclass
class CodebookVocabConfig:
    size: int = 4096  # K codes
    code_dim: int = 64
    logit_scale: float = 8.0  # initial scale of the cosine logits

    def validate(self) -> list[str]:
        problems = []
        if self.size < 1:
            problems.append(f"size: K must be >= 1, got {self.size}")
        if self.code_dim < 1:
            problems.append(f"code_dim: must be >= 1, got {self.code_dim}")
        if not self.logit_scale > 0:
            problems.append(f"logit_scale: must be > 0, got {self.logit_scale}")
        return problems


class CodebookVocabulary(nn.Module):
    Config = CodebookVocabConfig

    def __init__(self, config: CodebookVocabConfig, ctx):
        super().__init__()
        self.config = config
        self.size = config.size
        d, c = ctx.hidden_size, config.code_dim
        self.codebook = nn.Parameter(torch.randn(config.size, c))
        self.proj_in = nn.Linear(c, d, bias=False)
        self.proj_out = nn.Linear(d, c, bias=False)
        self.log_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale)))
        self.null = nn.Linear(d, 1) if ctx.uses_null_class else None
        if self.null is not None:
            nn.init.normal_(self.null.weight, std=d ** -0.5)
            nn.init.zeros_(self.null.bias)

    def init_from_backbone(self, token_embedding: torch.Tensor) -> None:
        """Inputs start at the scale of the backbone's token embeddings (codebook rows have norm
        ~sqrt(code_dim); proj_in maps them to rows of that typical norm)."""
        target = float(token_embedding.float().norm(dim=-1).mean())
        with torch.no_grad():
            self.proj_in.weight.normal_(0.0, target / self.config.code_dim ** 0.5 / self.proj_in.out_features ** 0.5)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_normalize(h)
        query = F.normalize(self.proj_out(x), dim=-1)
        codes = F.normalize(self.codebook, dim=-1).to(query.dtype)
        logits = self.log_scale.exp().to(query.dtype) * query @ codes.T
        if self.null is not None:
            logits = torch.cat([logits, self.null(x)], dim=-1)
        return logits

    def embed_hard(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj_in(self.codebook[ids])

    def embed_soft(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: [..., K] weights over codes (sum to 1)."""
        return self.proj_in(probs.to(self.codebook.dtype) @ self.codebook)
