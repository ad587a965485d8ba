"""``--compile model`` traces one decoder layer per stack: each layer of a whole forward's graph is a nested compile
region (``concept.compiled._layer_region``), and dynamo stamps the first layer's graph out for the stack's other
layers instead of tracing each (a SmolLM2-shaped forward: 30 layers traced -> 3; torch 2.11 traces each layer and
keeps one body per stack: inductor compiles 3 bodies either way). That needs the layer's inputs to
be tensors, constants and modules: the attention plan is a pytree (``concept.attention.AttentionPattern``), and
``flex`` keeps its BlockMask as tensors.

Checked: one body per stack; per stack, the layers after the first are stamped out (counted where dynamo stamps
them, from torch 2.13), streaming with
``sdpa`` / ``chunked`` / ``flex`` and the dense baseline, with outputs equal to eager; every attention pattern
round-trips through pytree, computing the same attention; slow: inductor's training steps with the regions equal
eager's. Negative controls: with regions off nothing is stamped
out; a plan holding an object pytree cannot flatten is traced layer by layer (the same outputs)."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch._dynamo
import torch.utils._pytree as pytree

import concept.compiled
from concept.attention import AttentionPattern, CausalPattern
from concept.compiled import compile_model
from concept.dense import DenseModel
from concept.packing import pack
from tests.conftest import mixed_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not concept.compiled.default_layer_regions({}),
                                 reason=f"the regions are off before torch {concept.compiled.REGIONS_FROM}")]


# dynamo stamps a region's traced graph out for a later call with the same inputs from torch 2.13; torch 2.11 traces
# every call and keeps one body for the calls whose graphs compare equal (inductor compiles each body once either way)
STAMPS_OUT = importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None


@pytest.fixture
def stamped(monkeypatch):
    """How many region calls dynamo served by stamping out a graph it traced before (not tracing the layer); None on
    a torch that does not stamp out (:data:`STAMPS_OUT`)."""
    if not STAMPS_OUT:
        return None
    from torch._dynamo.variables import invoke_subgraph

    calls = []
    real = invoke_subgraph.stamp_out_subgraph

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(invoke_subgraph, "stamp_out_subgraph", counted)
    return calls


def regions_of(model):
    """``model`` compiled whole, captured by a backend that records each graph's region calls; (model, calls)."""
    calls = []

    def backend(gm, example_inputs):
        calls.extend(n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph)
        return gm

    return compile_model(model, "model", backend=backend), calls


def bodies(calls) -> set[str]:
    """The distinct graphs the region calls run (each call's first argument names its body)."""
    return {call.args[0].target for call in calls}


def forward_twice(model, compiled):
    """Two batches through the compiled model against eager (equal), as a user's no-grad evaluation."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):
            ids = torch.randint(0, 97, (2, 24), generator=g)
            mask = torch.ones_like(ids)
            mask[1, :5] = 0
            fast, slow = compiled(ids, attention_mask=mask), model(ids, attention_mask=mask)
            torch.testing.assert_close(fast.logits, slow.logits, atol=1e-5, rtol=1e-5)


def streaming(attention):
    import copy

    model = copy.deepcopy(mixed_model("null", attention=attention))
    model.max_ratio = 0.25  # (a static budget: what compiles)
    return model


@pytest.mark.parametrize("attention", ["sdpa", "chunked", "flex"])
def test_each_stack_traces_its_first_layer_and_stamps_out_the_rest(fresh_dynamo, stamped, attention):
    import copy

    model = streaming(attention)
    compiled, calls = regions_of(copy.deepcopy(model))
    forward_twice(model, compiled)
    layers = sum(len(stack) for stack in (model.shallow, model.middle, model.deep))
    assert len(calls) == layers == 6  # (split 2,2,2: every layer a region call of the one graph)
    assert len(bodies(calls)) == 3  # one body a stack
    assert stamped is None or len(stamped) == layers - 3  # each stack's first layer traced, the second stamped out


def test_the_dense_baseline_traces_one_layer(fresh_dynamo, stamped):
    import copy

    model = DenseModel(copy.deepcopy(mixed_model("null")).backbone, static=True).eval()
    compiled, calls = regions_of(copy.deepcopy(model))
    forward_twice(model, compiled)
    assert len(calls) == 6 and len(bodies(calls)) == 1 and (stamped is None or len(stamped) == 5)


def test_negative_control_regions_off_trace_every_layer(fresh_dynamo, stamped, monkeypatch):
    import copy

    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", False)
    model = streaming("sdpa")
    compiled, calls = regions_of(copy.deepcopy(model))
    forward_twice(model, compiled)
    assert not calls and not stamped  # (None or [])


class _Opaque:
    """An object pytree cannot flatten (no registration)."""


OPAQUE = _Opaque()


def test_negative_control_a_plan_pytree_cannot_flatten_is_traced_layer_by_layer(fresh_dynamo, stamped, monkeypatch):
    """The shallow and middle stacks' plan (``CausalPattern``) holding an opaque object: their layers are traced one
    by one (no stamp-out), the deep stack's still stamped; the outputs are the same."""
    import copy

    real = CausalPattern.__init__

    def with_an_object(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.note = OPAQUE

    model = streaming("sdpa")
    compiled, calls = regions_of(copy.deepcopy(model))
    monkeypatch.setattr(CausalPattern, "__init__", with_an_object)
    forward_twice(model, compiled)
    assert len(calls) == 6 and (stamped is None or len(stamped) == 1)


def a_static_layout():
    keep = torch.zeros(2, 40, dtype=torch.bool)
    keep[0, ::5] = True
    keep[1, ::3] = True
    mask = torch.ones_like(keep)
    mask[1, 33:] = False
    return pack(keep, mask, concepts=16)


def patterns():
    layout = a_static_layout()
    chunked = importlib.import_module("concept_plugins.attention.chunked")
    flex = importlib.import_module("concept_plugins.attention.flex")
    sdpa = importlib.import_module("concept_plugins.attention.sdpa")
    valid = layout.meta.valid
    return [CausalPattern(valid, causal=False), chunked.ChunkedBackend(chunked.ChunkedConfig(8)).plan(layout),
            flex.FlexBackend(flex.FlexConfig(compile=False, block=16)).plan(layout),
            flex.FlexBackend(flex.FlexConfig(compile=False, block=16, mask="rule")).plan(layout),
            sdpa.SDPABackend().plan(layout)]


@pytest.mark.parametrize("index", range(5))
def test_every_pattern_round_trips_through_pytree(index):
    """Flattened to tensors and constants (no other leaf) and rebuilt, a pattern computes the same attention."""
    pattern = patterns()[index]
    leaves, spec = pytree.tree_flatten(pattern)
    assert leaves and all(leaf is None or isinstance(leaf, (torch.Tensor, bool, int, float, str)) for leaf in leaves)
    again = pytree.tree_unflatten(leaves, spec)
    assert type(again) is type(pattern) and isinstance(again, AttentionPattern)
    g = torch.Generator().manual_seed(index)
    L = pattern.block_mask.seq_lengths[0] if hasattr(pattern, "block_mask") else a_static_layout().length
    q = torch.randn(2, 4, L, 8, generator=g)
    k, v = torch.randn(2, 2, L, 8, generator=g), torch.randn(2, 2, L, 8, generator=g)
    assert torch.equal(again(q, k, v, 0.35), pattern(q, k, v, 0.35))


@pytest.mark.slow
def test_inductor_training_steps_with_regions_equal_eager(fresh_dynamo, stamped):
    """Inductor (C++ on this CPU) compiles the regions' forward and backward bodies: three training steps of a model
    with LoRA equal eager's (losses and every trained gradient), the middle and deep stacks' second layers stamped
    out."""
    import copy

    from concept.lora import LoraSettings, add_lora

    model = streaming("sdpa")
    add_lora(model.backbone, LoraSettings(rank=2))
    model.train()
    compiled = compile_model(copy.deepcopy(model), "model")
    twins = [(name, p, dict(compiled.named_parameters())[name]) for name, p in model.named_parameters()
             if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 97, (2, 24), generator=g)
        torch.manual_seed(1)  # (the same noise for the sampler: inductor draws as eager does)
        slow = model(ids, labels=ids).loss
        torch.manual_seed(1)
        fast = compiled(ids, labels=ids).loss
        slow.backward()
        fast.backward()
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            for name, p, q in twins:
                torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4, msg=name)
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    assert stamped is None or len(stamped) == 2  # middle and deep (in training the shallow stack's first layer is a body of its own:
    # its input, the frozen embeddings, needs no gradient, the second layer's does)


@pytest.fixture
def backward_bodies(monkeypatch):
    """Each backward body torch traces for a region it traced one for already (a suffix > 0: another tangent
    layout), by region."""
    from torch._guards import InvokeSubgraphCache

    seen = []
    real = InvokeSubgraphCache.add_lazy_bwd_entry

    def counted(self, identifier, *args, **kwargs):
        suffix = real(self, identifier, *args, **kwargs)
        if suffix:
            seen.append(identifier)
        return suffix

    monkeypatch.setattr(InvokeSubgraphCache, "add_lazy_bwd_entry", counted)
    return seen


def train_once_captured(model):
    import copy

    from concept.lora import LoraSettings, add_lora

    model = copy.deepcopy(model)
    add_lora(model.backbone, LoraSettings(rank=2))
    compiled = compile_model(model.train(), "model", backend="aot_eager")
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    compiled(ids, labels=ids).loss.backward()


def test_one_backward_body_per_region(fresh_dynamo, backward_bodies):
    """A stack's output hands its gradient on contiguous (``concept.compiled.ContiguousGradient``), so the middle
    stack's last layer, whose output is a slice of the deep stack's input, is served by the middle body's one
    backward."""
    train_once_captured(streaming("sdpa"))
    assert backward_bodies == []


def test_negative_control_a_strided_gradient_traces_a_second_backward_body(fresh_dynamo, backward_bodies,
                                                                            monkeypatch):
    monkeypatch.setattr(concept.compiled.ContiguousGradient, "backward", staticmethod(lambda ctx, grad: grad))
    train_once_captured(streaming("sdpa"))
    assert len(backward_bodies) == 1


def test_the_whole_forward_compiles_without_buffer_reuse(monkeypatch):
    """Inductor compiles a whole forward of regions without reusing a dead buffer's storage
    (``concept.compiled.REGION_OPTIONS``: torch 2.13 takes a region's kept input for dead); with the regions off,
    inductor's default."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs.get("options")) or fn)
    compile_model(streaming("sdpa"), "model").forward.compile("plain")  # (made at its first call)
    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", False)
    compile_model(streaming("sdpa"), "model").forward.compile("plain")  # (made at its first call)
    assert seen[0]["allow_buffer_reuse"] is False and "allow_buffer_reuse" not in seen[1]


@pytest.mark.slow
def test_negative_control_inductors_buffer_reuse_trains_a_deep_block_wrong(fresh_dynamo, monkeypatch):
    """The reason for ``REGION_OPTIONS``: with inductor's default buffer reuse, a training step of regions whose deep
    stack is as wide as the tokens (the deep block) gives gradients far from eager's (its loss equal)."""
    import copy

    from concept.lora import LoraSettings, add_lora

    monkeypatch.setattr(concept.compiled, "REGION_OPTIONS", {})
    model = streaming("sdpa")
    add_lora(model.backbone, LoraSettings(rank=2))
    model.train()
    compiled = compile_model(copy.deepcopy(model), "model")
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    model(ids, labels=ids).loss.backward()
    torch.manual_seed(1)
    compiled(ids, labels=ids).loss.backward()
    worst = max(float((q.grad - p.grad).abs().max() / (p.grad.abs().max() + 1e-12))
                for p, q in zip(model.parameters(), compiled.parameters()) if p.grad is not None)
    assert worst > 0.1
