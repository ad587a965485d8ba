"""Searching for plans (docs/planner_executor.md, "Hard-EM"): beam search over the planner's typed vocabularies, and
the score ``S(z) = log p(y | z) + log p(z | u)`` of a batch of candidate plans in one batched
teacher-forced forward of the executor and one of the planner.

Beam search keeps the ``k`` most probable partial plans of each row under the planner (``log p(z | u)``
summed over the steps; <EOS_i> forced at ``max_len``). A finished beam carries on unchanged (one
continuation, log-probability 0), so finished and unfinished plans compete on their total score. The
prefix ``[u, <PLAN>]`` runs once per row; its KV cache is repeated for the beams and reordered with
them at every step. With MTP concepts the beam scores each step with the head that writes it (so its
log p(z | u) is the MTP planner's); the E-step's ``score_plans`` re-scores the candidates with the
next-step head in one teacher-forced forward.

Nothing is read back (``concept.syncs``): the search runs a fixed number of steps (every beam has ended by the
last, forced, ``<EOS>``; a finished beam carries on unchanged, so the plans are those an early stop would give),
its widths are Python ints, and the parallel types' joint plans are put together on the device. Its plans are
``settings.max_plan_steps`` steps wide (inactive after their end).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import Plan, text_loss


@torch.no_grad()
def beam_search(model, u_ids, u_valid, k: int) -> tuple[Plan, torch.Tensor]:
    """The ``k`` most probable plans of every row of ``u`` under the planner: (plans of ``B * k`` rows,
    row-major: row b's beams at ``b * k .. b * k + k - 1``, best first, ``settings.max_plan_steps`` steps; their log p(z | u)
    [B, k]). Fewer than ``k`` distinct plans (tiny vocabularies) leave beams at ``-inf``. With parallel types each
    type is searched alone (one chain per type, all in the same forwards) and the ``k`` best joint plans
    are the best sums of one beam per type (the types are independent given u)."""
    if k < 1:
        raise ValueError(f"beam width k must be >= 1, got {k}")
    if not model.settings.parallel:
        return _beam(model, u_ids, u_valid, k)
    n, B, dev = model.num_types, u_ids.shape[0], u_ids.device
    chains, logp = _beam(model, u_ids, u_valid, k, chains=n)  # rows (b, type i, beam j), row-major
    logp = logp.view(B, n, k)
    score, picks = logp[:, 0], torch.arange(k, device=dev)[None, :, None].expand(B, k, 1)  # picks: a beam per type
    for i in range(1, n):  # the k best sums so far x the k beams of type i
        total = (score[:, :, None] + logp[:, i, None, :]).flatten(1)
        score, flat = total.topk(k, dim=-1)
        kept = picks.gather(1, torch.div(flat, k, rounding_mode="floor")[..., None].expand(-1, -1, i))
        picks = torch.cat([kept, (flat % k)[..., None]], dim=-1)
    first = (torch.arange(B, device=dev)[:, None, None] * n + torch.arange(n, device=dev)) * k  # chain (b, i)'s beam 0
    # each plan's n chains joined type by type at a fixed width (a stable sort on the device: nothing read)
    return chains.select((first + picks).flatten()).join_types(n, model.settings.max_plan_steps), score


def _beam(model, u_ids, u_valid, k: int, chains: int = 0) -> tuple[Plan, torch.Tensor]:
    """Beam search over the types in order; ``chains`` > 0: every row becomes one row per type first
    (row ``b * chains + i`` searching type ``i`` alone), as the parallel planner plans. With MTP concepts
    (``planner.mtp`` m > 1) the steps come in groups of m, as the greedy planner writes them: step j of a
    group is scored by head j on the group's start state, the beams are pruned after every step, and the
    group's m steps then run in one forward (so a search takes ⌈steps / m⌉ forwards)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    h, keys, next_pos, cur, last = model.prefix(u_ids, u_valid, cache, chains)
    B, dev, n = h.shape[0], h.device, model.num_types
    h, keys, next_pos, cur, last = (t.repeat_interleave(k, 0) for t in (h, keys, next_pos, cur, last))
    cache.batch_repeat_interleave(k)
    score = torch.full((B, k), float("-inf"), device=dev)
    score[:, 0] = 0.0  # one live beam per row at the start
    score = score.flatten()
    count, done = torch.zeros_like(cur), torch.zeros(B * k, dtype=torch.bool, device=dev)
    hist_c, hist_t, hist_a = [], [], []
    width = max(t.size for t in model.settings.types) + 1  # (Python ints: the ``sizes`` buffer would be read back)
    cols = torch.arange(width, device=dev)[None, :]
    # every beam has ended by then (each type's max_len forces its <EOS>): a fixed number of steps, nothing read
    settings = model.settings
    max_steps = settings.max_chain_steps if chains else settings.max_plan_steps
    heads, step = model.settings.mtp, 0
    while step < max_steps:
        group, fed = [], []  # the group's step embeddings and which beams took each step
        for j in range(heads):
            if j and step >= max_steps:
                break
            state = h if j == 0 else model.mtp_heads.state(h, j - 1)
            total = (score[:, None] + _step_logp(model, state, cur, count, done, cols)).view(B, k * width)
            score, flat = total.topk(k, dim=-1)
            beam = torch.div(flat, width, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k
            beam, classes, score = beam.flatten(), (flat % width).flatten(), score.flatten()
            cur, count, done, next_pos, keys, last, h = (x[beam] for x in (cur, count, done, next_pos, keys, last, h))
            hist_c, hist_t, hist_a = [c[beam] for c in hist_c], [c[beam] for c in hist_t], [c[beam] for c in hist_a]
            group, fed = [e[beam] for e in group], [f[beam] for f in fed]
            cache.reorder_cache(beam)
            active = ~done
            classes = torch.where(active, classes, torch.full_like(classes, -1))
            types = torch.where(active, cur, torch.full_like(cur, -1))
            hist_c.append(classes), hist_t.append(types), hist_a.append(active)
            is_eos = active & (classes == model.sizes[cur.clamp(max=n - 1)])
            count = torch.where(is_eos, torch.zeros_like(count), count + active.long())
            cur = cur + is_eos.long()
            done = done | (cur > last)
            rank = torch.where(active & ~is_eos, count, torch.zeros_like(count))
            group.append(model.step_embedding(classes, types, rank=rank)[0])
            fed.append(active)
            step += 1
        if step >= max_steps:  # (every beam has ended)
            break
        h, keys, next_pos = model.feed(group, fed, keys, next_pos, cache)  # the group in one forward
    classes, types, active = torch.stack(hist_c, 1), torch.stack(hist_t, 1), torch.stack(hist_a, 1)
    is_eos = active & (classes == model.sizes[types.clamp(min=0)])
    rank = torch.where(active & ~is_eos, _rank(types, active & ~is_eos, n), torch.zeros_like(classes))
    return Plan(classes, types, active, rank, is_eos), score.view(B, k)


def _step_logp(model, state, cur, count, done, cols) -> torch.Tensor:
    """Each beam's log-probabilities of its next class [beams, width]: a type at its ``max_len`` may only end
    (``<EOS>``); a finished beam carries on unchanged (class 0 at no cost, every other class impossible)."""
    t = cur.clamp(max=model.num_types - 1)
    forced = count >= model.max_lens[t]
    logp = F.log_softmax(model.plan_logits(state, t, count).float().masked_fill(
        forced[:, None] & (cols < model.sizes[t][:, None]), float("-inf")), dim=-1)
    return torch.where(done[:, None], torch.where(cols == 0, 0.0, float("-inf")), logp)


def _rank(types, concepts, n: int) -> torch.Tensor:
    """1-based place of each concept inside its type's block (``n`` types; ``F.one_hot`` would read the range)."""
    onehot = (types.clamp(min=0)[..., None] == torch.arange(n, device=types.device)) & concepts[..., None]
    onehot = onehot.long()
    return (onehot.cumsum(1) * onehot).sum(-1)


@dataclass
class Scores:
    """S(z) = log p(y | z) + log p(z | u) of candidate plans (summed over tokens / steps), [B, C] each."""
    text: torch.Tensor  # log p(y | z)
    plan: torch.Tensor  # log p(z | u)

    @property
    def total(self) -> torch.Tensor:
        return self.text + self.plan


@torch.no_grad()
def score_plans(model, u_ids, u_valid, y_ids, y_valid, candidates: Plan, per_row: int) -> Scores:
    """Score ``per_row`` candidate plans for every row (``candidates``: ``B * per_row`` rows, row-major)
    in one batched teacher-forced forward of the planner and one of the executor."""
    rep = lambda t: t.repeat_interleave(per_row, 0)  # noqa: E731
    B = u_ids.shape[0]
    forced = model.planner_forced(rep(u_ids), rep(u_valid), candidates)
    logp = F.log_softmax(forced.logits.float(), dim=-1)
    # max_len forces its <EOS>: the planner's own distribution there is not part of p(z | u)
    step = logp.gather(-1, candidates.classes.clamp(min=0)[..., None]).squeeze(-1)
    step = torch.where(candidates.active & ~forced.forced, step, torch.zeros_like(step))
    logits = model.executor(candidates, rep(y_ids), rep(y_valid), embeds=forced.embeds)
    text = -text_loss(logits, rep(y_ids), rep(y_valid), reduction="none").sum(1)
    return Scores(text.view(B, per_row), step.sum(1).view(B, per_row))
