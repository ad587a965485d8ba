"""Planner speed-ups (docs/planner_executor.md): parallel types (every type planned at once, independent given u) and MTP
concepts (several concept tokens per planner forward). Each is checked against the plain planner."""
import copy

import pytest
import torch
from torch import nn

import concept
from concept.errors import ConfigError
from concept.planner.search import beam_search
from concept.planner.model import Plan, PlannerSettings
from concept.syncs import HostSyncs

from .reference import join_types_read
from .test_planner_executor import TYPES, built, check_beam_search, pe_config
from .test_planner_executor import plan_inputs as inputs


def planner_forwards(model, u, valid):
    calls = []
    hook = model.inner.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            plan = model.planner(u, valid, sample=False)
    finally:
        hook.remove()
    return plan, len(calls)


def same_logits(a, b, atol=1e-5):
    """Equal within ``atol`` where finite, and infinite at the same places; a NaN anywhere fails."""
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[a.isinf()], b[b.isinf()])
    finite = torch.isfinite(a)
    assert (a[finite] - b[finite]).abs().max() < atol


def only_type(model, i):
    """The planner of type ``i`` alone: the same weights, a one-type model (sequential)."""
    one = copy.deepcopy(model)
    t = model.settings.types[i]
    one.settings = PlannerSettings(types=[t], parallel=False)
    one.vocabularies = nn.ModuleList([model.vocabularies[i]])
    one.sizes, one.max_lens = model.sizes[i:i + 1].clone(), model.max_lens[i:i + 1].clone()
    n = model.num_types
    with torch.no_grad():
        rows = torch.tensor([0, 1 + i, 1 + n + i])  # <PLAN>, <SEP_i>, <EOS_i>
        one.specials.table = nn.Embedding.from_pretrained(model.specials.table.weight[rows].clone(), freeze=False)
        one.specials.num_types = 1
        emb = model.positions.type_embedding.weight[torch.tensor([0, 1 + i])]
        one.positions.type_embedding = nn.Embedding.from_pretrained(emb.clone(), freeze=False)
    return one


def test_parallel_types_equal_the_sequential_planner_of_each_type_alone():
    model = built(parallel=True)
    u, valid = inputs()
    with torch.no_grad():
        plan = model.planner(u, valid, sample=False)
        for i in range(2):
            alone = only_type(model, i).planner(u, valid, sample=False)
            mine = plan.concepts & (plan.types == i)
            assert [[c for t, c in row if t == i] for row in plan.rows()] == [[c for _, c in r] for r in alone.rows()]
            at = plan.active & (plan.types == i)
            same_logits(plan.logits[at][:, : 1 + TYPES[i]["size"]], alone.logits[alone.active][:, : 1 + TYPES[i]["size"]])
            assert mine.sum() == alone.concepts.sum()


def test_one_type_parallel_is_the_sequential_planner():
    types = [{"name": "gist", "size": 16, "max_len": 4}]
    sequential, parallel = built(types=types), built(types=types, parallel=True)
    parallel.load_state_dict(sequential.state_dict())
    u, valid = inputs()
    with torch.no_grad():
        a, b = sequential.planner(u, valid, sample=False), parallel.planner(u, valid, sample=False)
    assert a.rows() == b.rows()
    same_logits(a.logits[a.active], b.logits[b.active])


def test_parallel_types_plan_in_fewer_forwards_and_force_exactly():
    model = built(parallel=True)
    u, valid = inputs()
    plan, forwards = planner_forwards(model, u, valid)
    assert forwards <= 1 + max(t["max_len"] for t in TYPES) + 1  # prefix + the longest type, not the sum
    with torch.no_grad():
        forced = model.planner_forced(u, valid, plan)  # one forward for every chain: decode = teacher forcing
    same_logits(plan.logits[plan.active], forced.logits[plan.active])
    assert torch.equal(plan.forced & plan.active, forced.forced & plan.active)
    rows = [[(0, 1), (0, 2), (1, 3)], [], [(1, 1)] * 4]
    p = Plan.from_rows(rows, (8, 16))
    assert p.split_types(2).join_types(2, p.classes.shape[1]).rows() == rows


def test_parallel_beam_search_is_the_best_joint_plans():
    model = built(parallel=True)
    check_beam_search(model, *inputs(), 3)


def test_parallel_trains_with_gradients_to_every_type():
    model = built(parallel=True).train()
    u, valid = inputs()
    out = model(u, attention_mask=valid, labels=u)
    out.loss.backward()
    for i in range(2):
        grad = model.vocabularies[i].table.weight.grad if hasattr(model.vocabularies[i], "table") else None
        assert grad is not None and grad.abs().sum() > 0, i
    model.zero_grad()


def sampled_forward(model, u, valid):
    """The training forward (the Gumbel sampler seeded) counted, its loss's gradients: (output, counter, grads)."""
    model.zero_grad()
    torch.manual_seed(3)
    with HostSyncs() as seen:
        out = model(u, attention_mask=valid, labels=u)
    out.loss.backward()
    return out, seen, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_parallel_sampling_joins_its_chains_without_a_read(monkeypatch):
    """The sampling planner with parallel types joins its chains at a fixed width (``Plan.join_types``: nothing
    read) instead of the declared ``plan join`` (its width and steps' places read back: the reference, kept in
    tests/reference.py): the same plans (padded after), logits, loss and gradients. Negative control: a join at the
    chains' own width (too narrow: it drops steps) is caught."""
    model = built(parallel=True).train()
    u, valid = inputs()
    out, seen, grads = sampled_forward(model, u, valid)
    join = Plan.join_types
    with monkeypatch.context() as m:
        m.setattr(Plan, "join_types", lambda self, n, width: join_types_read(self, n))
        ref, ref_seen, ref_grads = sampled_forward(model, u, valid)
    assert "plan join" not in seen.declared and ref_seen.declared["plan join"] == 1
    assert seen.hidden == ref_seen.hidden == 0 and seen.declared["plan end check"] >= 1
    width = ref.plan.classes.shape[1]
    assert out.plan.classes.shape[1] >= width and not out.plan.active[:, width:].any()
    for name in ("classes", "types", "active", "rank", "is_eos", "logits", "embeds"):
        assert torch.allclose(getattr(out.plan, name)[:, :width], getattr(ref.plan, name)), name
    assert torch.allclose(out.logits, ref.logits, atol=1e-5) and torch.allclose(out.loss, ref.loss, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) > 2
    assert all(torch.allclose(grads[k], ref_grads[k], atol=1e-6) for k in grads)
    with monkeypatch.context() as m:  # negative control
        m.setattr(Plan, "join_types", lambda self, n, width: join(self, n, self.classes.shape[1]))
        narrow, _, _ = sampled_forward(model, u, valid)
    assert width > narrow.plan.classes.shape[1] and not torch.allclose(narrow.logits, ref.logits, atol=1e-3)


@pytest.mark.parametrize("planner, message", [
    ({"parallel": "yes"}, "true or false"), ({"mtp": 0}, "k >= 1"), ({"mtp": 2, "parallel": True}, "do not combine"),
])
def test_bad_speedup_options(planner, message):
    with pytest.raises(ConfigError, match=message):
        concept.build(pe_config(**planner))


def test_mtp_with_one_head_is_the_plain_planner():
    model = built(mtp=1)
    assert model.mtp_heads is None
    u, valid = inputs()
    plan, forwards = planner_forwards(model, u, valid)
    with torch.no_grad():
        forced = model.planner_forced(u, valid, plan)
        greedy, _ = beam_search(model, u, valid, 1)
    assert plan.rows() == greedy.rows() and (plan.head == 0).all()
    same_logits(plan.logits[plan.active], forced.logits[plan.active])
    assert forwards == plan.active.sum(1).max()  # the prefix, then one forward per step but the last


@pytest.mark.parametrize("k", [2, 3])
def test_mtp_heads_write_k_steps_per_forward_exactly(k):
    model = built(mtp=k)
    with torch.no_grad():  # trained-looking heads (zero at init would copy the next-step head)
        for block in model.mtp_heads.blocks:
            block.weight.normal_(0, 0.2)
    u, valid = inputs()
    plan, forwards = planner_forwards(model, u, valid)
    steps = int(plan.active.sum(1).max())
    assert forwards == -(-steps // k)  # the prefix, then one forward per group of k steps but the last
    assert set(plan.head[plan.active].tolist()) == set(range(k))
    # decode = teacher forcing: step s, written by head j from the state before step s - j
    with torch.no_grad():
        forced = model.planner_forced(u, valid, plan)
        for s in range(steps):
            rows = plan.active[:, s]
            j = plan.head[rows, s]
            assert (j == s % k).all()
            start = forced.hidden[rows, s - int(j[0])]
            state = start if int(j[0]) == 0 else model.mtp_heads.state(start, int(j[0]) - 1)
            same_logits(model.plan_logits(state, plan.types[rows, s]), plan.logits[rows, s])
    assert plan.lengths(2).le(torch.tensor([2, 4])).all()  # max_len holds inside a group too


@pytest.mark.parametrize("k", [2, 3])
def test_mtp_beam_search_scores_each_step_with_its_head(k):
    """Beam search with MTP heads: width 1 is the greedy MTP planner; every beam's log p(z | u) is the sum
    of its steps' log-probabilities under the head that wrote them (head j on the state before the
    group's first step, from the teacher-forced planner), best first; ⌈steps / k⌉ forwards."""
    from concept.planner.search import beam_search

    model = built(mtp=k)
    with torch.no_grad():
        for block in model.mtp_heads.blocks:
            block.weight.normal_(0, 0.2)
    u, valid = inputs()
    calls = []
    hook = model.inner.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            beams, logp = beam_search(model, u, valid, 3)
    finally:
        hook.remove()
    with torch.no_grad():
        greedy, one = model.planner(u, valid, sample=False), beam_search(model, u, valid, 1)[0]
        forced = model.planner_forced(u.repeat_interleave(3, 0), valid.repeat_interleave(3, 0), beams)
        total = torch.zeros(beams.classes.shape[0])
        for s in range(beams.classes.shape[1]):
            j = s % k
            state = forced.hidden[:, s - j] if j == 0 else model.mtp_heads.state(forced.hidden[:, s - j], j - 1)
            step = torch.log_softmax(model.plan_logits(state, beams.types[:, s].clamp(min=0)).float(), -1)
            step = step.gather(-1, beams.classes[:, s].clamp(min=0)[:, None])[:, 0]
            total += torch.where(beams.active[:, s] & ~forced.forced[:, s], step, torch.zeros_like(step))
    assert one.rows() == greedy.rows()
    assert torch.allclose(total.view(-1, 3), logp, atol=1e-4) and (logp[:, :-1] >= logp[:, 1:]).all()
    assert len(calls) == -(-beams.classes.shape[1] // k)  # the prefix, then one forward per group but the last


def test_mtp_objective_trains_the_heads_on_later_steps():
    from concept.planner.objectives import PlanMTPObjective

    model = built(mtp=2).train()
    u, valid = inputs()
    plan = Plan.from_rows([[(0, 1), (1, 3), (1, 4)], [(1, 2)], [(0, 0), (0, 1), (1, 1)]], (8, 16))
    out = model(u, attention_mask=valid, labels=u, plan=plan)
    term = PlanMTPObjective(0.5)(model, {"input_ids": u, "attention_mask": valid}, out)
    p = out.plan
    mask = p.active[:, 1:] & ~p.forced[:, 1:]
    state = model.mtp_heads.state(p.hidden[:, :-1][mask].detach(), 0)
    logp = torch.log_softmax(model.plan_logits(state, p.types[:, 1:][mask]).float(), -1)
    assert torch.allclose(term, -0.5 * logp.gather(-1, p.classes[:, 1:][mask][:, None]).mean())
    term.backward()
    assert model.mtp_heads.blocks[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.backbone.named_parameters() if "lora_" in n)  # reads, never changes
    model.zero_grad()
