"""The streaming model's residual stream runs in the backbone's compute dtype (issue 39): with the frozen base
stored in bf16 and bf16 autocast, every decoder layer of the three stacks reads a bf16 hidden state, as a dense
model's layers do. The concept inputs are made by trainable fp32 modules (the vocabulary's embeddings, the
identity start's gate, a latent-feedback sampler's mix, a per-type position scheme's type rows, the bridge)
and join the stream cast to its dtype (``ConceptEmission.concept_inputs``); before, they joined in fp32 and
promoted the middle and deep stacks' stream (and the deep input's ``cat`` promoted the tail with it).

Checked with a forward pre-hook on every decoder layer, in a training forward and backward with concepts in
every stack, over builds that exercise each module that makes a concept input. Negative control: the fp32
join (the concept inputs left in their modules' dtype, the code before) is caught in the middle and deep
layers. What the change does to the values, bf16 only (fp32 runs are unchanged: the cast is a no-op there, the
exactness suite's part, ``tests/test_equivalence.py`` and the others): the middle and deep stacks' residual
stream rounds to bf16 at every layer, as a dense bf16 model's does. With the base stored in bf16 the one-pass
forward stays within ``tests/test_bf16.py``'s tolerance (3% of the logits' range) of the fp32 per-step
reference and of the per-step reference run in bf16, and step-wise decoding of teacher forcing; their
negative controls (another decision pattern, an off-by-one position) fall outside it. With every token a
concept the bf16 model is now the dense bf16 backbone bit for bit (the identity start's invariant, which
held in fp32 only); the fp32 join is not.
"""
from __future__ import annotations

import copy

import pytest
import torch

import concept
from concept import ComponentRef
from concept.backbone import decoder
from concept.precision import store_frozen_base
from concept.streaming.emission import ConceptEmission
from tests.conftest import POLICIES, mixed_model, randomize_new_modules, tiny_config
from tests.reference import reference_logits
from tests.test_bf16 import TOLERANCE, within
from tests.test_equivalence import padded_batch, pattern

pytestmark = pytest.mark.usefixtures("one_thread")

BUILDS = {
    "default": {},  # identity start, `embedding` vocabulary, gumbel-st, `time` positions, no tail fusion
    "every-module": dict(positions="per-type", policy=POLICIES["threshold"],  # a gated policy's straight-through
                         vocabulary=ComponentRef("codebook", {"size": 16, "code_dim": 8, "levels": 2}),
                         sampler=ComponentRef("hidden-projection"), concept_input="identity-scaled",
                         tail_fusion=ComponentRef("bridge", {"hidden": 8})),
    "embedding-update": dict(concept_input="embedding", tail_fusion=ComponentRef("update")),
}


def bf16_base(model):
    """A copy of ``model`` with its frozen base stored in bf16 (what ``--dtype bf16`` trains)."""
    model = copy.deepcopy(model)
    store_frozen_base(model, torch.bfloat16)
    return model


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_models():
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            cache[name] = randomize_new_modules(concept.build(tiny_config(**BUILDS[name])))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def models(fp32_models):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = bf16_base(fp32_models(name)).train()
        return cache[name]

    return get


def layer_input_dtypes(model) -> list[torch.dtype]:
    """The dtype of the hidden state each decoder layer reads (backbone order) in a bf16-autocast training
    forward and backward over 2 x 12 tokens, every third token emitting a concept."""
    seen: dict[int, torch.dtype] = {}
    layers = decoder(model.backbone).layers

    def record(index):
        def hook(module, args, kwargs):
            seen.setdefault(index, (args[0] if args else kwargs["hidden_states"]).dtype)
        return hook

    hooks = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = (torch.arange(12) % 3 == 2).expand(2, 12)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, keep=keep, labels=ids)
        out.loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    model.zero_grad(set_to_none=True)
    assert out.layout.num_concepts > 0 and sorted(seen) == list(range(len(layers)))  # every stack ran
    return [seen[i] for i in range(len(layers))]


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_stack_of_a_bf16_streaming_forward_runs_in_bf16(models, build):
    assert layer_input_dtypes(models(build)) == [torch.bfloat16] * 6


def test_negative_control_the_fp32_join_is_caught(models, monkeypatch):
    joined = ConceptEmission.concept_inputs
    monkeypatch.setattr(ConceptEmission, "concept_inputs", lambda self, *a, **kw: joined(self, *a, **kw).float())
    dtypes = layer_input_dtypes(models("default"))
    assert dtypes[:2] == [torch.bfloat16] * 2  # the shallow stack: the embedding's dtype
    assert dtypes[2:] == [torch.float32] * 4  # middle and deep: promoted by the fp32 concept inputs


@pytest.mark.parametrize("build", ["default", "every-module"])
def test_a_bf16_base_forward_matches_the_per_step_reference_within_bf16(fp32_models, build):
    model = fp32_models(build).eval()
    stored = bf16_base(model).eval()
    ids, mask, keep = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)  # fp32
        with bf16():
            out = stored(ids, attention_mask=mask, keep=keep)
            step_wise, _ = reference_logits(stored, ids, attention_mask=mask, keep=keep)  # the oracle, in bf16
            wrong = stored(ids, attention_mask=mask, keep=keep ^ pattern("rate-0.5")[None])
    assert out.logits.dtype == torch.bfloat16
    assert within(out.logits[real], ref[real]) < TOLERANCE
    assert within(out.logits[real], step_wise[real].float()) < TOLERANCE
    assert within(wrong.logits[real], ref[real]) > 2 * TOLERANCE  # the tolerance tells a real error apart


def test_bf16_base_decoding_equals_teacher_forcing_within_bf16():
    model = bf16_base(mixed_model("fixed"))  # decisions by position: bf16 cannot flip them
    prompts = [[5, 17, 3, 44, 9], [8, 2, 61]]
    with torch.no_grad(), bf16():
        gen = model.generate(prompts, max_new_tokens=7, output_logits=True)
        for b, p in enumerate(prompts):
            assert any(gen.keep[b])  # concepts in the decoded part: the middle stack ran step by step
            seq = torch.tensor([p + gen.tokens[b]])
            forced = model(seq, keep=torch.tensor([gen.keep[b] + [False]])).logits[0].float()
            n = len(gen.tokens[b])
            step = gen.logits[b, :n].float()
            assert within(step, forced[len(p) - 1:len(p) - 1 + n]) < TOLERANCE
            assert within(step, forced[len(p) - 2:len(p) - 2 + n]) > 2 * TOLERANCE  # an off-by-one position


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_keep_all_in_bf16_is_the_dense_bf16_backbone_bit_for_bit(backend, monkeypatch):
    """The identity start's invariant (every token a concept: the backbone; §7a) now holds in bf16 exactly, as
    in fp32: the stacks see the dense model's bf16 states. Negative control: the fp32 join is off by bf16's
    rounding (the middle and deep layers computed on fp32 states)."""
    model = bf16_base(concept.build(tiny_config(attention=backend))).eval()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    every = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad(), bf16():
        dense = model.backbone(ids).logits
        assert torch.equal(model(ids, keep=every).logits, dense)
        joined = ConceptEmission.concept_inputs
        monkeypatch.setattr(ConceptEmission, "concept_inputs", lambda self, *a, **kw: joined(self, *a, **kw).float())
        assert not torch.equal(model(ids, keep=every).logits, dense)
