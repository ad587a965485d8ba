"""The streaming model's residual stream runs in the backbone's compute dtype (issue 39): with the frozen base
stored in bf16 and bf16 autocast, every decoder layer of the three stacks reads a bf16 hidden state, as a dense
model's layers do. The concept inputs are made by trainable fp32 modules (the vocabulary's embeddings, the
identity start's gate, a latent-feedback sampler's mix, a per-type position scheme's type rows, the bridge)
and join the stream cast to its dtype (``ConceptEmission.concept_inputs``); before, they joined in fp32 and
promoted the middle and deep stacks' stream (and the deep input's ``cat`` promoted the tail with it).

Checked with a forward pre-hook on every decoder layer, in a training forward and backward with concepts in
every stack, over builds that exercise each module that makes a concept input. Negative control: the fp32
join (the concept inputs left in their modules' dtype, the code before) is caught in the middle and deep
layers. That fp32 runs are unchanged (the cast is a no-op there) is the exactness suite's part
(``tests/test_equivalence.py`` and the others); the values in bf16 against the fp32 reference are
``tests/test_bf16.py``'s.
"""
from __future__ import annotations

import pytest
import torch

import concept
from concept import ComponentRef
from concept.backbone import decoder
from concept.precision import store_frozen_base
from concept.streaming.emission import ConceptEmission
from tests.conftest import POLICIES, randomize_new_modules, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

BUILDS = {
    "default": {},  # identity start, `embedding` vocabulary, gumbel-st, `time` positions, no tail fusion
    "every-module": dict(positions="per-type", policy=POLICIES["threshold"],  # a gated policy's straight-through
                         vocabulary=ComponentRef("codebook", {"size": 16, "code_dim": 8, "levels": 2}),
                         sampler=ComponentRef("hidden-projection"), concept_input="identity-scaled",
                         tail_fusion=ComponentRef("bridge", {"hidden": 8})),
    "embedding-update": dict(concept_input="embedding", tail_fusion=ComponentRef("update")),
}


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            model = randomize_new_modules(concept.build(tiny_config(**BUILDS[name])))
            store_frozen_base(model, torch.bfloat16)
            cache[name] = model.train()
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
