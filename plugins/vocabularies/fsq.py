"""`fsq`: finite scalar quantization (Mentzer et al. 2023, "Finite Scalar Quantization: VQ-VAE Made Simple").

The shallow state is projected to d = len(levels_per_dim) bounded numbers, and each is rounded to one of a fixed
grid of levels. A concept id is the mixed-radix number of the d digits (dimension 0 the most significant), so
K = prod(levels_per_dim) and an id means the same code in every run:

    z             = tanh(proj_down(rms_norm(h)))                      [..., d], each in (-1, 1)
    grid_i        = linspace(-1, 1, L_i)                              a buffer: fixed, never trained
    u_i           = (z_i + 1) / step_i,  step_i = 2 / (L_i - 1)      z_i in grid steps, 0 .. L_i - 1
    logits(h)[k]  = sum_i log_softmax_j(-(u_i - j)^2 / temperature)[digit_i(k)]   (+ the NULL logit)
    embed_hard(k) = proj_up(table[k]),   table[k] = (grid_0[digit_0(k)], ..., grid_{d-1}[digit_{d-1}(k)])
    embed_soft(p) = proj_up(p @ table)

- **The hard choice is FSQ's rounding.** The logits are a sum of per-dimension terms, each largest at the level
  nearest to z_i, so their argmax over the K codes is the per-dimension rounding of z to the grid (tested).
  The samplers (argmax, Gumbel-softmax, straight-through) read them unchanged; the straight-through path
  reaches ``proj_down`` through the soft probabilities, ``proj_up`` through the hard embedding.
- **Per-dimension normalisation.** Each dimension's term is a log-probability, which shifts every state's K
  logits by one constant: the softmax over the codes (all that a sampler sees) is that of the plain
  ``-sum_i (u_i - j_i)^2 / temperature``, but their logsumexp is exactly 0. With a NULL class,
  P(NULL) = sigmoid(NULL logit): the keep decision is the NULL head's alone, not a function of how close z
  happens to lie to a grid point.
- **Temperature in grid steps.** Distances are measured in each dimension's grid steps, so one ``temperature``
  means the same softness on every dimension whatever its number of levels. The soft path's gradient
  d E_p[u] / du = 2 Var_p / temperature averages 1 over a grid step whatever the temperature (E_p[u] moves by
  one step per step); a low temperature concentrates it near the midpoints between levels and makes sampled
  codes the rounded ones, a high one spreads it out and lets Gumbel samples wander to neighbouring levels.
- **No codebook to collapse.** The code vectors are a fixed product grid: there are no code rows that stop
  being chosen and so stop being trained (VQ's dead codes). Only the projections (and the NULL logit) learn,
  and every code is chosen whenever z falls in its cell; no auxiliary loss is needed (``--usage-weight`` and
  ``concept eval``'s usage perplexity still apply).

Multi-level codes (``levels`` L > 1, as ``codebook``'s): a concept is L consecutive code tokens, each an id of
the same K = prod(levels_per_dim) grid, sharing ``proj_down`` and ``proj_up``.

- The streaming family reads all L levels from one shallow state and passes ``before`` (the codes of the
  levels < l): level l quantises what they left, rescaled to the grid (residual FSQ):
  ``z_l = (z - sum_{j<l} s_j * table[before_j]) / s_l`` with ``s_j = (L_i - 1) ** -j`` per dimension (level j's
  cell is 1 / (L_i - 1) of level j-1's), so greedy codes round z finer and finer, and ``beam`` > 1 searches the
  levels jointly (``concept.streaming.model.ConceptModel.level_search``).
- The planner-executor writes the levels as consecutive plan steps, each from its own state (``before`` is
  None): every level reads the plain projection of its step's state.
- Inputs: level l's code k enters as ``proj_up(table[k]) + level_embed[l]``, a learned, zero-initialised
  vector per level (L > 1 only), so the stacks can tell level 0's code from the same digits at level 1.

``size`` (0 by default) is K when it is given: the planner-executor sets it to each plan type's size. Without
``levels_per_dim`` a grid of exactly ``size`` codes is chosen (its prime factors packed into levels of at most
8: 512 -> [8, 8, 8], 1000 -> [8, 5, 5, 5], 2048 -> [8, 8, 8, 4]); with it, the two must agree. With neither,
levels_per_dim is [8, 8, 8, 8] (K = 4096, the other vocabularies' default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from concept.components import rms_normalize, upcast
from concept.contracts import Vocabulary
from concept.errors import ConfigError

DEFAULT_LEVELS = (8, 8, 8, 8)  # K = 4096
MAX_CODES = 2 ** 20  # the head's logits are [..., K]
LEVEL_CAP = 8  # a grid chosen for `size` packs its prime factors into levels of at most this many
LARGEST_FACTOR = 16  # ... and refuses a size with a larger prime factor (one dimension of that many levels)


def prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def grid_for_size(size: int) -> list[int]:
    """Levels per dimension with product exactly ``size``: its prime factors, largest first, each into the first
    dimension that stays <= LEVEL_CAP (first-fit decreasing), most levels first (4096 -> [8, 8, 8, 8])."""
    dims: list[int] = []
    for p in sorted(prime_factors(size), reverse=True):
        for i, levels in enumerate(dims):
            if levels * p <= LEVEL_CAP:
                dims[i] = levels * p
                break
        else:
            dims.append(p)
    return sorted(dims, reverse=True)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class FSQVocabConfig:
    levels_per_dim: list[int] | None = None  # grid levels of each dimension (each >= 2); None: [8,8,8,8] or for `size`
    size: int = 0  # K; 0: prod(levels_per_dim); else it must be that (the planner-executor: a type's size)
    temperature: float = 0.25  # softness of the per-dimension logits, in squared grid steps
    levels: int = 1  # L code levels: a concept is L consecutive code tokens (residual FSQ in the streaming family)
    beam: int = 1  # streaming, at inference: beam width of the search over the levels (1: greedy)

    def validate(self) -> list[str]:
        problems = []
        dims, size = self.levels_per_dim, self.size
        dims_ok = False
        if dims is not None:
            if not isinstance(dims, (list, tuple)) or not dims:
                problems.append(f"levels_per_dim: a non-empty list of level counts, one per dimension, each an "
                                f"integer >= 2 (e.g. [8,5,5,5]), got {dims!r}")
            elif bad := [x for x in dims if not _is_int(x) or x < 2]:
                problems.append(f"levels_per_dim: every dimension needs an integer number of levels >= 2, got "
                                f"{', '.join(map(repr, bad))} in {list(dims)!r}")
            elif math.prod(dims) > MAX_CODES:
                problems.append(f"levels_per_dim: K = prod({list(dims)}) = {math.prod(dims)} codes, above the limit "
                                f"2**20 = {MAX_CODES} (the head's logits are [..., K]); use fewer or smaller dimensions")
            else:
                dims_ok = True
        if not _is_int(size) or size < 0 or size == 1:
            problems.append(f"size: K, 0 (= prod(levels_per_dim)) or >= 2, got {size!r}")
        elif size > MAX_CODES:
            problems.append(f"size: {size} codes, above the limit 2**20 = {MAX_CODES}")
        elif size and dims_ok and math.prod(dims) != size:
            problems.append(f"size: {size} codes asked for (vocabulary.size, or a planner-executor type's size), but "
                            f"levels_per_dim {list(dims)} gives K = {math.prod(dims)}; make them agree, or drop "
                            f"levels_per_dim for a grid of {size} codes")
        elif size and dims is None and max(prime_factors(size)) > LARGEST_FACTOR:
            problems.append(f"size: {size} has the prime factor {max(prime_factors(size))}, and K = prod(levels_per_dim)"
                            f": choose a size with small factors (e.g. 512, 1000, 4096) or give levels_per_dim")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            problems.append(f"temperature: a finite number > 0, got {t!r}")
        if not _is_int(self.levels) or self.levels < 1:
            problems.append(f"levels: at least 1 code level, got {self.levels!r}")
        if not _is_int(self.beam) or self.beam < 1:
            problems.append(f"beam: a beam width >= 1, got {self.beam!r}")
        return problems

    def resolved_levels(self) -> tuple[int, ...]:
        """Levels per dimension of a valid config (see the module's docstring)."""
        if self.levels_per_dim is not None:
            return tuple(int(x) for x in self.levels_per_dim)
        return tuple(grid_for_size(self.size)) if self.size else DEFAULT_LEVELS


class FSQVocabulary(Vocabulary, nn.Module):
    Config = FSQVocabConfig

    def __init__(self, config: FSQVocabConfig, ctx):
        super().__init__()
        problems = config.validate()  # (again: the planner-executor sets `size` per type after the build check)
        if problems:
            raise ConfigError([f"vocabulary.{p}" for p in problems])
        self.config = config
        self.levels_per_dim = config.resolved_levels()
        self.size = math.prod(self.levels_per_dim)  # K
        self.levels = config.levels
        self.dim = d = len(self.levels_per_dim)
        width = ctx.hidden_size
        radix = torch.tensor(self.levels_per_dim)
        strides = torch.tensor([math.prod(self.levels_per_dim[i + 1:]) for i in range(d)])
        grid = torch.zeros(d, max(self.levels_per_dim))  # row i: dimension i's levels (padded with zeros)
        for i, n in enumerate(self.levels_per_dim):
            grid[i, :n] = torch.linspace(-1.0, 1.0, n)
        # fixed, derived from the config: buffers outside the state dict (never trained, saved or perturbed)
        self.register_buffer("radix", radix, persistent=False)
        self.register_buffer("strides", strides, persistent=False)
        self.register_buffer("grid", grid, persistent=False)
        self.register_buffer("table", grid[torch.arange(d), self.digits(torch.arange(self.size))], persistent=False)
        self.proj_down = nn.Linear(width, d, bias=False)
        nn.init.normal_(self.proj_down.weight, std=width ** -0.5)  # rms-normed input: pre-tanh std ~1
        self.proj_up = nn.Linear(d, width, bias=False)
        self.level_embed = nn.Parameter(torch.zeros(config.levels, width)) if config.levels > 1 else None
        self.null = nn.Linear(width, 1) if ctx.uses_null_class else None
        if self.null is not None:
            nn.init.normal_(self.null.weight, std=width ** -0.5)
            nn.init.zeros_(self.null.bias)

    def init_from_backbone(self, token_embedding: torch.Tensor) -> None:
        """Inputs start at the scale of the backbone's token embeddings: proj_up maps the table's rows (of rms
        norm r over the K codes) to rows of the embeddings' mean norm."""
        target = float(token_embedding.float().norm(dim=-1).mean())
        r = float(self.table.float().pow(2).sum(-1).mean().sqrt())
        with torch.no_grad():
            self.proj_up.weight.normal_(0.0, target / r / self.proj_up.out_features ** 0.5)

    # -- ids <-> digits ------------------------------------------------------------------------
    def digits(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., d] the per-dimension level indices of ids [...] (mixed radix, dimension 0 most significant)."""
        return torch.div(ids[..., None], self.strides, rounding_mode="floor") % self.radix

    def ids(self, digits: torch.Tensor) -> torch.Tensor:
        """[...] the ids of per-dimension level indices [..., d]."""
        return (digits * self.strides).sum(-1)

    def values(self, digits: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """[..., d] the grid values (in [-1, 1]) of level indices, computed in ``dtype``."""
        return digits.to(dtype) * (2.0 / (self.radix - 1).to(dtype)) - 1.0

    def bounded(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] z = tanh(proj_down(rms_norm(h))), in at least float32."""
        return upcast(self.proj_down(rms_normalize(h))).tanh()

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """[...] FSQ's rounding of ``z`` [..., d] to the nearest grid level per dimension, as ids."""
        half = (self.radix - 1).to(z.dtype) / 2
        return self.ids(torch.minimum(torch.maximum(torch.round((z + 1) * half), torch.zeros_like(half)), 2 * half).long())

    # -- the Vocabulary interface ----------------------------------------------------------------
    def logits(self, h: torch.Tensor, level=0, before: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the K codes (+ the NULL logit), per dimension log-probabilities of the levels, summed.
        ``before`` [..., l]: the codes of levels 0..l-1 for the same state (streaming multi-level codes); the
        query is then the residual they left, rescaled (residual FSQ). Without it every level reads the plain
        projection (the planner-executor's levels each have their own state), so ``level`` changes nothing."""
        z = self.bounded(h)
        n = 0 if before is None else before.shape[-1]
        if n:
            scale = (self.radix - 1).to(z.dtype).reciprocal()  # level j's cell: (L_i - 1) ** -j of level 0's
            for j in range(n):
                z = z - scale ** j * self.values(self.digits(before[..., j]), z.dtype)
            z = z / scale ** n
        u = (z + 1) * ((self.radix - 1).to(z.dtype) / 2)  # in grid steps
        out = None
        for i, n_levels in enumerate(self.levels_per_dim):
            steps = torch.arange(n_levels, device=z.device, dtype=z.dtype)
            term = torch.log_softmax(-(u[..., i, None] - steps).square() / self.config.temperature, dim=-1)
            out = term if out is None else (out[..., :, None] + term[..., None, :]).flatten(-2)  # mixed radix
        logits = out.to(h.dtype)
        if self.null is not None:
            logits = torch.cat([logits, self.null(rms_normalize(h))], dim=-1)
        return logits

    def _level_row(self, level):
        return self.level_embed[level] if self.level_embed is not None else None

    def embed_hard(self, ids: torch.Tensor, level=0) -> torch.Tensor:
        e = self.proj_up(self.table[ids])
        row = self._level_row(level)
        return e if row is None else e + row

    def embed_soft(self, probs: torch.Tensor, level=0) -> torch.Tensor:
        """probs: [..., K] weights over codes; linear in them (the mixture of the codes' embeddings)."""
        e = self.proj_up(probs.to(self.table.dtype) @ self.table)
        row = self._level_row(level)
        return e if row is None else e + probs.sum(-1, keepdim=True).to(row.dtype) * row
