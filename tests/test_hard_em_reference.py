"""Hard-EM's E-step on the device (issue 39, item 4: one declared host sync per step) against the code it replaced,
kept here as the reference: the host E-step (its plans as Python lists, ``Plan.from_rows``) over the beam search
that stopped when every beam had ended (a host sync per planner step). The same plans, cache, statistics, loss and
gradients, on the sequential, MTP and parallel planners, with cached plans that win and lose; negative controls:
a cached plan that does not compete, and an M-step that trains the forced ``<EOS>``."""
import pytest
import torch
import torch.nn.functional as F

from concept.planner import hard_em
from concept.planner.hard_em import CachedPlan, HardEMObjective, example_key
from concept.planner.model import Plan
from concept.planner.search import score_plans
from concept.syncs import HostSyncs

from .reference import join_types_read
from .test_planner_executor import built, plan_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the reference: the code before (commit 815e9ba), host values ------------------------------
@torch.no_grad()
def reference_beam_search(model, u_ids, u_valid, k):
    if not model.settings.parallel:
        return reference_beam(model, u_ids, u_valid, k)
    n, B = model.num_types, u_ids.shape[0]
    chains, logp = reference_beam(model, u_ids, u_valid, k, chains=n)
    rows, logp = chains.rows(), logp.view(B, n, k)
    score, picks = logp[:, 0], [[[j] for j in range(k)] for _ in range(B)]
    for i in range(1, n):
        total = (score[:, :, None] + logp[:, i, None, :]).flatten(1)
        score, flat = total.topk(k, dim=-1)
        picks = [[picks[b][f // k] + [f % k] for f in flat[b].tolist()] for b in range(B)]
    joint = [sum((rows[(b * n + i) * k + j] for i, j in enumerate(pick)), []) for b in range(B) for pick in picks[b]]
    return Plan.from_rows(joint, tuple(model.sizes.tolist()), u_ids.device), score


def reference_beam(model, u_ids, u_valid, k, chains=0):
    from transformers import DynamicCache

    cache = DynamicCache()
    h, keys, next_pos, cur, last = model.prefix(u_ids, u_valid, cache, chains)
    B, dev, n = h.shape[0], h.device, model.num_types
    h, keys, next_pos, cur, last = (t.repeat_interleave(k, 0) for t in (h, keys, next_pos, cur, last))
    cache.batch_repeat_interleave(k)
    score = torch.full((B, k), float("-inf"), device=dev)
    score[:, 0] = 0.0
    score = score.flatten()
    count, done = torch.zeros_like(cur), torch.zeros(B * k, dtype=torch.bool, device=dev)
    hist_c, hist_t, hist_a = [], [], []
    width = int(model.sizes.max()) + 1
    cols = torch.arange(width, device=dev)[None, :]
    max_steps, heads, step = sum(t.max_len + 1 for t in model.settings.types), model.settings.mtp, 0
    while step < max_steps:
        group, fed = [], []
        for j in range(heads):
            if j and (bool(done.all()) or step >= max_steps):
                break
            state = h if j == 0 else model.mtp_heads.state(h, j - 1)
            t = cur.clamp(max=n - 1)
            K = model.sizes[t]
            forced = count >= model.max_lens[t]
            logp = F.log_softmax(model.plan_logits(state, t, count).float().masked_fill(
                forced[:, None] & (cols < K[:, None]), float("-inf")), dim=-1)
            logp = torch.where(done[:, None], torch.where(cols == 0, 0.0, float("-inf")), logp)
            total = (score[:, None] + logp).view(B, k * width)
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
        if bool(done.all()):
            break
        h, keys, next_pos = model.feed(group, fed, keys, next_pos, cache)
    classes, types, active = torch.stack(hist_c, 1), torch.stack(hist_t, 1), torch.stack(hist_a, 1)
    is_eos = active & (classes == model.sizes[types.clamp(min=0)])
    onehot = F.one_hot(types.clamp(min=0), int(types.max().clamp(min=0)) + 1) * (active & ~is_eos)[..., None]
    rank = torch.where(active & ~is_eos, (onehot.cumsum(1) * onehot).sum(-1), torch.zeros_like(classes))
    return Plan(classes, types, active, rank, is_eos), score.view(B, k)


class ReferenceHardEM:
    """The host E-step and the indexed M-step as they were."""

    def __init__(self, beam, every, prior, cache):
        self.beam, self.every, self.prior, self.weight = beam, every, prior, 1.0
        self.cache = {k: CachedPlan(list(v.rows), v.score, v.step) for k, v in cache.items()}
        self.stats = {}

    def prepare(self, model, batch, step):
        u, u_valid, y, y_valid = model.split_example(batch["input_ids"], batch.get("attention_mask"))
        keys = [example_key(u[b][u_valid[b]], y[b][y_valid[b]]) for b in range(u.shape[0])]
        stale = [b for b, key in enumerate(keys) if key not in self.cache or step - self.cache[key].step >= self.every]
        self.stats = dict.fromkeys(hard_em.STATS, 0.0)
        if stale:
            self.estep(model, u, u_valid, y, y_valid, keys, stale, step)
        plan = Plan.from_rows([self.cache[key].rows for key in keys], tuple(model.sizes.tolist()), u.device)
        return {**batch, "plan": plan}

    def estep(self, model, u, u_valid, y, y_valid, keys, rows, step):
        idx = torch.tensor(rows)
        u, u_valid, y, y_valid = u[idx], u_valid[idx], y[idx], y_valid[idx]
        with torch.no_grad():
            beams, beam_logp = reference_beam_search(model, u, u_valid, self.beam)
            old = [self.cache[keys[b]].rows if keys[b] in self.cache else None for b in rows]
            k, per_row, beam_rows = self.beam, self.beam + 1, beams.rows()
            candidates = [z for i, o in enumerate(old)
                          for z in (*beam_rows[i * k:(i + 1) * k], o if o is not None else beam_rows[i * k])]
            plans = Plan.from_rows(candidates, tuple(model.sizes.tolist()), u.device)
            scores = score_plans(model, u, u_valid, y, y_valid, plans, per_row)
            total = scores.text + self.prior * scores.plan
        allowed = torch.cat([torch.isfinite(beam_logp), torch.tensor([[o is not None] for o in old])], 1)
        total = total.masked_fill(~allowed, float("-inf"))
        ranked = total.topk(min(2, per_row), dim=-1)
        for i, b in enumerate(rows):
            best = float(ranked.values[i, 0])
            new = candidates[i * per_row + int(ranked.indices[i, 0])]
            self.cache[keys[b]] = CachedPlan(list(new), best, step)
            second = float(ranked.values[i, -1])
            self.stats["margin"] += best - second if second > float("-inf") else 0.0
            if old[i] is not None:
                self.stats["old"] += 1
                self.stats["flips"] += float(list(new) != [tuple(x) for x in old[i]])
                self.stats["gap"] += best - float(total[i, -1])
        self.stats["rows"] += len(rows)

    def __call__(self, model, batch, out):
        plan = out.plan
        mask = plan.active & ~plan.forced
        logp = F.log_softmax(plan.logits[mask].float(), dim=-1)
        return self.weight * F.nll_loss(logp, plan.classes[mask])


# -- the comparison ----------------------------------------------------------------------------
def batches():
    """Three examples, then the same three again with a fourth, the second twice (a key twice in a batch)."""
    u, valid = plan_inputs(B=4, L=9, seed=3)
    first = {"input_ids": u[:3], "attention_mask": valid[:3]}
    again = {"input_ids": u[[0, 1, 3, 1]], "attention_mask": valid[[0, 1, 3, 1]]}
    return first, again


def seeded_cache(model, batch, beam, prior):
    """A cached plan per example that a beam of ``beam`` does not find: of a wider search's other plans, the best
    under S(z) (rows 0 and 2: it may beat the beam's) or the worst (row 1: it loses)."""
    u, valid = batch["input_ids"], batch["attention_mask"]
    wide = 8
    with torch.no_grad():
        found = reference_beam_search(model, u, valid, beam)[0].rows()
        beams, logp = reference_beam_search(model, u, valid, wide)
        scores = score_plans(model, u, valid, u, valid, beams, wide)
    total = (scores.text + prior * scores.plan).masked_fill(~torch.isfinite(logp), float("nan"))
    rows, cache = beams.rows(), {}
    for b in range(u.shape[0]):
        others = [j for j in range(wide) if rows[b * wide + j] not in found[b * beam:(b + 1) * beam]
                  and not total[b, j].isnan()]
        j = (max if b != 1 else min)(others, key=lambda j: float(total[b, j]))
        cache[example_key(u[b][valid[b]], u[b][valid[b]])] = CachedPlan(rows[b * wide + j], 0.0, 0)
    return cache


def loss_and_grads(model, batch, plan, term):
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"], plan=plan)
    loss = out.loss + term(model, batch, out)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad and p.grad is not None]


def run_both(model, objective, reference):
    """Two E-steps (the seeded cached plans competing; then the first's plans, a fourth example and a key twice) of
    both; returns what differs (empty: the same plans, cache, statistics, loss and gradients) and the reference's
    statistics of each step."""
    problems, seen = [], []
    for step, batch in enumerate(batches()):
        new, ref = objective.prepare(model, batch, step + 1), reference.prepare(model, batch, step + 1)
        stats = {k: float(v) for k, v in objective._stats.items()}
        seen.append(dict(reference.stats))
        if new["plan"].rows() != ref["plan"].rows():
            problems.append(f"step {step}: plans {new['plan'].rows()} != {ref['plan'].rows()}")
        cache = objective.cache
        if sorted(cache) != sorted(reference.cache):
            problems.append(f"step {step}: cache keys")
        for key, entry in reference.cache.items():
            mine = cache.get(key)
            if mine is None or mine.rows != entry.rows or mine.step != entry.step or abs(mine.score - entry.score) > 1e-5:
                problems.append(f"step {step}: cache entry {key[:8]} {mine} != {entry}")
        for key in ("rows", "old", "flips", "margin", "gap"):
            if abs(stats[key] - reference.stats[key]) > 1e-4:
                problems.append(f"step {step}: {key} {stats[key]} != {reference.stats[key]}")
        loss, grads = loss_and_grads(model, batch, new["plan"], objective)
        ref_loss, ref_grads = loss_and_grads(model, batch, ref["plan"], reference)
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
            problems.append(f"step {step}: loss {float(loss)} != {float(ref_loss)}")
        if len(grads) != len(ref_grads) or not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                                                   for a, b in zip(grads, ref_grads)):
            problems.append(f"step {step}: gradients")
    return problems, seen


PLANNERS = {"sequential": {}, "mtp": {"mtp": 2}, "parallel": {"parallel": True}}
_setups = {}


def planner_setup(name):
    """A tiny planner of each kind, its beam, prior and seeded cache (built once per module)."""
    if name not in _setups:
        model = built(**PLANNERS[name])
        beam, prior = 2, 0.0  # (β = 0: cached plans that explain y better than the beam's win)
        _setups[name] = model, beam, prior, seeded_cache(model, batches()[0], beam, prior)
    return _setups[name]


@pytest.fixture(params=list(PLANNERS))
def setup(request):
    return planner_setup(request.param)


@pytest.fixture
def sequential():
    return planner_setup("sequential")


def test_the_device_estep_is_the_host_estep(setup):
    model, beam, prior, cache = setup
    objective = HardEMObjective(1.0, beam=beam, every=1, prior=prior)
    objective.cache = {k: CachedPlan(list(v.rows), v.score, v.step) for k, v in cache.items()}
    reference = ReferenceHardEM(beam, 1, prior, cache)
    problems, stats = run_both(model, objective, reference)
    assert problems == []
    assert stats[0]["old"] == 3 and 0 < stats[0]["flips"] < 3, stats  # cached plans that won and that lost


def test_negative_control_a_cached_plan_that_does_not_compete(sequential, monkeypatch):
    model, beam, prior, cache = sequential
    estep = HardEMObjective.estep

    def without_old(self, model, example, rows, old, has_old, step, keys):
        return estep(self, model, example, rows, old, torch.zeros_like(has_old), step, keys)

    monkeypatch.setattr(HardEMObjective, "estep", without_old)
    objective = HardEMObjective(1.0, beam=beam, every=1, prior=prior)
    objective.cache = {k: CachedPlan(list(v.rows), v.score, v.step) for k, v in cache.items()}
    problems, _ = run_both(model, objective, ReferenceHardEM(beam, 1, prior, cache))
    assert any("plans" in p for p in problems) and any("loss" in p for p in problems), problems


def test_negative_control_an_mstep_that_trains_the_forced_eos(sequential, monkeypatch):
    model, beam, prior, cache = sequential

    def with_forced(self, model, batch, out, teacher=None):
        plan = out.plan
        logp = F.log_softmax(plan.logits.float(), dim=-1).gather(-1, plan.classes.clamp(min=0)[..., None])[..., 0]
        return self.weight * hard_em.pair_mean(-logp, plan.active)

    monkeypatch.setattr(HardEMObjective, "__call__", with_forced)
    objective = HardEMObjective(1.0, beam=beam, every=1, prior=prior)
    objective.cache = {k: CachedPlan(list(v.rows), v.score, v.step) for k, v in cache.items()}
    problems, _ = run_both(model, objective, ReferenceHardEM(beam, 1, prior, cache))
    assert any("loss" in p for p in problems) and not any("plans" in p for p in problems), problems


@pytest.mark.parametrize("name", ["sequential", "parallel"])
def test_the_estep_reads_back_once(name):
    """The E-step's one declared read and the M-step's forward: nothing hidden (parallel types: the teacher-forced
    planner splits and joins its chains at fixed widths); the E-step's plans join the cache at the next read (MTP
    concepts: ``tests/test_recipe_syncs.py``)."""
    model, beam, prior, _ = planner_setup(name)
    objective = HardEMObjective(1.0, beam=beam, every=1, prior=prior)
    first, again = batches()
    for step, batch in enumerate((first, again)):
        with HostSyncs() as seen:
            out = objective.prepare(model, batch, step + 1)
            model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"],
                  plan=out["plan"])
        assert seen.hidden == 0 and dict(seen.declared) == {"hard-EM E-step": 1}, (dict(seen.syncs), seen.declared)
        assert len(objective._new) == 1 and len(objective._cache) == 3 * step  # the plans still on the device
    with HostSyncs() as seen:
        assert len(objective.cache) == 4  # read back when asked (a checkpoint)
    assert dict(seen.declared) == {"hard-EM E-step": 1} and not objective._new


def test_fixed_width_split_and_join_are_the_declared_ones():
    """``Plan.split_types(n, width)`` / ``join_types(n, width)`` (a stable sort, nothing read) against the chains
    of each row's own steps and the declared join (the reference): the same steps and fields, padding after."""
    g = torch.Generator().manual_seed(0)
    pick = lambda n: int(torch.randint(0, n, (), generator=g))  # noqa: E731
    for _ in range(20):
        rows = [[(0, pick(8)) for _ in range(pick(3))] + [(1, pick(16)) for _ in range(pick(5))] for _ in range(3)]
        chains = Plan.from_rows(rows, (8, 16)).split_types(2, 5)
        assert chains.classes.shape[1] == 5
        assert chains.rows() == [[x for x in row if x[0] == i] for row in rows for i in range(2)]
        chains.logits, chains.embeds = torch.randn(6, 5, 17, generator=g), torch.randn(6, 5, 4, generator=g)
        with HostSyncs() as seen:
            fixed = chains.join_types(2, 9)
        declared = join_types_read(chains, 2)
        assert seen.hidden == 0 and not seen.declared and fixed.rows() == rows
        width = declared.classes.shape[1]
        for name in ("classes", "types", "active", "rank", "is_eos", "logits", "embeds"):
            a, b = getattr(declared, name), getattr(fixed, name)
            assert torch.equal(a, b[:, :width]), name
            assert (b[:, width:] == (-1 if name in ("classes", "types") else 0)).all(), name
