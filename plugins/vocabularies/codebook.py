"""`codebook`: weight-tied codebook (semantic-ID style, docs/policies.md).

One table of K code vectors (``code_dim`` wide) serves both directions:

    input  e(id)  = proj_in(codebook[id])                       (code_dim -> model width)
    logits(h)     = scale * normalize(proj_out(rms_norm(h))) . normalize(codebook)^T
                    (+ a NULL logit from its own linear map, when the policy uses one)

so the head's cross-entropy gradient reaches the codebook rows that the input side uses.
Logits are cosine similarities times a learned scale (initialised at ``logit_scale``): the
keep decision and the choice of code depend on directions, not on norms. The soft input is
``proj_in(probs @ codebook)``.

Collapse (a few codes taking every token) is the known failure of codebooks: watch
``concept eval``'s usage perplexity, and train with ``--revive-after N`` (codes unused for N steps are
pointed at recent queries), ``--kmeans-init B`` (codes start at the k-means centroids of the queries of B
training batches; both ``concept.codes``) or ``--usage-weight`` (a KL from the batch's mean code
distribution to uniform).

Multi-level codes (``levels`` L > 1, semantic-ID style): L codebooks of K codes, one per level, sharing
the projections. A concept is L consecutive code tokens, level 0 first; token l reads and writes level
l's codebook (the ``level`` argument of ``logits`` / ``embed_hard`` / ``embed_soft``: an int, or a tensor
of levels shaped like the ids).

- The planner-executor interleaves them as consecutive plan steps (a type's ``max_len`` counts code
  tokens, a multiple of L, and its <EOS> may only follow a complete concept), so its beam search,
  greedy decoding and Hard-EM E-step search over the levels; each step's state already depends on the
  earlier levels.
- The streaming family reads all L levels from one shallow state: level l's query is what is left of
  the level-0 query after removing its components along the codes chosen at levels < l (``before``;
  residual quantisation on the unit sphere), and a boundary's L code tokens enter the middle and deep
  stacks as L consecutive concept slots. At inference ``beam`` > 1 searches the levels jointly for the
  codes of highest total log-probability (``concept.streaming.model.ConceptModel.codes``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from concept.codes import other_rows, rms_row_norm
from concept.components import rms_normalize
from concept.contracts import Revivable, Vocabulary


@dataclass
class CodebookVocabConfig:
    size: int = 4096  # K codes
    code_dim: int = 64
    logit_scale: float = 8.0  # initial scale of the cosine logits
    levels: int = 1  # L codebooks, one per level: a concept is L consecutive code tokens
    beam: int = 1  # streaming, at inference: beam width of the search over the levels (1: greedy)

    def validate(self) -> list[str]:
        problems = []
        if not isinstance(self.levels, int) or isinstance(self.levels, bool) or self.levels < 1:
            problems.append(f"levels: at least 1 codebook, got {self.levels!r}")
        if not isinstance(self.beam, int) or isinstance(self.beam, bool) or self.beam < 1:
            problems.append(f"beam: a beam width >= 1, got {self.beam!r}")
        if self.size < 1:
            problems.append(f"size: K must be >= 1, got {self.size}")
        if self.code_dim < 1:
            problems.append(f"code_dim: must be >= 1, got {self.code_dim}")
        if not self.logit_scale > 0:
            problems.append(f"logit_scale: must be > 0, got {self.logit_scale}")
        return problems


class CodebookVocabulary(Vocabulary, Revivable, nn.Module):
    Config = CodebookVocabConfig

    def __init__(self, config: CodebookVocabConfig, ctx):
        super().__init__()
        self.config = config
        self.size = config.size
        self.levels = config.levels
        d, c = ctx.hidden_size, config.code_dim
        self.codebook = nn.Parameter(torch.randn(config.size, c))  # level 0
        self.deeper = nn.ParameterList(nn.Parameter(torch.randn(config.size, c)) for _ in range(config.levels - 1))
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

    def book(self, level: int) -> torch.Tensor:
        """[K, code_dim] level ``level``'s codebook."""
        return self.codebook if level == 0 else self.deeper[level - 1]

    def _per_level(self, fn, level, like: torch.Tensor) -> torch.Tensor:
        """``fn(codebook)`` for an int level; for a tensor of levels (shaped like ``like``'s leading dims), each
        element's own level's result."""
        if not isinstance(level, torch.Tensor):
            return fn(self.book(int(level)))
        out = None
        for l in range(self.levels):
            r = fn(self.book(l))
            out = r if out is None else torch.where((level == l)[..., None], r, out)
        return out

    def query(self, h: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """[..., code_dim] the unit query of states ``h`` that the codes' cosine logits read. ``before`` [..., l]:
        the codes chosen at levels 0..l-1 for the same state (streaming multi-level codes); the query then loses
        its components along them, one level after the other, so level l codes what they left."""
        query = F.normalize(self.proj_out(rms_normalize(h)), dim=-1)
        for j in range(0 if before is None else before.shape[-1]):
            code = F.normalize(self.book(j)[before[..., j]], dim=-1).to(query.dtype)
            query = F.normalize(query - (query * code).sum(-1, keepdim=True) * code, dim=-1)
        return query

    def logits(self, h: torch.Tensor, level=0, before: torch.Tensor | None = None) -> torch.Tensor:
        """Cosine logits over ``level``'s codes (+ the NULL logit); ``before``: see :meth:`query`."""
        x = rms_normalize(h)
        query = self.query(h, before)
        scale = self.log_scale.exp().to(query.dtype)
        logits = self._per_level(lambda book: scale * query @ F.normalize(book, dim=-1).to(query.dtype).T, level, h)
        if self.null is not None:
            logits = torch.cat([logits, self.null(x)], dim=-1)
        return logits

    def embed_hard(self, ids: torch.Tensor, level=0) -> torch.Tensor:
        return self._per_level(lambda book: self.proj_in(book[ids]), level, ids)

    def embed_soft(self, probs: torch.Tensor, level=0) -> torch.Tensor:
        """probs: [..., K] weights over codes (sum to 1)."""
        return self._per_level(lambda book: self.proj_in(probs.to(book.dtype) @ book), level, probs)

    # -- anti-collapse (concept.codes: dead-code revival, k-means initialisation) ----------------------
    def set_codes(self, level: int, ids: torch.Tensor, directions: torch.Tensor) -> None:
        """Point ``level``'s codes ``ids`` [n] at unit ``directions`` [n, code_dim] (queries of :meth:`query`):
        each becomes the best code of the states whose query it is. The rows keep the codebook's root-mean-
        square row norm (of its other rows), so their inputs ``proj_in(row)`` stay at the scale of the others'."""
        book = self.book(level)
        with torch.no_grad():
            book[ids] = (directions.float() * rms_row_norm(other_rows(book, ids))).to(book.dtype)
