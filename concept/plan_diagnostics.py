"""Held-out evaluation of the planner-executor (SPEC §2.6 item "Evaluation", §2.7), from the same batches
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
  ``usage_perplexity/<type>`` (exp of the entropy of the used concept ids: 1 = collapse);
* with ``controls``: ``delta_nll_shuffle`` (plans permuted across the batch), ``delta_nll_mask`` (every
  concept's embedding zeroed, the separators and types kept) and ``delta_nll_random`` (random ids, same
  lengths and types), each the NLL under that plan minus ``nll``. > 0 means the plan carries information.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from .planner_executor import Plan, text_loss
from .teacher import adapters_disabled


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
    e = model.step_embedding(plan.classes, plan.types)[0]
    zero = model.positions.add_types(torch.zeros_like(e), plan.types.clamp(min=0) + 1)
    return torch.where(plan.concepts[..., None], zero, e)


def frozen_logits(model, ids, valid) -> torch.Tensor:
    """[B, T, V] next-token logits of the frozen backbone (adapters off) on ``ids``."""
    from .attention import CausalPlan
    from .model import run_layers
    from .packing import time_positions

    inner = model.inner
    with adapters_disabled(model.backbone):
        h = run_layers(inner.layers, inner.embed_tokens(ids), time_positions(valid), CausalPlan(valid), inner.rotary_emb)
        return model.backbone.lm_head(inner.norm(h))


def dense_given_u(model, u, u_valid, y, y_valid) -> torch.Tensor:
    """[B, Ty] NLL of y under the frozen backbone reading [u ; y]."""
    logits = frozen_logits(model, torch.cat([u, y], 1), torch.cat([u_valid, y_valid], 1))
    return text_loss(logits[:, u.shape[1] - 1: -1], y, y_valid, reduction="none")


def dense_alone(model, y, y_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """NLL of y_1.. under the frozen backbone reading y alone, and the mask of those tokens."""
    mask = y_valid[:, 1:] & y_valid[:, :-1]
    return text_loss(frozen_logits(model, y, y_valid)[:, :-1], y[:, 1:], mask, reduction="none"), mask


@torch.no_grad()
def evaluate_planned(model, batches, bucket: int = 64, controls: bool = True, seed: int = 0) -> dict:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    names = [t.name for t in model.settings.types]
    sums: dict[str, float] = defaultdict(float)
    by_bucket: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    used = [torch.zeros(int(k), dtype=torch.float64) for k in model.sizes.tolist()]
    try:
        for batch in batches:
            ids = batch["input_ids"].to(device)
            mask = batch.get("attention_mask")
            valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.to(device).bool()
            u, u_valid, y, y_valid = model.split_example(ids, valid)
            plan = model.planner(u, u_valid, sample=False)
            nll = _score(model, plan, y, y_valid)
            n = float(y_valid.sum())
            sums["nll"] += float(nll[y_valid].sum())
            sums["tokens"] += n
            index = (torch.cumsum(y_valid.long(), 1) - 1)[y_valid] // bucket
            for b, v in zip(index.tolist(), nll[y_valid].tolist()):
                by_bucket[b][0] += v
                by_bucket[b][1] += 1
            sums["nll_nothing"] += float(_score(model, empty_plan(model, len(ids), device), y, y_valid)[y_valid].sum())
            if controls:  # the frozen backbone's references (two extra forwards): not in the trainer's periodic eval
                sums["nll_dense_given_u"] += float(dense_given_u(model, u, u_valid, y, y_valid)[y_valid].sum())
                alone, alone_mask = dense_alone(model, y, y_valid)
                sums["nll_dense"] += float(alone[alone_mask].sum())
                sums["dense_tokens"] += float(alone_mask.sum())
            lengths = plan.lengths(model.num_types).float()
            sums["rows"] += len(ids)
            sums["plan_len"] += float(lengths.sum())
            sums["plan_per_token"] += float((lengths.sum(1) / u_valid.sum(1).clamp(min=1)).sum())
            probs = torch.softmax(plan.logits.float(), dim=-1)
            for i, name in enumerate(names):
                sums[f"plan_len/{name}"] += float(lengths[:, i].sum())
                at = plan.concepts & (plan.types == i)
                p = probs[at][:, : int(model.sizes[i])]
                p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
                sums[f"entropy/{name}"] += float(-(p * p.clamp_min(1e-12).log()).sum(-1).sum())
                sums[f"max_prob/{name}"] += float(p.max(-1).values.sum())
                sums[f"steps/{name}"] += float(at.sum())
                used[i] += torch.bincount(plan.classes[at].cpu(), minlength=len(used[i])).double()
            if controls:
                perm = torch.roll(torch.arange(len(ids), device=device), 1)
                for key, score in (("shuffle", lambda: _score(model, plan.select(perm), y, y_valid)),
                                   ("mask", lambda: _score(model, plan, y, y_valid, embeds=masked_embeds(model, plan))),
                                   ("random", lambda: _score(model, random_plan(model, plan, generator), y, y_valid))):
                    sums[f"control_{key}"] += float(score()[y_valid].sum())
    finally:
        model.train(was_training)
    tokens, rows = max(1.0, sums["tokens"]), max(1.0, sums["rows"])
    nll = sums["nll"] / tokens
    result = {"tokens": int(sums["tokens"]), "nll": nll, "bits_per_token": nll / math.log(2),
              "perplexity": math.exp(min(nll, 50.0)),
              "nll_nothing": sums["nll_nothing"] / tokens,
              "plan_len": sums["plan_len"] / rows, "plan_per_token": sums["plan_per_token"] / rows,
              "nll_by_position": {f"{b * bucket}-{(b + 1) * bucket}": s / c for b, (s, c) in sorted(by_bucket.items())},
              "tokens_by_position": {f"{b * bucket}-{(b + 1) * bucket}": int(c) for b, (s, c) in sorted(by_bucket.items())},
              "task": model.task}
    for i, name in enumerate(names):
        steps = max(1.0, sums[f"steps/{name}"])
        result[f"plan_len/{name}"] = sums[f"plan_len/{name}"] / rows
        result[f"entropy/{name}"] = sums[f"entropy/{name}"] / steps
        result[f"max_prob/{name}"] = sums[f"max_prob/{name}"] / steps
        share = used[i] / used[i].sum().clamp_min(1)
        result[f"usage_perplexity/{name}"] = float(torch.exp(-(share * share.clamp_min(1e-12).log()).sum()))
    if controls:
        result["nll_dense_given_u"] = sums["nll_dense_given_u"] / tokens
        result["nll_dense"] = sums["nll_dense"] / max(1.0, sums["dense_tokens"])
        for key in ("shuffle", "mask", "random"):
            result[f"delta_nll_{key}"] = sums[f"control_{key}"] / tokens - nll
    return result
