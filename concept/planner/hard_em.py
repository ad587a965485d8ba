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
(``S(z_new) − S(z_old)`` under the current model, >= 0) and ``estep_s`` (seconds in the E-step per micro-batch).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..objectives import Objective, zero
from .model import Plan
from .search import beam_search, score_plans

STATS = ("examples", "rows", "margin", "old", "flips", "gap", "seconds")


def example_key(u: torch.Tensor, y: torch.Tensor) -> str:
    """A stable hash of one example's real tokens (u and y)."""
    h = hashlib.sha1()
    h.update(u.to(torch.int64).cpu().numpy().tobytes())
    h.update(b"|")
    h.update(y.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass
class CachedPlan:
    rows: list[tuple[int, int]]  # (type, concept id) in order
    score: float  # S(z*) when it was chosen
    step: int  # the training step that chose it


@dataclass
class HardEMObjective(Objective):
    weight: float  # of the planner's CE on z*
    beam: int = 4
    every: int = 50  # --estep-every
    prior: float = 1.0  # --estep-prior β: S(z) = log p(y | z) + β log p(z | u)
    name: str = "plan_ce"
    cache: dict[str, CachedPlan] = field(default_factory=dict)
    _stats: dict[str, float] = field(default_factory=dict)

    # -- E-step --------------------------------------------------------------------------------
    def prepare(self, model, batch: dict, step: int) -> dict:
        """Refresh the stale or missing plans of the batch's examples, and hand the model their ``z*``."""
        u, u_valid, y, y_valid = model.split_example(batch["input_ids"], batch.get("attention_mask"))
        keys = [example_key(u[b][u_valid[b]], y[b][y_valid[b]]) for b in range(u.shape[0])]
        stale = [b for b, key in enumerate(keys) if key not in self.cache or step - self.cache[key].step >= self.every]
        self._stats = dict.fromkeys(STATS, 0.0)
        self._stats["examples"] = float(len(keys))
        if stale:
            self.estep(model, u, u_valid, y, y_valid, keys, stale, step)
        sizes = tuple(model.sizes.tolist())
        plan = Plan.from_rows([self.cache[key].rows for key in keys], sizes, u.device)
        return {**batch, "plan": plan}

    def estep(self, model, u, u_valid, y, y_valid, keys, rows: list[int], step: int) -> None:
        t0 = time.perf_counter()
        idx = torch.tensor(rows, device=u.device)
        u, u_valid, y, y_valid = u[idx], u_valid[idx], y[idx], y_valid[idx]
        sizes = tuple(model.sizes.tolist())
        was_training = model.training
        model.eval()  # a deterministic search: no adapter dropout
        try:
            with torch.no_grad():
                beams, beam_logp = beam_search(model, u, u_valid, self.beam)
                old = [self.cache[keys[b]].rows if keys[b] in self.cache else None for b in rows]
                # per example: its k beams, then its cached plan (none: the top beam again, never preferred)
                k, per_row, beam_rows = self.beam, self.beam + 1, beams.rows()
                candidates = [z for i, o in enumerate(old)
                              for z in (*beam_rows[i * k:(i + 1) * k], o if o is not None else beam_rows[i * k])]
                plans = Plan.from_rows(candidates, sizes, u.device)
                scores = score_plans(model, u, u_valid, y, y_valid, plans, per_row)
                total = scores.text + self.prior * scores.plan
        finally:
            model.train(was_training)
        allowed = torch.cat([torch.isfinite(beam_logp), torch.tensor([[o is not None] for o in old], device=u.device)], 1)
        total = total.masked_fill(~allowed, float("-inf"))  # (beams beyond the distinct plans there are)
        ranked = total.topk(min(2, per_row), dim=-1)
        for i, b in enumerate(rows):
            best = float(ranked.values[i, 0])
            new = candidates[i * per_row + int(ranked.indices[i, 0])]
            self.cache[keys[b]] = CachedPlan(list(new), best, step)
            second = float(ranked.values[i, -1])
            self._stats["margin"] += best - second if per_row > 1 and second > float("-inf") else 0.0
            if old[i] is not None:
                self._stats["old"] += 1
                self._stats["flips"] += float(list(new) != [tuple(x) for x in old[i]])
                self._stats["gap"] += best - float(total[i, -1])
        self._stats["rows"] += len(rows)
        self._stats["seconds"] += time.perf_counter() - t0

    # -- M-step --------------------------------------------------------------------------------
    def __call__(self, model, batch, out, teacher=None):
        plan = out.plan
        mask = plan.active & ~plan.forced
        if not bool(mask.any()):
            return zero(out.plan.classes)
        logp = F.log_softmax(plan.logits[mask].float(), dim=-1)
        return self.weight * F.nll_loss(logp, plan.classes[mask])

    # -- statistics, summed by the trainer over micro-batches and processes -------------------
    def stats(self, model, batch, out) -> dict[str, float]:
        return {f"_estep/{k}": self._stats.get(k, 0.0) for k in STATS}

    def after_step(self, model, means: dict[str, float], totals: dict[str, float]) -> dict[str, float]:
        """From the statistics' means over the micro-batches (ratios of means are exact ratios)."""
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
