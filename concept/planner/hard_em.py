"""Hard-EM training of the planner-executor (docs/planner_executor.md): ``--plan-training hard-em``.

Instead of sampling a plan with Gumbel-ST in every step, each example gets a best plan ``z*``:

* **E-step** (no gradients, the model in eval mode): beam search proposes the ``k`` most probable plans
  under the planner (``--beam``); together with the example's cached plan they are scored by
  ``S(z) = log p(y | z) + β log p(z | u)`` in one batched teacher-forced forward
  (``concept.planner.search``), and the best becomes ``z*``. β = 1 (``--estep-prior``, the default) is the
  posterior mode; every concept then costs its prior log-probability (about log K nats for a spread
  planner), so while the executor has not learned to read plans the empty plan wins (measured:
  docs/results.md); β = 0 picks the beam's plan that best explains y. The cached plan competes, so a refresh never
  picks a plan the current model scores lower than the one it had.
* **One host sync per micro-batch** (declared ``hard-EM E-step``, ``concept.syncs``): the batch's tokens (the
  cache's keys) and the last E-step's chosen plans (into the cache) are read back in one copy; the host picks
  the rows to search and uploads their cached plans; the search (a fixed number of steps), the scores, the
  choice of ``z*`` and its statistics stay on the device, and the batch's plans are ``settings.max_plan_steps`` steps wide
  (a step that searches no row: as wide as its longest cached plan).
* **Cache**: ``z*`` is kept per example, keyed by a hash of the example's tokens (u and y), and refreshed
  only when it is ``--estep-every M`` steps old (or missing). The cache is saved with every checkpoint
  (``checkpoint/plan_ce.json``, its SHA-256 in ``state.json``); a cache that fails its checksum or
  does not fit the model is dropped with a warning on resume and rebuilt by the next E-steps.
* **M-step**: the model's forward is teacher-forced on ``z*`` (the planner in one forward, the executor on
  its hard embeddings): the trainer's CE is ``-log p(y | z*)`` and this objective adds
  ``weight x CE(z* | u)``, the planner's cross-entropy on the plan's steps (forced <EOS> excluded).

Statistics of the E-step (averaged over the refreshed examples of the step, logged in metrics.jsonl):
``estep_share`` (share of the step's examples refreshed), ``estep_margin`` (top-1 minus runner-up score, nats per example),
``flip_rate`` (share of refreshed cached plans whose ``z*`` changed), ``staleness_gap``
(``S(z_new) − S(z_old)`` under the current model, >= 0) and ``estep_s`` (seconds in the E-step per micro-batch:
CUDA events on a GPU, read with the step log).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..objectives import Objective, pair_mean
from ..syncs import declared, upload
from ..teacher import TeacherClock
from .model import STEP_FIELDS, Plan
from .search import beam_search, score_plans

STATS = ("examples", "rows", "margin", "old", "flips", "gap", "seconds")
ESTEP = "hard-EM E-step"  # the declared host sync: once per micro-batch (concept.syncs)


def example_key(u, y) -> str:
    """A stable hash of one example's real tokens (u and y: tensors or host arrays)."""
    h = hashlib.sha1()
    h.update(_int64_bytes(u))
    h.update(b"|")
    h.update(_int64_bytes(y))
    return h.hexdigest()


def _int64_bytes(x) -> bytes:
    return np.asarray(x.cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.int64).tobytes()


@dataclass
class CachedPlan:
    rows: list[tuple[int, int]]  # (type, concept id) in order
    score: float  # S(z*) when it was chosen
    step: int  # the training step that chose it


@dataclass
class NewPlans:
    """An E-step's plans, still on the device: they join the cache at the next E-step's read (or a checkpoint's)."""
    keys: list[str]
    step: int
    codes: torch.Tensor  # [R, S] type * width + concept id of every concept step, -1 elsewhere (concept_codes)
    scores: torch.Tensor  # [R] S(z*)
    width: int


def concept_codes(plan: Plan, width: int) -> torch.Tensor:
    """[B, S] ``type * width + concept id`` of every concept step, -1 elsewhere (a plan's rows as one tensor)."""
    return torch.where(plan.concepts, plan.types * width + plan.classes, torch.full_like(plan.classes, -1))


@dataclass
class HardEMObjective(Objective):
    weight: float  # of the planner's CE on z*
    beam: int = 4
    every: int = 50  # --estep-every
    prior: float = 1.0  # --estep-prior β: S(z) = log p(y | z) + β log p(z | u)
    name: str = "plan_ce"
    _cache: dict[str, CachedPlan] = field(default_factory=dict)
    _new: list[NewPlans] = field(default_factory=list)
    _stats: dict = field(default_factory=dict)

    @property
    def cache(self) -> dict[str, CachedPlan]:
        """z* per example key, with the last E-step's plans (read back here if no E-step has read them yet)."""
        if self._new:
            with declared(ESTEP):
                self._read_back([])
        return self._cache

    @cache.setter
    def cache(self, cache: dict[str, CachedPlan]) -> None:
        self._cache, self._new = cache, []

    # -- E-step --------------------------------------------------------------------------------
    def prepare(self, model, batch: dict, step: int) -> dict:
        """Refresh the stale or missing plans of the batch's examples, and hand the model their ``z*``.

        The one host sync (declared, ``hard-EM E-step``): the batch's tokens (the cache's keys) and the last
        E-step's new plans (into the cache) read back in one copy. The host then picks the rows to search and
        uploads their cached plans (no sync); the search, the scores and the choice of ``z*`` stay on the
        device, and the batch's plans are put together there (``settings.max_plan_steps`` steps each; as wide as the longest cached
        plan where no row is searched)."""
        u, u_valid, y, y_valid = model.split_example(batch["input_ids"], batch.get("attention_mask"))
        with declared(ESTEP):
            tokens = self._read_back([u, u_valid, y, y_valid])
        u_h, uv_h, y_h, yv_h = tokens
        keys = [example_key(u_h[b][uv_h[b] > 0], y_h[b][yv_h[b] > 0]) for b in range(u.shape[0])]
        cache = self._cache
        stale = [b for b, key in enumerate(keys) if key not in cache or step - cache[key].step >= self.every]
        zero = torch.zeros((), dtype=torch.float64, device=u.device)  # (device scalars, whether or not it searches)
        self._stats = {"examples": float(len(keys)), "rows": float(len(stale)), "old": 0.0, "seconds": 0.0,
                       "margin": zero, "flips": zero, "gap": zero}
        sizes = tuple(t.size for t in model.settings.types)
        # the host's part: every row's cached plan (none: an empty one), the rows to search, whether each has a
        # plan already, and where each row's z* comes from (a searched row: the last searched row of its key)
        steps = [Plan.steps_of(cache[key].rows if key in cache else [], sizes) for key in keys]
        # the plans' width: the longest there can be where some are searched, else the longest cached (host values)
        width = model.settings.max_plan_steps if stale else max(len(s) for s in steps)
        fields = [[s[j][f] if j < len(s) else pad for j in range(width)]  # classes, types, ranks: [3, B, width]
                  for f, pad in ((1, -1), (0, -1), (2, 0)) for s in steps]
        has_old = [keys[b] in cache for b in stale]
        last = {keys[b]: i for i, b in enumerate(stale)}
        pick = [len(keys) + last[key] if key in last else b for b, key in enumerate(keys)]
        self._stats["old"] = float(sum(has_old))
        B, R = len(keys), len(stale)
        host = upload([v for f in fields for v in f] + stale + [int(o) for o in has_old] + pick, torch.long, u.device)
        plan_data, rows, has_old, pick = host.split([3 * B * width, R, R, B])
        plan = Plan.from_steps(*plan_data.view(3, B, width), model.sizes)
        if stale:
            found = self.estep(model, (u, u_valid, y, y_valid), rows, plan.select(rows), has_old.bool(), step,
                               [keys[b] for b in stale])
            plan = Plan(**{k: torch.cat([getattr(plan, k), getattr(found, k)]).index_select(0, pick)
                           for k in STEP_FIELDS})
        return {**batch, "plan": plan}

    def estep(self, model, example, rows, old: Plan, has_old, step: int, keys: list[str]) -> Plan:
        """Search ``rows`` of the batch (``example``: u, u_valid, y, y_valid) on the device: their k beams and their
        cached plans (``old``, where ``has_old``) scored in one batched forward; returns z* of each ([R, S]) and
        keeps it to join the cache (``NewPlans``)."""
        clock = TeacherClock(rows.device)
        with clock.timing():
            u, u_valid, y, y_valid = (t.index_select(0, rows) for t in example)
            R, k, per_row = rows.shape[0], self.beam, self.beam + 1
            was_training = model.training
            model.eval()  # a deterministic search: no adapter dropout
            try:
                with torch.no_grad():
                    beams, beam_logp = beam_search(model, u, u_valid, k)
                    beams = beams.padded(old.classes.shape[1])
                    # per example: its k beams, then its cached plan (none: the top beam again, never preferred)
                    candidates = {}
                    for name in STEP_FIELDS:
                        mine = getattr(beams, name).view(R, k, -1)
                        last = torch.where(has_old[:, None], getattr(old, name), mine[:, 0])
                        candidates[name] = torch.cat([mine, last[:, None]], dim=1)
                    plans = Plan(**{name: v.flatten(0, 1) for name, v in candidates.items()})
                    scores = score_plans(model, u, u_valid, y, y_valid, plans, per_row)
                    total = scores.text + self.prior * scores.plan
            finally:
                model.train(was_training)
            allowed = torch.cat([torch.isfinite(beam_logp), has_old[:, None]], 1)
            total = total.masked_fill(~allowed, float("-inf"))  # (beams beyond the distinct plans there are)
            ranked = total.topk(2, dim=-1)  # (per_row >= 2: k >= 1)
            best = ranked.indices[:, 0]
            new = Plan(**{name: v.gather(1, best[:, None, None].expand(-1, 1, v.shape[2]))[:, 0]
                          for name, v in candidates.items()})
            top, second = ranked.values.double().unbind(1)
            codes_width = max(t.size for t in model.settings.types) + 1
            codes = concept_codes(new, codes_width)
            flips = (codes != concept_codes(old, codes_width)).any(1) & has_old
            self._stats["margin"] = torch.where(second > float("-inf"), top - second, 0.0).sum()
            self._stats["flips"] = flips.double().sum()
            self._stats["gap"] = torch.where(has_old, top - total[:, -1].double(), 0.0).sum()
            self._new.append(NewPlans(keys, step, codes, ranked.values[:, 0], codes_width))
        self._stats["seconds"] = clock
        return new

    def _read_back(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        """``tensors`` and the E-steps' new plans read back in one copy (inside a declared point); the new plans
        join the cache. Returns the tensors as host arrays (float64: token ids are exact)."""
        new, self._new = self._new, []
        parts = [t.double() for t in tensors] + [x.double() for n in new for x in (n.codes, n.scores)]
        flat = torch.cat([p.reshape(-1) for p in parts]).cpu().numpy() if parts else np.zeros(0)
        out, at = [], 0
        for p in parts:
            out.append(flat[at:at + p.numel()].reshape(p.shape))
            at += p.numel()
        arrays, values = out[:len(tensors)], iter(out[len(tensors):])
        for n in new:
            codes, scores = next(values), next(values)
            for key, row, score in zip(n.keys, codes, scores):  # (in order: a key searched twice keeps the last)
                self._cache[key] = CachedPlan([divmod(int(c), n.width) for c in row if c >= 0], float(score), n.step)
        return arrays

    # -- M-step --------------------------------------------------------------------------------
    def __call__(self, model, batch, out, teacher=None):
        plan = out.plan
        mask = plan.active & ~plan.forced  # (a masked mean: no plan step gives 0, no gradient)
        logp = F.log_softmax(plan.logits.float(), dim=-1).gather(-1, plan.classes.clamp(min=0)[..., None])[..., 0]
        return self.weight * pair_mean(-logp, mask)

    # -- statistics, summed by the trainer over micro-batches and processes -------------------
    def stats(self, model, batch, out) -> dict[str, float]:
        return {f"_estep/{k}": self._stats.get(k, 0.0) for k in STATS}

    def log_stats(self, means: dict[str, float], totals: dict[str, float]) -> dict[str, float]:
        """From the statistics' means over the micro-batches (ratios of means are exact ratios), when the step's
        log is read (no read per step)."""
        get = lambda k: means.get(f"_estep/{k}", 0.0)  # noqa: E731
        rows, old = get("rows"), get("old")
        row = {"estep_share": rows / max(get("examples"), 1.0), "estep_s": get("seconds")}
        if rows:
            row["estep_margin"] = get("margin") / rows
        if old:
            row.update(flip_rate=get("flips") / old, staleness_gap=get("gap") / old)
        return row

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": 1, "entries": {k: [[list(x) for x in v.rows], v.score, v.step] for k, v in self.cache.items()}}

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """The caches of several processes as one (each holds the examples of its own micro-batches)."""
        entries = {}
        for state in states:
            entries.update(state["entries"])
        return {"format": 1, "entries": entries}

    def load_state_dict(self, state: dict, model) -> None:
        """Load a saved cache; ``ValueError`` when it does not fit ``model`` (the caller rebuilds)."""
        if not isinstance(state, dict) or state.get("format") != 1 or not isinstance(state.get("entries"), dict):
            raise ValueError("not a plan cache")
        sizes = model.sizes.tolist()
        cache = {}
        for key, (rows, score, step) in state["entries"].items():
            rows = [tuple(int(v) for v in x) for x in rows]
            if len(key) != 40 or any(not (0 <= t < len(sizes) and 0 <= c < sizes[t]) for t, c in rows):
                raise ValueError(f"entry {key[:12]} does not fit this model's plan types")
            cache[key] = CachedPlan(rows, float(score), int(step))
        self.cache = cache
