"""Anti-collapse for learned concept vocabularies: dead-code revival and k-means initialisation.

A learned codebook collapses when a few codes win every state: the others are never chosen, so their rows
never receive a gradient and stay where they started (VQ-VAE's dead codes). Two standard remedies
(SoundStream, Jukebox), each a controller the trainer composes (``concept.objectives`` protocol, no loss term):

| name | what | option |
|---|---|---|
| ``code_revival`` | every N steps (the idle steps counted on the device at every step), each code no emitted concept has used for N steps or more is pointed at a query of this step's emitted concepts (one code per query, the longest idle first), logged as ``revived`` and ``idle_share`` | ``--revive-after N`` |
| ``kmeans_init`` | before the first step of a fresh run, the codes start at the spherical k-means centroids of the queries of the first B training batches' emitted concepts, logged as ``kmeans_codes`` | ``--kmeans-init B`` |

Where the states come from: a model with learned codes has ``code_uses(out) -> list[CodeUse]``, one entry per
(vocabulary, code level) with the ids its emitted concepts chose and the states the vocabulary's head read for
them (the streaming family: the shallow states of the tokens that emitted a concept; the planner-executor:
the planner's state at each concept of each type). A vocabulary that can be revived has

- ``query(states, before) -> [n, c]``: unit vectors in the space its head matches codes in (the codebook's
  cosine query, the embedding head's input direction), and
- ``set_codes(level, ids, directions)``: points those codes at unit directions at the typical norm of its rows.

``fsq`` has no code rows to die: its grid is fixed and every code is chosen whenever a state falls in its cell.

Revival is deterministic and the same on every process: the step's usage is summed over the processes, the
queries are gathered in rank order, and the queries that revive codes are drawn by a generator seeded by the
run's seed and the step. Its only state, each code's idle steps, is saved with every checkpoint, so a resumed
run revives exactly what an uninterrupted one does. The optimizer's moments of a revived row are left as they
are (Adam's update is bounded by the learning rate: a few steps wash them out).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .contracts import Revivable, Tempered
from .errors import ConfigError
from .objectives import Objective, TemperatureSchedule
from .syncs import declared, upload

QUERIES_PER_STEP = 512  # at most this many queries of each (vocabulary, level) kept per micro-batch for revival
KMEANS_ITERATIONS = 20


@dataclass
class CodeUse:
    """The concepts one (vocabulary, level) emitted in a forward: their ids [n] and the states [n, d] its head
    read (``before`` [n, l]: the codes of the levels below, for a vocabulary whose query depends on them).
    With ``mask`` [n], the tensors are every position's (fixed shapes: no boolean indexing, no host sync) and
    the emitted concepts are the positions of ``mask`` (:meth:`chosen` indexes them: a host sync)."""

    name: str  # e.g. "concept", or a planner type's name (with ``@level`` for levels > 0)
    vocabulary: torch.nn.Module
    level: int
    ids: torch.Tensor
    states: torch.Tensor
    before: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def chosen(self) -> CodeUse:
        """The emitted concepts alone (boolean indexing: a host sync, for a declared point)."""
        if self.mask is None:
            return self
        m = self.mask
        return CodeUse(self.name, self.vocabulary, self.level, self.ids[m], self.states[m],
                       None if self.before is None else self.before[m])

    def counts(self) -> torch.Tensor:
        """[K] float64 on the ids' device: how many emitted concepts chose each code (ids outside [0, K) are not
        counted, as ``bincount(ids, minlength=K)[:K]``); fixed shapes, no host sync."""
        K, ids = self.vocabulary.size, self.ids.detach().long()
        counted = (ids >= 0) & (ids < K)
        if self.mask is not None:
            counted = counted & self.mask
        return torch.zeros(K, dtype=torch.float64, device=ids.device).index_add_(0, ids.clamp(0, K - 1),
                                                                                  counted.double())

    def queries(self, limit: int | None = None) -> torch.Tensor:
        """[n, c] the vocabulary's queries of the emitted concepts' states (the first ``limit`` of them)."""
        use = self.chosen()
        before = None if use.before is None else use.before[:limit]
        return use.vocabulary.query(use.states[:limit], before).detach().float()


def other_rows(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``rows`` [K, ...] without the rows of ``ids`` (all of them when ``ids`` names every row): what a vocabulary
    matches the scale of the codes it re-points to (``set_codes``)."""
    keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    keep[ids] = False
    return rows[keep] if bool(keep.any()) else rows


def rms_row_norm(rows: torch.Tensor) -> torch.Tensor:
    """The root-mean-square norm of ``rows`` [n, c] (float32)."""
    return rows.float().pow(2).sum(-1).mean().sqrt()


def revivable(vocabulary) -> bool:
    return isinstance(vocabulary, Revivable)


def check(model, option: str) -> list[str]:
    """Problems with anti-collapse ``option`` on ``model`` (empty when its vocabularies can be revived)."""
    uses = getattr(model, "code_vocabularies", None)
    if uses is None:
        return [f"{option}: this model has no learned concept codes; drop it"]
    return [f"{option}: the {type(v).__name__} vocabulary{f' of {name!r}' if name else ''} has no code rows to "
            f"revive or initialise (fsq's grid is fixed and cannot collapse); drop {option}"
            for name, v in uses() if not revivable(v)]


def spherical_kmeans(x: torch.Tensor, k: int, generator: torch.Generator,
                     iterations: int = KMEANS_ITERATIONS) -> torch.Tensor:
    """[k, c] unit centroids of unit vectors ``x`` [n, c] (n >= k) by cosine similarity: k-means++ seeding
    (each next seed drawn with probability proportional to its distance 1 - cos to the nearest seed), then
    Lloyd iterations; a cluster that empties takes the point farthest from its centroid."""
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k-means of {n} points into {k} clusters: need 1 <= k <= n")
    centroids = x[torch.randint(n, (1,), generator=generator)]
    dist = (1 - x @ centroids.T).squeeze(-1).clamp_min(0)
    for _ in range(1, k):
        weights = dist if float(dist.sum()) > 0 else torch.ones_like(dist)
        pick = torch.multinomial(weights, 1, generator=generator)
        centroids = torch.cat([centroids, x[pick]])
        dist = torch.minimum(dist, (1 - x @ x[pick].T).squeeze(-1).clamp_min(0))
    for _ in range(iterations):
        sim = x @ centroids.T
        assign = sim.argmax(-1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        best = sim.gather(1, assign[:, None]).squeeze(-1)
        for j in (counts == 0).nonzero().flatten().tolist():  # an empty cluster takes the worst-fit point
            worst = int(best.argmin())
            sums[j], best[worst] = x[worst], 2.0
        centroids = F.normalize(sums, dim=-1)
    return centroids


class CodeRevival(Objective):
    """``--revive-after N``: codes no emitted concept used for N steps are pointed at the step's queries (see the
    module's docstring). Every step counts, on the device, each code's idle steps (nothing read back); every N-th
    step (steps N, 2N, ...) revives, on the host, the codes idle for N steps or more: one declared host sync
    (``code revival``), at most once per N steps. Logs ``revived`` (codes re-pointed this step, every vocabulary;
    0 between revival steps) and ``idle_share`` (the share of codes unused for N steps or more, before reviving
    them; a device value, read with the step's log)."""

    name = "code_revival"
    adds_term = False

    def __init__(self, after: int, seed: int):
        self.after, self.seed = after, seed
        # name -> [K] steps since the code was last emitted: on the device; restored (``load_state_dict``), the
        # checkpoint's ints until the first step uploads them
        self.idle: dict[str, torch.Tensor | list[int]] = {}
        self.dist = None
        self.step = 0
        self._used: dict[str, torch.Tensor] = {}
        self._uses: dict[str, list[CodeUse]] = {}
        self._targets: dict[str, CodeUse] = {}

    def revives(self, step: int) -> bool:
        """Whether the step after ``step`` steps (0-based: the step ``step + 1``) is a revival step."""
        return (step + 1) % self.after == 0

    def before_step(self, context) -> None:
        self.dist, self.step = context.dist, context.step
        self._used, self._uses, self._targets = {}, {}, {}

    def stats(self, model, batch, out) -> dict[str, float]:
        for use in model.code_uses(out):
            counts = use.counts()
            self._used[use.name] = counts + self._used[use.name] if use.name in self._used else counts
            kept = CodeUse(use.name, use.vocabulary, use.level, use.ids.detach(), use.states.detach(),
                           None if use.before is None else use.before.detach(), use.mask)
            if self.revives(self.step):  # (their queries are computed at the revival, in its declared point)
                self._uses.setdefault(use.name, []).append(kept)
            self._targets[use.name] = kept
        return {}

    def device_step(self, model, means, totals, skipped) -> dict:
        dist, idle_codes, codes = self.dist, 0, 0
        for name, use in sorted(self._targets.items()):  # the idle steps, on the device
            used = dist.sum_on_device(self._used[name]) if dist else self._used[name]
            idle = self.idle.get(name)
            if idle is None:
                idle = torch.zeros_like(used, dtype=torch.long)
            elif not isinstance(idle, torch.Tensor):  # restored: one pinned, non-blocking copy (a .to() would sync)
                idle = upload(idle, torch.long, used.device)
            idle = torch.where(skipped, idle, torch.where(used > 0, torch.zeros_like(idle), idle + 1))
            idle_codes, codes = idle_codes + (idle >= self.after).sum(), codes + use.vocabulary.size
            self.idle[name] = idle
        if not codes:
            return {}
        revived = 0
        if self.revives(self.step):
            with declared("code revival"):  # every N steps: the host picks the codes and the queries
                for i, (name, use) in enumerate(sorted(self._targets.items())):
                    self.idle[name], n = self._revive(i, name, use, self.idle[name], skipped)
                    revived += n
        return {"revived": revived, "idle_share": idle_codes.double() / codes}

    def _revive(self, i: int, name: str, use: CodeUse, idle: torch.Tensor, skipped: torch.Tensor):
        """Point the codes of ``name`` idle for N steps or more at this step's queries (the longest idle first,
        one code per query, ties in a seeded random order); returns (the idle counts, codes revived)."""
        device, idle = idle.device, idle.cpu()
        dead = (idle >= self.after).nonzero().flatten()
        if not len(dead) or bool(skipped):  # (the same on every process: ``used`` and ``idle`` are)
            return idle.to(device), 0
        local = [q for u in self._uses.get(name, []) if (q := u.queries(QUERIES_PER_STEP).cpu()).shape[0]]
        dist = self.dist
        gathered = dist.gather_objects(local) if dist else [local]  # every rank's, in rank order
        if not any(gathered):
            return idle.to(device), 0
        queries = torch.cat([q for qs in gathered for q in qs])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step * 101 + i)
        order = dead[torch.randperm(len(dead), generator=g)]  # ties in idleness: a random order
        order = order[idle[order].argsort(descending=True, stable=True)][: queries.shape[0]]
        pick = torch.randperm(queries.shape[0], generator=g)[: len(order)]
        use.vocabulary.set_codes(use.level, order.to(use.ids.device), queries[pick].to(use.states.device))
        idle[order] = 0
        return idle.to(device), len(order)

    def state_dict(self) -> dict:
        return {"idle": {name: idle.tolist() if isinstance(idle, torch.Tensor) else list(idle)
                         for name, idle in self.idle.items()}}

    def load_state_dict(self, state: dict, model) -> None:
        """The checkpoint's counters, kept as ints: the first step uploads them to its device (``device_step``)."""
        self.idle = {name: [int(v) for v in idle] for name, idle in state["idle"].items()}


class KMeansInit(Objective):
    """``--kmeans-init B``: before the first step of a fresh run, every (vocabulary, level) that emitted n
    concepts in the first B training batches (one no-grad forward each, in evaluation mode) gets
    ``min(K, n)`` of its codes (a random subset when n < K) pointed at the spherical k-means centroids of
    their queries. Logged once, with step 1, as ``kmeans_codes`` (codes set) and ``kmeans_states`` (queries
    clustered). Every process clusters the same batches, so the codes agree; a resumed run skips it (its
    codes are in the checkpoint)."""

    name = "kmeans_init"
    adds_term = False

    def __init__(self, batches: int, seed: int):
        self.batches, self.seed = batches, seed
        self.report: dict[str, float] = {}  # what to log with the next step (once)

    def before_step(self, context) -> None:
        if context.step != 0:
            return
        with declared("k-means init"):  # once per fresh run, before its first step: clustering on the host
            self._initialise(context)

    def _initialise(self, context) -> None:
        model, queries, targets = context.model, {}, {}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), context.gathered():
                for index in range(self.batches):
                    out = context.forward(context.batch(index))
                    for use in model.code_uses(out):
                        use = use.chosen()
                        queries.setdefault(use.name, []).append(use.queries())
                        targets[use.name] = use
        finally:
            model.train(was_training)
        codes = states = 0
        for i, (name, use) in enumerate(sorted(targets.items())):
            x = torch.cat(queries[name])
            if not x.shape[0]:
                continue
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            K, k = use.vocabulary.size, min(use.vocabulary.size, x.shape[0])
            centroids = spherical_kmeans(x.cpu(), k, g)
            ids = torch.randperm(K, generator=g)[:k] if k < K else torch.arange(K)
            use.vocabulary.set_codes(use.level, ids.to(use.ids.device), centroids.to(use.states.device))
            codes, states = codes + k, states + x.shape[0]
        self.report = {"kmeans_codes": codes, "kmeans_states": states}

    def device_step(self, model, means, totals, skipped) -> dict:  # (host values: no log read needed)
        report, self.report = self.report, {}
        return report


def controllers(model, kmeans_init: int, revive_after: int, seed: int) -> list[Objective]:
    """The anti-collapse controllers a family's options ask for (``--kmeans-init``, ``--revive-after``:
    ``concept.code_options``; 0: off); a clear error when the model's vocabularies cannot take them."""
    found, problems = [], []
    for option, value in (("--kmeans-init", kmeans_init), ("--revive-after", revive_after)):
        if value:
            problems += check(model, option)
    if problems:
        raise ConfigError(problems)
    if kmeans_init:
        found.append(KMeansInit(kmeans_init, seed))
    if revive_after:
        found.append(CodeRevival(revive_after, seed))
    return found


def fsdp2_problems(kmeans_init: int, revive_after: int) -> list[str]:
    """Under FSDP2 (``--distributed fsdp2``): the controllers rewrite code rows in place, which its sharded
    parameters do not allow."""
    return [f"{flag}: it rewrites code rows in place, which FSDP2's sharded parameters do not allow; use "
            f"--distributed ddp" for flag, value in (("revive-after", revive_after), ("kmeans-init", kmeans_init))
            if value]


def temperature_schedule(sampler, config, step) -> list[Objective]:
    """[the sampler's temperature schedule] (``--tau-start`` -> ``--tau-end`` over ``config.steps``; ``step()``: the
    step about to run) for a sampler with a temperature (``concept.contracts.Tempered``), else []."""
    if not isinstance(sampler, Tempered):
        return []
    return [TemperatureSchedule(sampler, config.tau_start, config.tau_end, config.steps, step)]
