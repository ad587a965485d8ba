"""The planner-executor family (docs/planner_executor.md), readable top to bottom.

One backbone with one set of LoRA adapters plays two parts:

    planner:   [u, <PLAN>] --backbone--> for each concept type i in order: concepts of vocabulary i,
               one per step, ended by <EOS_i> (at most max_len_i concepts), sampled (Gumbel-ST in
               training, the eval sampler at inference) with a KV cache
    executor:  [<SEP_1>, C_1, <SEP_2>, C_2, ..., <SEP_n>, C_n] + y --backbone--> next-token logits of y

The executor never sees ``u``: its only input besides ``y`` is the plan. Gradients of the executor's
loss reach the planner through the straight-through concept embeddings
(``e = e_hard + e_soft - sg(e_soft)``).

Token layout. The unified vocabulary is the base vocabulary (ids ``0..V-1``), then for each type i
its ``K_i`` concept ids followed by ``<EOS_i>``, then ``<PLAN>`` and ``<SEP_1..n>``
(:class:`TokenLayout`). An input embedding is the token's embedding plus its type's embedding
(``per-type`` position scheme: row 0 text, row i concept type i; ``<SEP_i>`` and ``<EOS_i>`` are of
type i, ``<PLAN>`` of text). One output head: the base LM head for text, and for type i the type's
vocabulary head whose extra (NULL) class is ``<EOS_i>``; logits are restricted to what the phase
allows (``unified_logits``): type i's concepts and ``<EOS_i>`` while planning type i, the base
vocabulary while executing.

Positions. The planner continues the text's positions (``<PLAN>`` at ``|u|``, the plan after it),
as an LM continuing its prompt. The executor restarts every type at 1 under one shared RoPE:
``<SEP_i>`` at 0, type i's concepts at 1, 2, ...; the text ``y_k`` at ``k + 1``.

Batches. Plans differ in length between rows: the planner runs until every row has ended its last
type (a finished row's steps are masked out of every later key), and the executor right-aligns the
plan blocks (left padding) so that every row's text starts in the same column.

The plan steps' heads and embeddings are ``concept.planner.steps``'s part, the executor
``concept.planner.execution``'s; this module holds the model, the planner and the forward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import packing
from ..attention import CausalPattern
from ..backbone import decoder, run_layers
from ..codes import CodeUse
from ..components import BuildContext
from ..errors import ConceptError
from ..generation import GenerationMixin
from ..hub import HubMixin
from ..kv_cache import DecodePattern
from ..lazy import Deferred, LazyField
from ..losses import IGNORE, head_cross_entropy
from ..mtp import MTPHeads
from ..resolved import Resolved
from ..syncs import declared
from .execution import Execution
from .steps import PlanSteps

PLANNER_HEAD_INIT_SCALE = 1.0  # the typed vocabularies' head init (``embedding``), unless --set vocabulary.head_init_scale
DEFAULT_TYPES = ({"name": "topic", "size": 512, "max_len": 8}, {"name": "gist", "size": 2048, "max_len": 32})


# -- settings ------------------------------------------------------------------------------------
@dataclass
class PlanType:
    name: str
    size: int  # K_i concept ids
    max_len: int  # at most this many concepts of the type per plan


@dataclass
class PlannerSettings:
    """``concept build --family planner-executor --set planner.KEY=VALUE``."""

    types: list[PlanType] = field(default_factory=lambda: [PlanType(**t) for t in DEFAULT_TYPES])
    budget: float | None = None  # total plan tokens per example the quota aims for (default: half of sum max_len)
    quota_ki: float = 0.2  # the quota controller's integral gain on the <EOS> bias (per step, at 100% over budget)
    parallel: bool = False  # plan every type at once, each independent of the others given u
    mtp: int = 1  # concept tokens the planner writes per forward (MTP heads; 1: one, the plain planner)
    # what the quota controller holds: the total plan length (one <EOS> bias) or each type's share of the budget
    # (one bias per type: no type can end itself early to escape a usage term)
    quota: str = "total"

    KEYS = ("types", "budget", "quota_ki", "parallel", "mtp", "quota")
    QUOTAS = ("total", "per-type")

    @property
    def max_plan_steps(self) -> int:
        """Steps of the longest plan there can be: every type's ``max_len`` concepts and its ``<EOS>``."""
        return sum(t.max_len + 1 for t in self.types)

    @property
    def max_chain_steps(self) -> int:
        """Steps of the longest chain of parallel types: one type's ``max_len`` concepts and its ``<EOS>``."""
        return max(t.max_len + 1 for t in self.types)

    @property
    def target(self) -> float:
        return float(self.budget) if self.budget is not None else sum(t.max_len for t in self.types) / 2

    @property
    def type_targets(self) -> list[float]:
        """Each type's share of the budget, in proportion to its ``max_len`` (what ``quota: per-type`` holds)."""
        total = sum(t.max_len for t in self.types)
        return [self.target * t.max_len / total for t in self.types]

    def to_dict(self) -> dict:
        return {"types": [dataclasses.asdict(t) for t in self.types], "budget": self.budget, "quota_ki": self.quota_ki,
                "parallel": self.parallel, "mtp": self.mtp, "quota": self.quota, "target": self.target}

    @classmethod
    def parse(cls, params: dict) -> tuple["PlannerSettings | None", list[str]]:
        """Validate ``planner`` options all at once: (settings or None, problems)."""
        problems = [f"planner.{k}: unknown option (known: {', '.join(cls.KEYS)})" for k in params if k not in cls.KEYS]
        raw = params.get("types", list(DEFAULT_TYPES))
        types: list[PlanType] = []
        if not isinstance(raw, list) or not raw:
            problems.append(f"planner.types: a non-empty list of types, each {{\"name\": ..., \"size\": K, "
                            f"\"max_len\": N}}, got {raw!r}")
            raw = []
        seen = set()
        for i, t in enumerate(raw):
            where = f"planner.types[{i}]"
            if not isinstance(t, dict) or set(t) - {"name", "size", "max_len"} or "name" not in t:
                problems.append(f"{where}: expected {{\"name\": str, \"size\": int >= 2, \"max_len\": int >= 1}}, got {t!r}")
                continue
            name, size, max_len = t["name"], t.get("size", 512), t.get("max_len", 8)
            if not isinstance(name, str) or not name:
                problems.append(f"{where}.name: a non-empty string, got {name!r}")
            elif name in seen:
                problems.append(f"{where}.name: duplicate type name {name!r}; every type needs its own name")
            seen.add(name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 2:
                problems.append(f"{where}.size: a vocabulary needs at least 2 concept ids, got {size!r}")
            if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
                problems.append(f"{where}.max_len: at least 1 concept per type, got {max_len!r}")
            types.append(PlanType(str(name), size, max_len) if not problems else PlanType("?", 2, 1))
        budget, ki = params.get("budget"), params.get("quota_ki", 0.2)
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0):
            problems.append(f"planner.budget: plan tokens per example, > 0, got {budget!r}")
        elif budget is not None and types and budget > sum(t.max_len for t in types):
            problems.append(f"planner.budget: {budget} is above the longest possible plan "
                            f"({sum(t.max_len for t in types)} = the sum of max_len)")
        if not isinstance(ki, (int, float)) or isinstance(ki, bool) or ki < 0:
            problems.append(f"planner.quota_ki: must be >= 0, got {ki!r}")
        quota = params.get("quota", "total")
        if quota not in cls.QUOTAS:
            problems.append(f"planner.quota: {' or '.join(cls.QUOTAS)} (hold the total plan length, or each type's "
                            f"share of the budget), got {quota!r}")
        parallel, mtp = params.get("parallel", False), params.get("mtp", 1)
        if not isinstance(parallel, bool):
            problems.append(f"planner.parallel: true or false, got {parallel!r}")
        if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 1:
            problems.append(f"planner.mtp: the planner writes k >= 1 concept tokens per forward, got {mtp!r}")
        elif mtp > 1 and parallel is True:
            problems.append("planner.mtp with planner.parallel: MTP heads and parallel types do not combine yet; "
                            "choose one")
        if problems:
            return None, problems
        return cls(types=types, budget=budget, quota_ki=float(ki), parallel=parallel, mtp=mtp, quota=quota), []


@dataclass
class TokenLayout:
    """The unified vocabulary: base ids, then per type its concept ids and <EOS_i>, then <PLAN>, <SEP_i>."""

    base: int
    sizes: tuple[int, ...]

    def offset(self, i: int) -> int:
        return self.base + sum(k + 1 for k in self.sizes[:i])

    def concept_id(self, i: int, local: int) -> int:
        return self.offset(i) + local

    def eos_id(self, i: int) -> int:
        return self.offset(i) + self.sizes[i]

    @property
    def plan_id(self) -> int:
        return self.offset(len(self.sizes))

    def sep_id(self, i: int) -> int:
        return self.plan_id + 1 + i

    @property
    def output_size(self) -> int:  # base + every type's concepts and <EOS_i>
        return self.plan_id

    @property
    def size(self) -> int:
        return self.plan_id + 1 + len(self.sizes)


# -- outputs -------------------------------------------------------------------------------------
STEP_FIELDS = ("classes", "types", "active", "rank", "is_eos")  # a plan's per-step fields (logits aside)


def after_end(field: str) -> int:
    """What a plan's ``field`` holds after its end: -1 for classes and types, 0 (False) for the rest (logits: 0,
    finite like the planner's)."""
    return -1 if field in ("classes", "types") else 0


@dataclass
class Plan:
    """A batch of plans, step by step as the planner wrote them (a step is a concept or an <EOS_i>)."""

    classes: torch.Tensor  # [B, S] class inside the step's type: 0..K_t-1 a concept, K_t its <EOS>; -1 after the end
    types: torch.Tensor  # [B, S] the step's type index (-1 after the end)
    active: torch.Tensor  # [B, S] bool: the step exists (a prefix of each row)
    rank: torch.Tensor  # [B, S] a concept's 1-based place in its type's block (0 for <EOS>)
    is_eos: torch.Tensor  # [B, S] bool
    logits: torch.Tensor | None = None  # [B, S, Kmax+1] the planner's logits over its type (EOS at K_t, -inf beyond;
    # before max_len forces an <EOS>)
    embeds: torch.Tensor | None = None  # [B, S, d] the steps' input embeddings (straight-through while training)
    soft: torch.Tensor | None = None  # [B, S, d] e_soft, the sampler's probability-weighted embedding (training)
    hard: torch.Tensor | None = None  # [B, S, d] e_hard, the chosen token's embedding (training)
    forced: torch.Tensor | None = None  # [B, S] bool: <EOS> forced by max_len
    hidden: torch.Tensor | None = None  # [B, S, d] the state whose head predicted the step
    head: torch.Tensor | None = None  # [B, S] which head wrote the step: 0 the next-step head, j > 0 MTP head j

    @property
    def concepts(self) -> torch.Tensor:
        return self.active & ~self.is_eos

    def lengths(self, num_types: int) -> torch.Tensor:
        """[B, n] concepts per type."""
        types = torch.arange(num_types, device=self.types.device)  # (F.one_hot reads its input's range back)
        onehot = (self.types.clamp(min=0)[..., None] == types) & self.concepts[..., None]
        return onehot.long().sum(1)

    def before(self, num_types: int) -> torch.Tensor:
        """[B, S] concepts of the step's type written before the step."""
        types = self.types.clamp(min=0)
        return torch.where(self.is_eos, self.lengths(num_types).gather(1, types), (self.rank - 1).clamp(min=0))

    def rows(self) -> list[list[tuple[int, int]]]:
        """Per row: the (type, concept id) of every concept, in order."""
        return [[(t, c) for t, c, keep in zip(ts, cs, ks) if keep]
                for ts, cs, ks in zip(self.types.tolist(), self.classes.tolist(), self.concepts.tolist())]

    def select(self, rows: torch.Tensor) -> "Plan":
        """The plans of ``rows`` (e.g. a permutation: the shuffled-plan control)."""
        return Plan(**{f.name: (v[rows] if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                       for f in dataclasses.fields(self)})

    def split_types(self, n: int, width: int | None = None) -> "Plan":
        """One chain per type: row ``b * n + i`` holds row b's type-i steps (its concepts and <EOS_i>), from
        step 0 (step indices only), ``width`` steps (default the plan's own: no chain is longer). The inverse of
        :meth:`join_types`. Fixed shapes: each type's steps moved to the front by a stable sort, nothing read."""
        B, S = self.classes.shape
        width = S if width is None else width
        if width > S:
            return self.padded(width).split_types(n, width)
        types = self.types.clamp(min=0)
        mine = self.active[:, None, :] & (types[:, None, :] == torch.arange(n, device=types.device)[None, :, None])
        order = torch.sort((~mine).to(torch.uint8), dim=2, stable=True).indices[..., :width]  # [B, n, width]
        kept = mine.gather(2, order)
        out = {}
        for k in STEP_FIELDS:
            t = getattr(self, k)[:, None, :].expand(B, n, S).gather(2, order)
            out[k] = torch.where(kept, t, torch.full_like(t, after_end(k))).view(B * n, width)
        return Plan(**out)

    def join_types(self, n: int, width: int) -> "Plan":
        """Rows of ``n`` chains (row ``b * n + i``: type i's steps of row b) joined type by type into one
        plan per row, every tensor field carried (differentiably: the straight-through embeddings), ``width``
        steps wide (at least the longest joined plan's: e.g. a teacher-forced plan's own, or ``n`` times the
        chains' width), their steps moved to the front by a stable sort, padding after: fixed shapes, nothing
        read."""
        Bn, S = self.classes.shape
        B = Bn // n
        active = self.active.view(B, n * S)
        order = torch.sort((~active).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        kept, extra = active.gather(1, order), width - order.shape[1]
        out = dict.fromkeys(f.name for f in dataclasses.fields(self))
        for name, t, fill in self._set_fields():
            t = t.reshape(B, n * S, *t.shape[2:])
            index = order.view(*order.shape, *[1] * (t.dim() - 2)).expand(*order.shape, *t.shape[2:])
            mask = kept.view(*kept.shape, *[1] * (t.dim() - 2))
            t = torch.where(mask, t.gather(1, index), torch.full_like(t[:, :1], fill))
            out[name] = torch.cat([t, t.new_full((B, extra, *t.shape[2:]), fill)], 1) if extra > 0 else t
        return Plan(**out)

    def _set_fields(self):
        """(name, tensor, :func:`after_end` fill) of each field that is set."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                yield f.name, getattr(self, f.name), after_end(f.name)

    @staticmethod
    def steps_of(row: list[tuple[int, int]], sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """One plan's steps (type, class, rank) from its (type, concept id) list in type order (<EOS> steps added):
        host values, e.g. for :meth:`from_rows` or an upload."""
        n = len(sizes)
        if any(b[0] < a[0] for a, b in zip(row, row[1:])) or any(not 0 <= t < n or not 0 <= c < sizes[t] for t, c in row):
            raise ValueError(f"a plan lists its concepts type by type, with ids inside each type's vocabulary: {row}")
        seq = []
        for t in range(n):
            mine = [c for tt, c in row if tt == t]
            seq += [(t, c, r + 1) for r, c in enumerate(mine)] + [(t, sizes[t], 0)]
        return seq

    @classmethod
    def from_steps(cls, classes: torch.Tensor, types: torch.Tensor, rank: torch.Tensor, sizes: torch.Tensor) -> "Plan":
        """Plans from their steps' classes, types and ranks (-1, -1, 0 after the end), ``sizes`` the types'
        vocabulary sizes on their device (the model's ``sizes`` buffer): nothing read back."""
        active = classes >= 0
        return cls(classes, types, active, rank, active & (classes == sizes[types.clamp(min=0)]))

    def padded(self, width: int) -> "Plan":
        """The steps' fields (classes .. is_eos) padded after the end to ``width`` steps (a fixed shape)."""
        return Plan(**{k: F.pad(getattr(self, k), (0, width - self.classes.shape[1]), value=after_end(k))
                       for k in STEP_FIELDS})

    @classmethod
    def from_rows(cls, rows: list[list[tuple[int, int]]], sizes: tuple[int, ...], device=None) -> "Plan":
        """Plans from per-row (type, concept id) lists in type order (<EOS> steps added)."""
        steps = [cls.steps_of(row, sizes) for row in rows]
        S = max(len(s) for s in steps)
        classes = torch.full((len(rows), S), -1, dtype=torch.long)
        types, rank = classes.clone(), torch.zeros_like(classes)
        for b, seq in enumerate(steps):
            for j, (t, c, r) in enumerate(seq):
                classes[b, j], types[b, j], rank[b, j] = c, t, r
        active = classes >= 0
        is_eos = active & (classes == torch.tensor(sizes)[types.clamp(min=0)])
        return cls(classes.to(device), types.to(device), active.to(device), rank.to(device), is_eos.to(device))


@dataclass
class PlannedOutput:
    logits: torch.Tensor = LazyField()  # [B, Ty, V] logits[:, k] predicts y_k (computed when first read)
    plan: Plan
    loss: torch.Tensor | None = None  # mean CE over the real tokens of y
    y: torch.Tensor | None = None  # [B, Ty] the text the executor was trained / scored on
    y_valid: torch.Tensor | None = None
    u_valid: torch.Tensor | None = None


# -- the model -----------------------------------------------------------------------------------
class PlanSpecials(nn.Module):
    """Input embeddings of <PLAN>, <SEP_1..n> and <EOS_1..n> (rows 0, 1..n, n+1..2n)."""

    def __init__(self, num_types: int, hidden_size: int):
        super().__init__()
        self.num_types = num_types
        self.table = nn.Embedding(1 + 2 * num_types, hidden_size)

    def init_from_backbone(self, token_embedding: torch.Tensor) -> None:
        with torch.no_grad():
            self.table.weight.normal_(0.0, float(token_embedding.float().std()))

    def plan(self) -> torch.Tensor:
        return self.table.weight[0]

    def sep(self, types: torch.Tensor) -> torch.Tensor:
        return self.table(1 + types)

    def eos(self, types: torch.Tensor) -> torch.Tensor:
        return self.table(1 + self.num_types + types)


class EOSBias(nn.Module):
    """The bias the ``PlannerQuotaController`` adds to every <EOS_i> logit (a buffer: moved by the
    controller, not by gradients; saved with the run so inference plans as training ended): one value for
    every type, or with ``num_types`` (``quota: per-type``) one per type."""

    def __init__(self, num_types: int | None = None):
        super().__init__()
        self.register_buffer("value", torch.zeros(()) if num_types is None else torch.zeros(num_types))

    def of(self, i: int) -> torch.Tensor:
        """Type i's bias."""
        return self.value if self.value.dim() == 0 else self.value[i]

    def describe(self) -> float | list[float]:
        return float(self.value) if self.value.dim() == 0 else [float(v) for v in self.value]


def plan_ended(done: torch.Tensor) -> bool:
    """Whether every row's plan has ended: the host ends the planner's step loop (a declared host sync per
    planner forward; the plans' lengths are data)."""
    with declared("plan end check"):
        return bool(done.all())


class PlannerExecutorModel(PlanSteps, Execution, Resolved, GenerationMixin, HubMixin, nn.Module):
    family = "planner-executor"

    def __init__(self, backbone, settings: PlannerSettings, vocabularies, sampler, eval_sampler, positions,
                 specials: PlanSpecials, resolution=None, tokenizer=None):
        super().__init__()
        self.backbone = backbone  # HF *ForCausalLM, frozen (LoRA when training)
        self.settings = settings
        self.vocabularies = nn.ModuleList(vocabularies)  # one per type; its NULL class is <EOS_i>
        self.sampler, self.eval_sampler = sampler, eval_sampler
        self.positions = positions  # `per-type`
        self.specials = specials
        self.eos_bias = EOSBias(len(settings.types) if settings.quota == "per-type" else None)
        # MTP concepts: head j > 0 writes the step j after the next from the same state (concept.mtp's residual
        # blocks, zero at init: every head starts as the next-step head)
        self.mtp_heads = MTPHeads(backbone.config.hidden_size, settings.mtp - 1) if settings.mtp > 1 else None
        self.resolution = resolution  # the build resolution (concept.resolved)
        self.tokenizer = tokenizer
        self.layout = TokenLayout(backbone.config.vocab_size, tuple(t.size for t in settings.types))
        self.gradient_checkpointing = False
        self.task, self.context_len = "reconstruct", None  # set by the trainer / a trained run's train.json
        sizes = torch.tensor([t.size for t in settings.types])
        self.register_buffer("sizes", sizes, persistent=False)
        self.register_buffer("max_lens", torch.tensor([t.max_len for t in settings.types]), persistent=False)
        levels = [v.levels for v in vocabularies]  # multi-level codes: code tokens per concept
        self.register_buffer("levels", torch.tensor(levels), persistent=False)
        self.multilevel = max(levels) > 1

    @property
    def num_types(self) -> int:
        return len(self.settings.types)

    @property
    def inner(self) -> nn.Module:
        return decoder(self.backbone)

    @property
    def plan_positions(self) -> int:
        """Positions the planner fills after the context: ``<PLAN>``, then at most ``max_len`` concepts and
        an ``<EOS>`` a type (with parallel types, each chain holds one type's steps)."""
        settings = self.settings
        return 1 + (settings.max_chain_steps if settings.parallel else settings.max_plan_steps)

    # -- pieces ------------------------------------------------------------------------------
    @property
    def stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype, the token embeddings' (bf16 with a bf16-stored base), as a dense model's."""
        return self.inner.embed_tokens.weight.dtype

    def run(self, x, position_ids, attention_plan, cache=None):
        """The backbone's layers on ``x``, which joins the residual stream here, cast to :attr:`stream_dtype`:
        the one join point of the inputs that trainable fp32 modules make (the step embeddings, ``<PLAN>`` /
        ``<SEP_i>``, the type rows) in every part the backbone plays (a no-op in fp32)."""
        return run_layers(self.inner.layers, x.to(self.stream_dtype), position_ids, attention_plan,
                          self.inner.rotary_emb, self.gradient_checkpointing and self.training and cache is None,
                          cache)

    def embed_text(self, ids):
        return self.positions.add_types(self.inner.embed_tokens(ids), torch.zeros_like(ids))

    def text_logits(self, h):
        return self.backbone.lm_head(self.inner.norm(h))

    # -- planner -------------------------------------------------------------------------------
    def planner(self, u_ids, u_valid, teacher: Plan | None = None, cache=None, sample: bool | None = None) -> Plan:
        """Write a plan for each row of ``u`` (one step per forward, with a KV cache). ``teacher``: feed
        this plan instead of sampling (teacher forcing: the logits are those the planner gives it).
        ``sample``: draw with the training sampler (default: while training); else the eval sampler.
        ``cache``: a transformers ``DynamicCache`` to fill (default: a fresh one).

        With parallel types (``planner.parallel``) every type is planned at once: each row becomes one
        chain per type (``[u, <PLAN>]`` then that type's steps only, its own positions), all chains advance
        in the same forward, and the chains are joined type by type into the row's plan."""
        if self.settings.parallel:
            if teacher is not None:
                return self.planner_forced(u_ids, u_valid, teacher)
            chains = self._steps(u_ids, u_valid, None, cache, sample, chains=self.num_types)
            # as wide as the joined plans can be: every chain full, or every type's max_len + <EOS> (nothing read)
            width = min(self.num_types * chains.classes.shape[1], self.settings.max_plan_steps)
            return chains.join_types(self.num_types, width)
        return self._steps(u_ids, u_valid, teacher, cache, sample)

    def prefix(self, u_ids, u_valid, cache, chains: int = 0):
        """Run ``[u, <PLAN>]`` into ``cache`` (a ``DynamicCache``): the state that predicts the first step, the
        key mask, the next position, and each row's first and last type to plan. ``chains`` > 0: every row
        then becomes ``chains`` rows (row-major, the cache repeated), row ``b * chains + i`` planning type i
        alone (parallel types). Returns (h [B', d], keys [B', L], next_pos [B'], first [B'], last [B'])."""
        B, dev = u_ids.shape[0], u_ids.device
        x = torch.cat([self.embed_text(u_ids), self.specials.plan().expand(B, 1, -1)], 1)  # (joined in ``run``)
        keys = torch.cat([u_valid, u_valid.new_ones(B, 1)], dim=1)
        pos = packing.time_positions(keys)
        h = self.run(x, pos, CausalPattern(keys, causal=False), cache)[:, -1]  # (the mask built without looking)
        next_pos = pos[:, -1] + 1
        first = torch.zeros(B, dtype=torch.long, device=dev)
        last = torch.full_like(first, self.num_types - 1)  # a row is done once it ends this type
        if chains:
            h, keys, next_pos = (t.repeat_interleave(chains, 0) for t in (h, keys, next_pos))
            cache.batch_repeat_interleave(chains)
            first = last = torch.arange(chains, device=dev).repeat(B)
        return h, keys, next_pos, first, last

    def _steps(self, u_ids, u_valid, teacher: Plan | None, cache, sample: bool | None, chains: int = 0) -> Plan:
        """The step-by-step planner (``chains``: see :meth:`prefix`)."""
        from transformers import DynamicCache

        sample = self.training if sample is None else sample
        sampler = self.sampler if sample else self.eval_sampler
        straight_through = sample and torch.is_grad_enabled() and sampler.straight_through
        cache = DynamicCache() if cache is None else cache
        h, keys, next_pos, cur, last = self.prefix(u_ids, u_valid, cache, chains)
        B, dev, n = h.shape[0], h.device, self.num_types
        count = torch.zeros_like(cur)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        rec = {k: [] for k in ("classes", "types", "active", "rank", "is_eos", "logits", "embeds", "soft", "hard",
                               "forced", "hidden", "head")}
        max_steps = self.settings.max_plan_steps if teacher is None else teacher.classes.shape[1]
        heads = self.settings.mtp if teacher is None else 1  # steps written per forward (MTP concepts)
        step = 0
        while step < max_steps:
            group, fed = [], []
            for j in range(heads):  # head j writes step `step` (j = 0: the plain next-step head)
                if j and (step >= max_steps or plan_ended(done)):
                    break
                state = h if j == 0 else self.mtp_heads.state(h, j - 1)
                active = ~done
                types = torch.where(active, cur, torch.full_like(cur, -1))
                logits = self.plan_logits(state, cur.clamp(max=n - 1), count)
                K = self.sizes[cur.clamp(max=n - 1)]
                forced = active & (count >= self.max_lens[cur.clamp(max=n - 1)])
                concept_cols = torch.arange(logits.shape[-1], device=dev)[None, :] < K[:, None]
                probs = sampler(logits.masked_fill(forced[:, None] & concept_cols, float("-inf")))
                classes = probs.argmax(-1) if teacher is None else teacher.classes[:, step].clamp(min=0)
                classes = torch.where(active, classes, torch.full_like(classes, -1))
                is_eos = active & (classes == K)
                rank = torch.where(active & ~is_eos, count + 1, torch.zeros_like(count))
                e, soft, hard = self.step_embedding(classes, types, probs if straight_through else None, rank)
                for k, v in (("classes", classes), ("types", types), ("active", active), ("is_eos", is_eos),
                             ("rank", rank),
                             ("logits", logits), ("embeds", e), ("soft", soft),
                             ("hard", hard if straight_through else None), ("forced", forced), ("hidden", state),
                             ("head", torch.full_like(count, j))):
                    rec[k].append(v)
                count = torch.where(is_eos, torch.zeros_like(count), count + active.long())
                cur = cur + is_eos.long()
                done = done | (cur > last)
                group.append(e)
                fed.append(active)
                step += 1
            if plan_ended(done):
                break
            h, keys, next_pos = self.feed(group, fed, keys, next_pos, cache)
        stacked = {k: (torch.stack(v, 1) if v and v[0] is not None else None) for k, v in rec.items()}
        return Plan(**stacked)

    def feed(self, group, fed, keys, next_pos, cache):
        """Run a group of planner steps (``group``: step embeddings [B, d] each, ``fed``: which rows took
        each step) in one forward into ``cache``, causal among themselves (a step a row did not take is
        no key). Returns (the state after the group's last step [B, d], the key mask, the next position)."""
        g, new = len(group), torch.stack(fed, 1)
        own = torch.ones(g, g, dtype=torch.bool, device=new.device).tril()[None] & new[:, None, :]
        mask = torch.cat([keys[:, None, :].expand(-1, g, -1), own], dim=-1)
        positions = next_pos[:, None] + torch.arange(g, device=new.device)
        h = self.run(torch.stack(group, 1), positions, DecodePattern(mask), cache)[:, -1]
        return h, torch.cat([keys, new], dim=1), next_pos + g

    def planner_forced(self, u_ids, u_valid, plan: Plan) -> Plan:
        """Teacher forcing of the planner in one forward: the planner's logits for every step of ``plan``
        (those :meth:`planner` gives when fed ``plan`` step by step), its states and the plan's hard step
        embeddings. The sequence is ``[u, <PLAN>, step_0, ..., step_{S-2}]``: ``<PLAN>`` predicts step 0 and
        step j predicts step j + 1, under the causal mask over the real elements. With parallel types the
        plan is split into one chain per type (``Plan.split_types``), forced the same way, and joined."""
        if self.settings.parallel:
            n = self.num_types
            chains = plan.split_types(n, self.settings.max_chain_steps)  # (a fixed width)
            forced = self._forced(u_ids.repeat_interleave(n, 0), u_valid.repeat_interleave(n, 0), chains)
            return forced.join_types(n, plan.classes.shape[1])  # (the plan's own width: nothing read)
        return self._forced(u_ids, u_valid, plan)

    def _forced(self, u_ids, u_valid, plan: Plan) -> Plan:
        B, S = plan.classes.shape
        Lu = u_ids.shape[1]
        e, _, _ = self.step_embedding(plan.classes, plan.types, rank=plan.rank)
        x = torch.cat([self.embed_text(u_ids), self.specials.plan().expand(B, 1, -1), e[:, :-1]], 1)  # (``run``)
        valid = torch.cat([u_valid, u_valid.new_ones(B, 1), plan.active[:, :-1]], dim=1)
        plan_mask = CausalPattern(valid, causal=False)  # (built without looking: no host sync)
        h = self.run(x, packing.time_positions(valid), plan_mask)[:, Lu:]  # [B, S, d]: state before step j
        types = plan.types.clamp(min=0)
        before = plan.before(self.num_types)
        logits = self.plan_logits(h.flatten(0, 1), types.flatten(), before.flatten()).view(B, S, -1)
        forced = plan.active & (before >= self.max_lens[types])
        return dataclasses.replace(plan, logits=logits, embeds=e, hard=e, forced=forced, hidden=h, soft=None, head=None)

    # -- forward -------------------------------------------------------------------------------
    def split_example(self, input_ids, attention_mask=None):
        """(u, u_valid, y, y_valid) of the configured task: ``reconstruct`` (y = u, the whole row) or
        ``continue`` (u = the first ``context_len`` tokens, y = the rest)."""
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if self.task == "continue":
            c = int(self.context_len or 0)
            if not 0 < c < input_ids.shape[1]:

                raise ConceptError(f"this run was trained with --task continue --context-len {c}: rows of "
                                   f"{input_ids.shape[1]} tokens leave no text after the context; evaluate with "
                                   f"--seq-len > {c}")
            return input_ids[:, :c], valid[:, :c], input_ids[:, c:], valid[:, c:]
        return input_ids, valid, input_ids, valid

    def forward(self, input_ids, attention_mask=None, labels=None, document_ids=None, plan: Plan | None = None,
                **_) -> PlannedOutput:
        """Plan from u, execute y from the plan alone; ``loss`` is the CE of y (when ``labels`` is given).
        ``plan``: use this plan (the planner teacher-forced in one forward, :meth:`planner_forced`; the executor
        reads its hard embeddings, e.g. Hard-EM's M-step) instead of writing one. Rows are one text
        each: packed documents inside a row are read as one stream."""
        u, u_valid, y, y_valid = self.split_example(input_ids, attention_mask)
        plan = self.planner(u, u_valid) if plan is None else self.planner_forced(u, u_valid, plan)
        states, head = self.inner.norm(self.executor_states(plan, y, y_valid)), self.backbone.lm_head
        loss = None
        if labels is not None:  # text_loss(logits, y, y_valid) without the [B, Ty, V] logits
            loss = head_cross_entropy(states, head, y.masked_fill(~y_valid, IGNORE))
        return PlannedOutput(Deferred(head, states, watch=head), plan, loss, y, y_valid, u_valid)

    # -- anti-collapse (concept.codes) ----------------------------------------------------------
    def code_vocabularies(self) -> list[tuple[str, nn.Module]]:
        return [(t.name, v) for t, v in zip(self.settings.types, self.vocabularies)]

    def code_uses(self, out: PlannedOutput) -> list[CodeUse]:
        """The concepts of each type's plans, per code level, with the planner states their head read."""
        plan, uses = out.plan, []
        x = self.inner.norm(plan.hidden)
        level = self.level(plan.types, plan.before(self.num_types))
        for i, (t, vocab) in enumerate(zip(self.settings.types, self.vocabularies)):
            for l in range(vocab.levels):  # (a Python int: the ``levels`` buffer would be read back)
                mask = plan.concepts & (plan.types == i) & (level == l)
                uses.append(CodeUse(t.name if l == 0 else f"{t.name}@{l}", vocab, l, plan.classes.flatten(),
                                    x.flatten(0, -2), mask=mask.flatten()))  # (fixed shapes: no host sync)
        return uses

    # -- parameters ----------------------------------------------------------------------------
    def new_modules(self) -> dict[str, nn.Module]:
        modules = {"vocabularies": self.vocabularies, "specials": self.specials, "positions": self.positions,
                   "sampler": self.sampler, "eos_bias": self.eos_bias, "mtp_heads": self.mtp_heads}
        return {k: m for k, m in modules.items()
                if m is not None and (any(True for _ in m.parameters()) or any(True for _ in m.buffers()))}

    def new_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, m in self.new_modules().items() for k, v in m.state_dict().items()}


def text_loss(logits, y, y_valid, reduction: str = "mean"):
    """CE of y_k from logits[:, k] over the real tokens of y."""
    target = y.masked_fill(~y_valid, -100)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100, reduction=reduction)
    return loss if reduction == "mean" else loss.view(y.shape)


def build(plan, loaded) -> PlannerExecutorModel:
    """Wire a planner-executor from a resolved build plan and a loaded backbone (``concept.builder``)."""
    comps, info, settings = plan.components, loaded.info, plan.settings
    ctx = BuildContext(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_layers=info.num_layers,
                       split=plan.split, uses_null_class=True, num_types=len(settings.types))
    token_embedding = loaded.model.get_input_embeddings().weight
    vocab = comps["vocabulary"]
    vocabularies = []
    options = {"size": None}
    if "head_init_scale" in {f.name for f in dataclasses.fields(vocab.config)} and "head_init_scale" not in vocab.user_params:
        # the planner learns through its sampler's soft probabilities: start them spread (logits of std ~1), not
        # near one-hot as the streaming head's decisive default (8) would (the straight-through gradient ~ 0)
        options["head_init_scale"] = PLANNER_HEAD_INIT_SCALE
    for t in settings.types:  # the type's vocabulary: the `vocabulary` plugin at the type's size; NULL = <EOS_t>
        config = dataclasses.replace(vocab.config, **{**options, "size": t.size})
        v = vocab.cls(config, dataclasses.replace(ctx, concept_vocab_size=t.size))
        v.init_from_backbone(token_embedding)
        vocabularies.append(v)
    specials = PlanSpecials(len(settings.types), info.hidden_size)
    specials.init_from_backbone(token_embedding)
    model = PlannerExecutorModel(
        loaded.model, settings, vocabularies,
        sampler=comps["sampler"].cls(comps["sampler"].config, ctx),
        eval_sampler=comps["eval_sampler"].cls(comps["eval_sampler"].config, ctx),
        positions=comps["position_scheme"].cls(comps["position_scheme"].config, ctx),
        specials=specials, resolution=plan, tokenizer=loaded.tokenizer)
    return model


def describe_plan(model: PlannerExecutorModel, plan: Plan, row: int) -> list[dict[str, Any]]:
    """Row ``row``'s plan for people: per type, its name and concept ids (``concept generate --show-plan``)."""
    mine = plan.rows()[row]
    return [{"type": t.name, "ids": [c for tt, c in mine if tt == i]} for i, t in enumerate(model.settings.types)]
