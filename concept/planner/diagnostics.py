"""Held-out evaluation of the planner-executor (docs/planner_executor.md, docs/diagnostics.md), from the same batches
as ``concept.diagnostics.evaluate`` (which hands planner-executor models to :func:`evaluate_planned`).

Per batch the planner writes a plan for ``u`` with the eval sampler (argmax), and the executor scores
``y`` given the plan alone. Reported (nats per token of y unless said otherwise):

* ``nll`` (= NLL(y | plan)), ``bits_per_token``, ``perplexity``, ``nll_by_position`` (buckets of y);
* ``nll_nothing``: NLL(y | an empty plan: every type's block empty) — the floor a useless plan gives;
* with ``controls`` also the frozen backbone's references: ``nll_dense_given_u``: the frozen backbone (adapters off) on ``[u ; y]``, scored on y — the
  reference a model that keeps all of u reaches (for ``reconstruct`` y repeats u, so this is a copy);
* ``nll_dense``: the frozen backbone on y alone (its own prior, no context);
* ``plan_len`` (concepts per example), ``plan_len/<type>``, ``plan_per_token`` (plan length / |u|);
* per type: ``entropy/<type>`` and ``max_prob/<type>`` of the planner at its concept steps,
  ``usage_perplexity/<type>`` (exp of the entropy of the used concept ids: 1 = collapse); with multi-level
  codes also ``usage_perplexity/<type>/level<l>``, per code level (a collapsed level reads 1);
* ``cos_soft_hard``: mean cosine between the planner's probability-weighted concept embedding (e_soft) and
  the chosen concept's (e_hard): near 1 = a decisive planner, low = a spread, undecided one;
* with ``controls``: ``delta_nll_shuffle`` (plans rolled by one row across the batch), ``delta_nll_mask``
  (every concept's embedding zeroed, the separators and types kept), ``delta_nll_random`` (random ids,
  same lengths and types) and ``delta_nll_dropout`` (each concept dropped with probability 1/2), each the
  NLL under that plan minus ``nll``. > 0 means the plan carries information. With several types also
  ``delta_nll_shuffle/<type>``: only that type's block rolled by one row (the other types kept): what the
  type carries beyond the others;
* with ``controls`` and ``beam`` > 0, the E-step's search (``concept.planner.search``): ``nll_zstar``, NLL(y | z*)
  of the best of a beam of ``beam`` plans under S(z) = log p(y | z) + log p(z | u) (below ``nll``: the search
  finds better plans than the planner's greedy one), and ``estep_margin``, S(z⁽¹⁾) − S(z⁽²⁾) per example.

``step_diagnostics`` computes the same signals on a training micro-batch (logged every ``--log-every``
steps); the E-step's own statistics (flip rate, staleness gap) come from ``concept.planner.hard_em``.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from ..attention import CausalPattern
from ..backbone import run_layers
from ..diagnostics import BucketSums
from ..packing import time_positions
from ..teacher import adapters_disabled
from .model import Plan, text_loss
from .search import beam_search, score_plans


def _score(model, plan, y, y_valid, embeds=None) -> torch.Tensor:
    return text_loss(model.executor(plan, y, y_valid, embeds=embeds), y, y_valid, reduction="none")


def empty_plan(model, batch_size: int, device) -> Plan:
    return Plan.from_rows([[] for _ in range(batch_size)], tuple(model.sizes.tolist()), device)


def random_plan(model, plan: Plan, generator: torch.Generator) -> Plan:
    """The same lengths and types, uniformly random concept ids."""
    sizes = model.sizes.cpu()
    types = plan.types.clamp(min=0).cpu()
    noise = (torch.rand(plan.classes.shape, generator=generator) * sizes[types]).long()
    classes = torch.where(plan.concepts.cpu(), noise, plan.classes.cpu()).to(plan.classes.device)
    return Plan(classes, plan.types, plan.active, plan.rank, plan.is_eos)


def masked_embeds(model, plan: Plan) -> torch.Tensor:
    """Step embeddings with every concept's own embedding zeroed (its type embedding kept)."""
    e = model.step_embedding(plan.classes, plan.types, rank=plan.rank)[0]
    zero = model.positions.add_types(torch.zeros_like(e), plan.types.clamp(min=0) + 1)
    return torch.where(plan.concepts[..., None], zero, e)


def dropout_plan(model, plan: Plan, generator: torch.Generator, p: float = 0.5) -> Plan:
    """Each concept of each plan dropped with probability ``p`` (the types' blocks otherwise kept)."""
    rows = [[c for c in row if float(torch.rand((), generator=generator)) >= p] for row in plan.rows()]
    return Plan.from_rows(rows, tuple(model.sizes.tolist()), plan.classes.device)


def shuffle_type(model, plan: Plan, kind: int, rows: torch.Tensor) -> Plan:
    """Each row's plan with its type-``kind`` block taken from row ``rows[b]`` (the other types' blocks kept):
    the plan-only shuffle of one type."""
    own = plan.rows()
    mixed = [sorted([c for c in row if c[0] != kind] + [c for c in own[r] if c[0] == kind], key=lambda c: c[0])
             for row, r in zip(own, rows.tolist())]  # (sorted is stable: each type's order is kept)
    return Plan.from_rows(mixed, tuple(model.sizes.tolist()), plan.classes.device)


def controls_of(model) -> tuple[str, ...]:
    """The controls :func:`control_nlls` runs (``delta_nll_<name>``): with several types also ``shuffle/<type>``."""
    names = [t.name for t in model.settings.types]
    return CONTROLS + (tuple(f"shuffle/{name}" for name in names) if len(names) > 1 else ())


CONTROLS = ("shuffle", "mask", "random", "dropout")


def control_nlls(model, plan: Plan, y, y_valid, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """[B, Ty] NLL of y under each perturbed plan: ``shuffle`` (plans rolled by one row across the batch),
    ``mask`` (concept embeddings zeroed), ``random`` (random ids, same lengths and types), ``dropout`` (half
    the concepts dropped at random) and, with several types, ``shuffle/<type>`` (only that type's block rolled
    by one row: what the type carries beyond the others)."""
    perm = torch.roll(torch.arange(y.shape[0], device=y.device), 1)
    found = {"shuffle": _score(model, plan.select(perm), y, y_valid),
             "mask": _score(model, plan, y, y_valid, embeds=masked_embeds(model, plan)),
             "random": _score(model, random_plan(model, plan, generator), y, y_valid),
             "dropout": _score(model, dropout_plan(model, plan, generator), y, y_valid)}
    types = model.settings.types
    for i, t in enumerate(types if len(types) > 1 else ()):
        found[f"shuffle/{t.name}"] = _score(model, shuffle_type(model, plan, i, perm), y, y_valid)
    return found


def planner_signals(model, plan: Plan) -> dict[str, float]:
    """Sums over the concept steps of each type: the planner's entropy and max-prob over the type's
    concepts (``entropy/<type>``, ``max_prob/<type>``, ``steps/<type>``), and of the cosine between the
    probability-weighted embedding e_soft and the chosen one e_hard (``cos_soft_hard``, ``steps``)."""
    probs = torch.softmax(plan.logits.float(), dim=-1)
    out: dict[str, float] = defaultdict(float)
    for i, t in enumerate(model.settings.types):
        at = plan.concepts & (plan.types == i)
        p = probs[at][:, : t.size]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        out[f"entropy/{t.name}"] += float(-(p * p.clamp_min(1e-12).log()).sum(-1).sum())
        out[f"max_prob/{t.name}"] += float(p.max(-1).values.sum()) if len(p) else 0.0
        out[f"steps/{t.name}"] += float(at.sum())
    if bool(plan.concepts.any()):
        _, soft, hard = model.step_embedding(plan.classes, plan.types, probs.to(model.specials.table.weight.dtype),
                                             rank=plan.rank)
        mask = plan.concepts
        out["cos_soft_hard"] += float(torch.cosine_similarity(soft[mask].float(), hard[mask].float(), dim=-1).sum())
        out["steps"] += float(mask.sum())
    return out


@torch.no_grad()
def step_diagnostics(model, out, batch, bucket: int = 64, seed: int = 0) -> dict[str, float]:
    """The planner diagnostics of one training micro-batch (``out``: its ``PlannedOutput``), logged every
    ``--log-every`` steps: ΔNLL of each control against NLL(y | the plan trained on: z* under Hard-EM, the
    sampled plan under Gumbel), the planner's entropy / max-prob per type, cos(e_soft, e_hard) and the NLL
    by position bucket of y. A few executor forwards without gradients; the planner does not run again."""
    plan = dataclasses.replace(out.plan, embeds=None)  # (the hard embeddings: what the controls perturb)
    y, y_valid = out.y, out.y_valid
    nll = text_loss(out.logits.detach(), y, y_valid, reduction="none")
    tokens = max(1.0, float(y_valid.sum()))
    base = float(nll[y_valid].sum()) / tokens
    was_training = model.training
    model.eval()
    try:
        controls = control_nlls(model, plan, y, y_valid, torch.Generator().manual_seed(seed))
    finally:
        model.train(was_training)
    row = {f"delta_nll_{k}": float(v[y_valid].sum()) / tokens - base for k, v in controls.items()}
    signals = planner_signals(model, out.plan)
    for t in model.settings.types:
        steps = signals[f"steps/{t.name}"]
        if steps:
            row[f"entropy/{t.name}"] = signals[f"entropy/{t.name}"] / steps
            row[f"max_prob/{t.name}"] = signals[f"max_prob/{t.name}"] / steps
    if signals.get("steps"):
        row["cos_soft_hard"] = signals["cos_soft_hard"] / signals["steps"]
    index = (torch.cumsum(y_valid.long(), 1) - 1) // bucket
    for b in sorted(set(index[y_valid].tolist())):
        at = y_valid & (index == b)
        row[f"nll_by_position/{b * bucket}-{(b + 1) * bucket}"] = float(nll[at].mean())
    return row


def frozen_logits(model, ids, valid) -> torch.Tensor:
    """[B, T, V] next-token logits of the frozen backbone (adapters off) on ``ids``."""
    inner = model.inner
    with adapters_disabled(model.backbone):
        h = run_layers(inner.layers, inner.embed_tokens(ids), time_positions(valid), CausalPattern(valid), inner.rotary_emb)
        return model.backbone.lm_head(inner.norm(h))


def dense_given_u(model, u, u_valid, y, y_valid) -> torch.Tensor:
    """[B, Ty] NLL of y under the frozen backbone reading [u ; y]."""
    logits = frozen_logits(model, torch.cat([u, y], 1), torch.cat([u_valid, y_valid], 1))
    return text_loss(logits[:, u.shape[1] - 1: -1], y, y_valid, reduction="none")


def dense_alone(model, y, y_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """NLL of y_1.. under the frozen backbone reading y alone, and the mask of those tokens."""
    mask = y_valid[:, 1:] & y_valid[:, :-1]
    return text_loss(frozen_logits(model, y, y_valid)[:, :-1], y[:, 1:], mask, reduction="none"), mask


def _usage_perplexity(counts: torch.Tensor) -> float:
    share = counts / counts.sum().clamp_min(1)
    return float(torch.exp(-(share * share.clamp_min(1e-12).log()).sum()))


@torch.no_grad()
def evaluate_planned(model, batches, bucket: int = 64, controls: bool = True, seed: int = 0, beam: int = 4) -> dict:
    """The held-out evaluation of a planner-executor: NLL(y | its greedy plan) and with an empty plan, by position
    bucket of y, the plans' lengths, the planner's signals and usage per type (and level); with ``controls`` also
    the frozen backbone's references, the ΔNLL controls and, with ``beam``, the E-step's best plan z*."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    totals = _PlannedTotals(model, bucket)
    try:
        for batch in batches:
            ids = batch["input_ids"].to(device)
            mask = batch.get("attention_mask")
            valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.to(device).bool()
            u, u_valid, y, y_valid = model.split_example(ids, valid)
            plan = model.planner(u, u_valid, sample=False)
            totals.add_text(model, plan, y, y_valid)
            if controls:  # the frozen backbone's references (two extra forwards): not in the trainer's periodic eval
                totals.add_references(model, u, u_valid, y, y_valid)
            totals.add_plan(model, plan, u_valid)
            if controls:
                totals.add_controls(model, plan, u, u_valid, y, y_valid, generator, beam)
    finally:
        model.train(was_training)
    return totals.result(model, controls, beam)


class _PlannedTotals:
    """The sums of :func:`evaluate_planned` over its batches, and the result they give."""

    def __init__(self, model, bucket: int):
        self.names = [t.name for t in model.settings.types]
        self.sums: dict[str, float] = defaultdict(float)
        self.by_position = BucketSums(next(model.parameters()).device, bucket)  # NLL(y | plan) by position of y
        self.used = [torch.zeros(int(k), dtype=torch.float64) for k in model.sizes.tolist()]
        self.by_level: dict[tuple[int, int], torch.Tensor] = {}

    def add_text(self, model, plan, y, y_valid) -> None:
        """NLL(y | plan), by position bucket, and NLL(y | an empty plan)."""
        sums = self.sums
        nll = _score(model, plan, y, y_valid)
        self.by_position.add(nll, y_valid, (torch.cumsum(y_valid.long(), 1) - 1).clamp(min=0))
        empty = empty_plan(model, len(y), y.device)
        sums["nll_nothing"] += float(_score(model, empty, y, y_valid)[y_valid].sum())

    def add_references(self, model, u, u_valid, y, y_valid) -> None:
        """The frozen backbone's NLL of y given u, and of y alone."""
        self.sums["nll_dense_given_u"] += float(dense_given_u(model, u, u_valid, y, y_valid)[y_valid].sum())
        alone, alone_mask = dense_alone(model, y, y_valid)
        self.sums["nll_dense"] += float(alone[alone_mask].sum())
        self.sums["dense_tokens"] += float(alone_mask.sum())

    def add_plan(self, model, plan, u_valid) -> None:
        """The plans' lengths (per type, per token of u), the planner's signals and the codes used (per level)."""
        sums, used = self.sums, self.used
        lengths = plan.lengths(model.num_types).float()
        sums["rows"] += len(u_valid)
        sums["plan_len"] += float(lengths.sum())
        sums["plan_per_token"] += float((lengths.sum(1) / u_valid.sum(1).clamp(min=1)).sum())
        for key, value in planner_signals(model, plan).items():
            sums[key] += value
        for i, name in enumerate(self.names):
            sums[f"plan_len/{name}"] += float(lengths[:, i].sum())
            at = plan.concepts & (plan.types == i)
            used[i] += torch.bincount(plan.classes[at].cpu(), minlength=len(used[i])).double()
            levels = int(model.levels[i])
            for level in range(levels if levels > 1 else 0):  # multi-level codes: usage per level (collapse)
                mine = at & (model.level(plan.types, plan.before(model.num_types)) == level)
                counts = torch.bincount(plan.classes[mine].cpu(), minlength=len(used[i])).double()
                self.by_level[(i, level)] = self.by_level.get((i, level), 0) + counts

    def add_controls(self, model, plan, u, u_valid, y, y_valid, generator, beam: int) -> None:
        """The controls' NLLs and, with ``beam``, the E-step's search: its best plan z* under
        S(z) = log p(y | z) + log p(z | u) and its margin over the second best."""
        sums = self.sums
        for key, value in control_nlls(model, plan, y, y_valid, generator).items():
            sums[f"control_{key}"] += float(value[y_valid].sum())
        if beam:
            beams, _ = beam_search(model, u, u_valid, beam)
            scores = score_plans(model, u, u_valid, y, y_valid, beams, beam)
            top = scores.total.topk(min(2, beam), dim=-1)
            sums["nll_zstar"] += float(-scores.text.gather(1, top.indices[:, :1]).sum())
            if beam > 1:
                sums["estep_margin"] += float((top.values[:, 0] - top.values[:, 1]).sum())

    def result(self, model, controls: bool, beam: int) -> dict:
        sums = self.sums
        total, count, by_position, tokens_by_position = self.by_position.read()
        tokens, rows = max(1.0, count), max(1.0, sums["rows"])
        nll = total / tokens
        result = {"tokens": count, "nll": nll, "bits_per_token": nll / math.log(2),
                  "perplexity": math.exp(min(nll, 50.0)),
                  "nll_nothing": sums["nll_nothing"] / tokens,
                  "plan_len": sums["plan_len"] / rows, "plan_per_token": sums["plan_per_token"] / rows,
                  "nll_by_position": by_position, "tokens_by_position": tokens_by_position, "task": model.task}
        for i, name in enumerate(self.names):
            steps = max(1.0, sums[f"steps/{name}"])
            result[f"plan_len/{name}"] = sums[f"plan_len/{name}"] / rows
            result[f"entropy/{name}"] = sums[f"entropy/{name}"] / steps
            result[f"max_prob/{name}"] = sums[f"max_prob/{name}"] / steps
            result[f"usage_perplexity/{name}"] = _usage_perplexity(self.used[i])
            for (j, level), counts in sorted(self.by_level.items()):
                if j == i:
                    result[f"usage_perplexity/{name}/level{level}"] = _usage_perplexity(counts)
        if controls:
            result["nll_dense_given_u"] = sums["nll_dense_given_u"] / tokens
            result["nll_dense"] = sums["nll_dense"] / max(1.0, sums["dense_tokens"])
            for key in controls_of(model):
                result[f"delta_nll_{key}"] = sums[f"control_{key}"] / tokens - nll
            if beam:
                result["nll_zstar"] = sums["nll_zstar"] / tokens
                if beam > 1:
                    result["estep_margin"] = sums["estep_margin"] / rows
        if sums.get("steps"):
            result["cos_soft_hard"] = sums["cos_soft_hard"] / sums["steps"]
        return result
