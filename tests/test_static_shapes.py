"""Static shapes (``BuildConfig.max_ratio``): a row's n-th real token keeps its boundary only while the row has
fewer than ceil(max_ratio * n) before it (``packing.cap_boundaries``), so the packed layout, the stacks'
inputs and the attention plans have shapes fixed by (B, T, build). Checked: the cap against its step rule;
the shapes against varying decisions (negative control: the dynamic layout); the one-pass forward against
the naive reference at and below the cap for every policy and backend; decoding = teacher forcing at the
cap (negative control: a decoder that ignores it)."""
from contextlib import contextmanager

import pytest
import torch

import concept.packing as packing
from concept.streaming.decoding import ConceptDecoder
from plugins.attention.chunked import ChunkedBackend, ChunkedConfig
from plugins.attention.flex import FlexBackend, FlexConfig
from plugins.attention.sdpa import SDPABackend
from plugins.attention.xformers import XFormersBackend, XFormersConfig
from tests.conftest import POLICIES, assert_decoding_matches_teacher_forcing, mixed_model
from tests.reference import reference_logits

# flex: forward only on CPU (eager here); xformers: its layouts with the reference kernel
BACKENDS = {"sdpa": SDPABackend(), "chunked": ChunkedBackend(ChunkedConfig(4)), "flex": FlexBackend(FlexConfig(False)),
            "xformers": XFormersBackend(XFormersConfig(kernel="reference"))}
CAP = 0.2  # binds on these inputs for every policy (about 30% of the tokens would emit)
# the default suite: the default policy, one emitting several slots per boundary, a tracked confidence policy;
# every policy with `make test-slow`
QUICK = {"null", "fixed-emit2", "mtp"}
EVERY_POLICY = [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in POLICIES]
DECODED = [p if p in QUICK - {"mtp"} else pytest.param(p, marks=pytest.mark.slow) for p in POLICIES]


@contextmanager
def budgeted(model, max_ratio, attention=None):
    """The shared tiny model (``mixed_model``, one build per policy) with another budget / backend for a while:
    the budget and the backend are plain attributes (no weights), so every variant has the same weights."""
    saved = model.max_ratio, model.attention
    model.max_ratio, model.attention = max_ratio, attention or model.attention
    try:
        yield model
    finally:
        model.max_ratio, model.attention = saved


def capped_by_steps(keep, valid, max_ratio, before=None, seen=None):
    """The cap one token at a time, as the definition says."""
    out = torch.zeros_like(keep)
    for b in range(keep.shape[0]):
        count = 0 if before is None else int(before[b])
        n = 0 if seen is None else int(seen[b])
        for t in range(keep.shape[1]):
            if valid[b, t]:
                n += 1
                if keep[b, t] and count < packing.budget(n, max_ratio):
                    out[b, t], count = True, count + 1
    return out


@pytest.mark.parametrize("max_ratio", [0.1, 0.25, 1 / 3, 0.5, 1.0])
def test_cap_equals_its_step_rule(max_ratio):
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(8, 40, generator=g) < 0.6
    valid = torch.rand(8, 40, generator=g) < 0.85
    want = capped_by_steps(keep, valid, max_ratio)
    assert torch.equal(packing.cap_boundaries(keep, valid, max_ratio), want)
    counts = torch.cumsum(want.long(), 1)
    assert (counts <= packing.budget(torch.cumsum(valid.long(), 1), max_ratio)).all()  # never over the budget
    seen = torch.randint(5, 12, (8,), generator=g)  # a row's state so far, as decoding reaches it (within budget)
    before = (torch.rand(8, generator=g) * (packing.budget(seen, max_ratio) + 1)).long()
    assert torch.equal(packing.cap_boundaries(keep, valid, max_ratio, before, seen),
                       capped_by_steps(keep, valid, max_ratio, before, seen))


def test_cap_check_catches_an_off_by_one_budget(monkeypatch):
    """Negative control: a budget one boundary larger is not the step rule."""
    g = torch.Generator().manual_seed(0)
    keep, valid = torch.rand(8, 40, generator=g) < 0.6, torch.ones(8, 40, dtype=torch.bool)
    want = capped_by_steps(keep, valid, 0.25)
    exact = packing.budget
    monkeypatch.setattr(packing, "budget", lambda n, r, slack=0: exact(n, r, slack) + 1)
    assert not torch.equal(packing.cap_boundaries(keep, valid, 0.25), want)


def stack_shapes(model, **inputs):
    """The shapes a forward runs on: every stack's input, the packed layout and the deep attention plan."""
    shapes = {}
    def record(name):
        def hook(module, args):
            shapes.setdefault(name, tuple(args[0].shape))
        return hook

    hooks = [stack[0].register_forward_pre_hook(record(name))
             for name, stack in (("shallow", model.shallow), ("middle", model.middle), ("deep", model.deep))]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    plan = model.attention.plan(out.layout)
    shapes["layout"] = [tuple(t.shape) for t in (out.layout.meta.time, out.layout.concept_src, out.layout.tail_src)]
    shapes["plan"] = [tuple(c[-1].shape) for c in plan.chunks] + [getattr(plan.concept_mask, "shape", None)]
    return shapes


def varied_inputs(T=16):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, T), generator=g)
    padded = torch.ones(2, T, dtype=torch.long)
    padded[1, :5] = 0
    docs = torch.tensor([[0] * 4 + [1] * (T - 4), [0] * 9 + [1] * (T - 9)])
    return [dict(input_ids=ids), dict(input_ids=ids.flip(1), attention_mask=padded),
            dict(input_ids=ids, document_ids=docs), dict(input_ids=ids, keep=torch.zeros(2, T, dtype=torch.bool)),
            dict(input_ids=ids, keep=torch.ones(2, T, dtype=torch.bool))]


def test_shapes_depend_on_batch_length_and_build_only():
    model = mixed_model("null", attention="chunked")
    with budgeted(model, 0.25):
        seen = [stack_shapes(model, **inputs) for inputs in varied_inputs()]
    assert all(s == seen[0] for s in seen)
    assert seen[0]["middle"][1] == packing.budget(16, 0.25)  # C = ceil(max_ratio * T) slots
    # negative control: the dynamic layout (no budget) follows the decisions
    assert len({str(stack_shapes(model, **inputs)) for inputs in varied_inputs()}) > 1


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("policy", EVERY_POLICY)
def test_static_forward_matches_naive_at_and_below_the_cap(policy, batch):
    """At the cap: the naive per-t reference (``tests/reference.py``) with the capped decisions, every backend.
    Below it (a budget that never binds): the decisions and logits of the dynamic layout, which the
    equivalence tests hold to the same reference."""
    ids, mask = batch
    valid = mask.bool()
    model = mixed_model(policy, attention="sdpa")
    with torch.no_grad():
        free = model(ids, attention_mask=mask)  # no budget
        with budgeted(model, CAP):
            ref, keep = reference_logits(model, ids, mask)
        assert (keep & ~free.keep).sum() == 0 and bool((keep != free.keep).any())  # the cap binds, only dropping
        for max_ratio, want_keep, want in ((CAP, keep, ref), (1.0, free.keep, free.logits)):
            for backend in BACKENDS.values():
                with budgeted(model, max_ratio, backend):
                    out = model(ids, attention_mask=mask)
                assert out.layout.static and torch.equal(out.keep, want_keep)
                torch.testing.assert_close(out.logits[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_static_gradients_equal_the_dense_mask_backends(batch):
    ids, mask = batch
    grads = []
    model = mixed_model("null", attention="sdpa")
    for backend in ("sdpa", "chunked"):
        model.zero_grad()
        with budgeted(model, CAP, BACKENDS[backend]):
            model(ids, attention_mask=mask).logits[mask.bool()].square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def prompts(lengths=(6, 11, 2), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("policy", DECODED)
def test_decoding_equals_teacher_forcing_at_the_cap(policy):
    model = mixed_model(policy, attention="sdpa")
    with budgeted(model, CAP):
        gen = assert_decoding_matches_teacher_forcing(model, prompts(), 14)
    with torch.no_grad():  # without the budget the same weights decide otherwise: the cap was reached
        assert any(model(torch.tensor([p + gen.tokens[b][:-1]])).keep[0].tolist() != gen.keep[b]
                   for b, p in enumerate(prompts()))


def test_negative_control_a_decoder_without_the_cap_is_caught(monkeypatch):
    model = mixed_model("null", attention="sdpa")
    step = ConceptDecoder.step

    def uncapped(self, *args, **kwargs):
        saved, self.model.max_ratio = self.model.max_ratio, 0.0
        try:
            return step(self, *args, **kwargs)
        finally:
            self.model.max_ratio = saved

    monkeypatch.setattr(ConceptDecoder, "step", uncapped)
    with budgeted(model, CAP), pytest.raises(AssertionError):
        assert_decoding_matches_teacher_forcing(model, prompts(), 14)
