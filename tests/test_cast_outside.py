"""``--compile model`` under autocast: the LoRA adapters cast to the compute dtype before the whole forward's graph
(``concept.compiled.WholeForward.cast_adapters``, ``concept.lora.AdapterCasts.cast_outside``), by one multi-tensor
copy into buffers that keep their addresses (``concept.lora.CastInto``), where the graph cast each adapter weight
with a kernel of its own each way (844 of a SmolLM2 step's ~3,300 kernels: ``docs/benchmarks.md``, "The adapters
cast before the graph").

Checked: ``CastInto`` equals the per-weight casts (and a power-of-two scale's multiply) bit for bit, forward and
gradients, hands out views of its buffers, and lets two forwards run before one backward; a bf16 training step
compiled whole (``aot_eager``, the regions on) has no cast of an adapter weight in its graphs, trains bit for bit
as the graph casting them did, with and without gradient accumulation, stamps the regions out as before and
compiles nothing after its first step; the layers keep no cast after a call. Negative controls: the switch off
casts every adapter in the graph; a wrong cast, a scale applied twice, or buffers not written again after the
first call change the weights trained. What is cast is found again when a layer's adapter weight is replaced (negative
control: a plan kept regardless casts the old weight).
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.debugging import aot_eager

import concept.compiled
import concept.lora
from concept.lora import AdapterCasts, CastInto
from concept.training import TrainConfig, Trainer
from tests.test_compile import run  # noqa: F401 (a fixture: the tiny model, built, and its training data)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3


def test_cast_into_equals_the_per_weight_casts_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(*shape, generator=g) * 1e-3).requires_grad_() for shape in ((4, 16), (16, 4), (3, 5), (5, 3))]
    scales = (1.0, 2.0, 1.0, 0.5)
    buffers = [torch.empty(w.shape, dtype=torch.bfloat16) for w in weights]
    cast = CastInto.apply(buffers, scales, *weights)
    grads = [torch.randn(w.shape, generator=g).to(torch.bfloat16) for w in weights]
    got = torch.autograd.grad(cast[:3], weights[:3], grads[:3])  # (the last view gets no gradient)
    want_cast = [w.to(torch.bfloat16) * s for w, s in zip(weights, scales)]
    want = torch.autograd.grad(want_cast[:3], weights[:3], grads[:3])
    for c, b, w in zip(cast, buffers, want_cast):
        assert c.dtype == torch.bfloat16 and torch.equal(c, w) and c.data_ptr() == b.data_ptr()
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want))


def test_two_forwards_before_one_backward_and_a_changed_weight():
    """Two losses summed: the second call writes the buffers the first call's saved views read, with the same values
    and without a new version (autograd would refuse the backward). After the weights change, the next call casts
    the new values."""
    weights = [torch.full((2, 3), 0.5, requires_grad=True), torch.full((3, 2), 0.25, requires_grad=True)]
    buffers = [torch.empty(w.shape, dtype=torch.bfloat16) for w in weights]

    def loss():  # (the product saves both views for its backward, as the graph saves the adapters)
        a, b = CastInto.apply(buffers, (1.0, 2.0), *weights)
        return (a @ b).float().square().sum()

    total = loss() + loss()
    total.backward()
    want = [w.detach().clone().requires_grad_() for w in weights]
    (2 * (want[0].to(torch.bfloat16) @ (want[1].to(torch.bfloat16) * 2)).float().square().sum()).backward()
    assert all(torch.equal(w.grad, v.grad) for w, v in zip(weights, want))
    with torch.no_grad():
        weights[0].mul_(2)
    assert torch.equal(CastInto.apply(buffers, (1.0, 2.0), *weights)[0], torch.ones(2, 3, dtype=torch.bfloat16))
    assert isinstance(AdapterCasts([]).plans, dict)


def test_buffers_made_in_inference_mode_serve_a_training_call():
    from concept.lora import _buffers

    weights = [torch.ones(2, 3, requires_grad=True)]
    with torch.inference_mode():
        buffers = _buffers(weights, torch.bfloat16)
        CastInto.apply(buffers, (1.0,), *weights)
    (a,) = CastInto.apply(buffers, (1.0,), *weights)  # (an inference tensor's version cannot be kept,
    (a @ a.t()).float().sum().backward()  # nor saved for a backward)
    assert torch.equal(weights[0].grad, 4 * torch.ones(2, 3))


def train(run, name, monkeypatch, outside=True, grad_accum=1, fault=None):  # noqa: F811
    """``STEPS`` bf16 steps of the tiny model compiled whole (``aot_eager``); (trained adapter weights, the casts of
    adapter weights the graphs hold, the graphs dynamo compiled, the layers' casts left after the last call)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", backend)
    monkeypatch.setattr(concept.compiled, "CAST_ADAPTERS_OUTSIDE", outside)
    if fault is not None:
        monkeypatch.setattr(*fault)
    config = TrainConfig(steps=STEPS + 1, seq_len=32, batch=2, grad_accum=grad_accum, eval_every=100,
                         checkpoint_every=100, log_every=100, warmup=2, data=str(run / "code.jsonl"),
                         lora=concept.lora.LoraSettings(rank=2), compile="model", dtype="bf16")
    trainer = Trainer.start(run / "built", run / name, config)
    counts = []
    for _ in range(STEPS):
        trainer.train_step()
        counts.append(len(graphs))
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    left = [m.adapter_cast for m in trainer.model.modules() if hasattr(m, "adapter_casts")]
    return weights, adapter_casts_in(graphs), counts, left


def adapter_casts_in(graphs) -> int:
    """How many adapter weights ``graphs`` cast (dynamo's graphs, before AOT autograd, and their regions' bodies):
    graph inputs named after a ``lora_A`` / ``lora_B`` parameter that a cast to bf16 reads."""
    cast = set()
    for gm in graphs:
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                cast |= {n.args[0].name for n in module.graph.nodes if n.op == "call_method" and n.target == "to"
                         and "lora_" in getattr(n.args[0], "name", "") and torch.bfloat16 in n.args[1:]}
    return len(cast)


@pytest.fixture(scope="module")
def in_graph(run, fresh_module_dynamo):  # noqa: F811
    """The path before: each adapted layer's graph casts its adapters (the switch off)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return train(run, "in-graph", monkeypatch, outside=False)


@pytest.fixture(scope="module")
def fresh_module_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_graphs_cast_no_adapter_and_train_as_the_in_graph_casts(run, monkeypatch, in_graph):  # noqa: F811
    weights, casts, graphs, left = train(run, "outside", monkeypatch)
    want, in_graph_casts, in_graph_graphs, _ = in_graph
    assert casts == 0
    assert in_graph_casts == 2 * 7 * 3  # negative control: every adapter's A and B (3 layers, 7 projections)
    assert all(torch.equal(weights[k], want[k]) for k in want) and len(want) == 2 * 7 * 3
    assert graphs == in_graph_graphs and graphs[-1] == graphs[0]  # nothing compiled after the first step
    assert left == [None] * 21  # (no layer keeps a cast past its call)


def test_with_accumulated_gradients_too(run, monkeypatch):  # noqa: F811
    weights, casts, _, _ = train(run, "outside-accumulated", monkeypatch, grad_accum=2)
    want, _, _, _ = train(run, "in-graph-accumulated", monkeypatch, outside=False, grad_accum=2)
    assert casts == 0 and all(torch.equal(weights[k], want[k]) for k in want)


def test_the_regions_are_stamped_out_as_before(run, monkeypatch, in_graph):  # noqa: F811
    from tests.test_compile_regions import STAMPS_OUT

    if not STAMPS_OUT:
        pytest.skip("this torch does not stamp regions out")
    from torch._dynamo.variables import invoke_subgraph

    real, stamped = invoke_subgraph.stamp_out_subgraph, {}
    for outside in (True, False):
        calls = []
        monkeypatch.setattr(invoke_subgraph, "stamp_out_subgraph", lambda *a, **k: calls.append(1) or real(*a, **k))
        train(run, f"stamped-{outside}", monkeypatch, outside=outside)
        stamped[outside] = len(calls)
    assert stamped[True] == stamped[False]


@pytest.mark.parametrize("fault", ["wrong cast", "scale twice", "stale buffers"])
def test_negative_control_a_wrong_cast_is_caught(run, monkeypatch, in_graph, fault):  # noqa: F811
    real, written = concept.lora._cast_each, []

    def wrong(tensors, scales, scale_first, out):
        if fault == "scale twice":  # (``B`` scaled, and its products too)
            return real(tensors, [s * s for s in scales], scale_first, out)
        if fault == "stale buffers" and out[0].dtype == torch.bfloat16:  # (written once, never after a step)
            return None if written else written.append(1) or real(tensors, scales, scale_first, out)
        real(tensors, scales, scale_first, out)
        if fault == "wrong cast" and out[0].dtype == torch.bfloat16:  # (the forward's cast)
            out[0].mul_(1 + 2 ** -6)
    target = concept.lora, "_cast_each", wrong
    weights, casts, _, _ = train(run, f"fault-{fault.replace(' ', '-')}", monkeypatch, fault=target)
    want = in_graph[0]
    assert casts == 0 and not all(torch.equal(weights[k], want[k]) for k in want)


def test_nothing_is_cast_outside_without_autocast(run, monkeypatch):  # noqa: F811
    """An fp32 step: the layers compute in fp32, nothing to cast (the graph and eager alike)."""
    model = concept.load(run / "built")
    concept.lora.add_lora(model.backbone, concept.lora.LoraSettings(rank=2))
    model.max_ratio = 0.25
    compiled = concept.compiled.compile_model(model, "model", backend="aot_eager")
    assert compiled.forward.cast_adapters(torch.device("cpu")) == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = compiled.forward.cast_adapters(torch.device("cpu"))
    assert len(cast) == 21 and all(m.adapter_cast[0].dtype == torch.bfloat16 for m in cast)
    concept.lora.clear_outside(cast)
    assert all(m.adapter_cast is None for m in cast)


@pytest.mark.parametrize("stale", [False, True])
def test_what_is_cast_is_found_again_when_a_weight_is_replaced(monkeypatch, stale):
    """``cast_outside`` keeps what it casts (``_Plan``) while the layers' adapters are the same objects, and looks again
    when one is replaced. Negative control: a plan kept regardless casts the replaced weight."""
    from torch import nn

    from concept.lora import _Plan
    from tests.test_fused_lora import adapted_layers

    model = adapted_layers()
    casts, cpu = model.q_proj.adapter_casts, torch.device("cpu")
    casts.cast_outside(torch.bfloat16, cpu)
    plan = casts.plans[cpu]
    casts.cast_outside(torch.bfloat16, cpu)
    assert casts.plans[cpu] is plan  # (nothing replaced: the same plan)
    if stale:
        monkeypatch.setattr(_Plan, "current", lambda self, device: True)
    model.k_proj.lora_A["default"].weight = nn.Parameter(torch.full_like(model.k_proj.lora_A["default"].weight, 0.5))
    casts.cast_outside(torch.bfloat16, cpu)
    fresh = torch.equal(model.k_proj.adapter_cast[0], torch.full((4, 16), 0.5, dtype=torch.bfloat16))
    assert fresh != stale
