"""`embedding`: a fresh table of K concept ids and a linear ConceptHead over K (+ NULL) classes."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from concept.codes import other_rows, rms_row_norm
from concept.components import rms_normalize
from concept.contracts import Revivable, Vocabulary


@dataclass
class EmbeddingVocabConfig:
    size: int = 4096  # K
    init_std: float = 0.0  # 0: match the backbone's token-embedding scale
    normalize_input: bool = True  # the head reads RMS-normalised states (scale-free keep decisions)
    head_init_scale: float = 8.0  # head weights ~ N(0, (scale / sqrt(d))^2): decisive concept ids at step 0

    def validate(self) -> list[str]:
        problems = []
        if self.size < 1:
            problems.append(f"size: K must be >= 1, got {self.size}")
        if self.init_std < 0:
            problems.append(f"init_std: must be >= 0, got {self.init_std}")
        if self.head_init_scale <= 0:
            problems.append(f"head_init_scale: must be > 0, got {self.head_init_scale}")
        return problems


class ConceptHead(nn.Linear):
    """Shallow hidden state -> logits over K concept ids (+ NULL, last)."""


class ConceptEmbedding(nn.Embedding):
    """Concept id -> input vector of the middle stack (backbone width)."""


class EmbeddingVocabulary(Vocabulary, Revivable, nn.Module):
    Config = EmbeddingVocabConfig

    def __init__(self, config: EmbeddingVocabConfig, ctx):
        super().__init__()
        self.config = config
        self.size = config.size
        self.head = ConceptHead(ctx.hidden_size, config.size + int(ctx.uses_null_class))
        self.table = ConceptEmbedding(config.size, ctx.hidden_size)
        # with normalised inputs (|h| = sqrt(d)) this gives concept logits of std ~ head_init_scale
        nn.init.normal_(self.head.weight, std=config.head_init_scale * ctx.hidden_size ** -0.5)
        nn.init.zeros_(self.head.bias)

    def init_from_backbone(self, token_embedding: torch.Tensor) -> None:
        """Start concept embeddings at the scale of the backbone's token embeddings."""
        std = self.config.init_std or float(token_embedding.float().std())
        with torch.no_grad():
            self.table.weight.normal_(0.0, std)

    def query(self, h: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """[..., d] the unit direction of states ``h`` that the head's rows are matched against (anti-collapse,
        ``concept.codes``); the head reads ``rms_norm(h)`` (or ``h``), of which this is the direction."""
        return F.normalize(h.float(), dim=-1)

    def set_codes(self, level: int, ids: torch.Tensor, directions: torch.Tensor) -> None:
        """Point the head's rows of ``ids`` [n] at unit ``directions`` [n, d], with the rows' root-mean-square
        norm and mean bias, so that each id is a strong candidate for the states it was pointed at (dead-code
        revival, k-means initialisation: ``concept.codes``). Their input embeddings stay as they are."""
        weight, bias, K = self.head.weight, self.head.bias, self.size
        with torch.no_grad():
            weight[ids] = (directions.float() * rms_row_norm(other_rows(weight[:K], ids))).to(weight.dtype)
            if len(ids) < K:  # (every row re-pointed: the biases stay)
                bias[ids] = other_rows(bias[:K], ids).mean()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Head logits. Hidden-state norms vary by orders of magnitude between tokens in
        pretrained LMs; normalising makes the keep decision depend on direction, which keeps
        the realised ratio far more stable across data (see docs/results.md)."""
        if self.config.normalize_input:
            h = rms_normalize(h)
        return self.head(h)

    def embed_hard(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)

    def embed_soft(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: [..., K] weights over concept ids (sum to 1)."""
        return probs.to(self.table.weight.dtype) @ self.table.weight
