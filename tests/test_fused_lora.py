"""The fused LoRA forward (``concept.lora.FusedLoraLinear``) equals peft's own ``lora.Linear`` forward bit for
bit: outputs, the input's gradient and both adapters' gradients, in fp32, under bf16 autocast over an fp32
base (autocast's casts) and over a base stored in bf16 (``concept.precision``), with a power-of-two scaling
(folded into the add) and another. What it does not cover runs peft's forward. Negative control: a fused
backward that scales the wrong product is caught."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from concept.lora import CastTogether, LoraMatmuls, LoraSettings, add_lora, fused_lora_class
from concept.precision import store_frozen_base


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(16, 12, bias=False)
        self.v_proj = nn.Linear(12, 16, bias=False)

    def forward(self, x):
        return self.v_proj(torch.tanh(self.q_proj(x)))


class Holder(nn.Module):  # (store_frozen_base reads model.backbone)
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone


def adapted(alpha: float, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = add_lora(TwoLayers(), LoraSettings(rank=4, alpha=alpha, dropout=dropout, targets="q_proj,v_proj"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # (peft starts B at 0: the adapters' products would all be 0)
            nn.init.normal_(p)
    return model


def as_peft(model: nn.Module) -> nn.Module:
    """A copy whose adapted layers run peft's own forward (the class the fused one derives from)."""
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if type(m) is fused_lora_class():
            m.__class__ = fused_lora_class().__mro__[2]
    assert type(plain.q_proj).__module__.startswith("peft")
    return plain


def outputs_and_grads(model, x, autocast: bool):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters() if p.requires_grad]


CASES = [("fp32", False), ("fp32 base, bf16 autocast", True), ("bf16 base", True)]


@pytest.mark.parametrize("alpha", [16.0, 12.0], ids=["scaling 4 (folded)", "scaling 3"])
@pytest.mark.parametrize("case,autocast", CASES, ids=[c for c, _ in CASES])
def test_fused_lora_equals_peft_bit_for_bit(alpha, case, autocast):
    fused = adapted(alpha)
    assert type(fused.q_proj) is fused_lora_class()
    plain = as_peft(fused)
    if case == "bf16 base":
        store_frozen_base(Holder(fused), torch.bfloat16)
        store_frozen_base(Holder(plain), torch.bfloat16)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    calls = []
    apply = LoraMatmuls.apply
    LoraMatmuls.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        got = outputs_and_grads(fused, x, autocast)
    finally:
        LoraMatmuls.apply = apply
    assert len(calls) == 2  # the fused path ran, in both layers
    want = outputs_and_grads(plain, x, autocast)
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_what_the_fused_forward_does_not_cover_runs_peft():
    """Dropout (p > 0) is peft's: the fused function is not called."""
    model = adapted(16.0, dropout=0.1)
    calls = []
    apply = LoraMatmuls.apply
    LoraMatmuls.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        model(torch.randn(2, 16))
    finally:
        LoraMatmuls.apply = apply
    assert not calls


def test_negative_control_a_wrongly_scaled_backward_is_caught(monkeypatch):
    fused = adapted(16.0)
    plain = as_peft(fused)
    backward = LoraMatmuls.backward

    def unscaled_b(ctx, grad):  # the adapter B's gradient without the scaling
        grad_x, w, grad_a, grad_b, s, d = backward(ctx, grad)
        return grad_x, w, grad_a, grad_b / ctx.scaling, s, d

    monkeypatch.setattr(LoraMatmuls, "backward", staticmethod(unscaled_b))
    x = torch.randn(2, 5, 16)
    got, want = outputs_and_grads(fused, x, False), outputs_and_grads(plain, x, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[-1], want[-1])  # lora_B of v_proj


def traced_functions(model, x) -> list[str]:
    """The ``autograd.Function`` calls dynamo puts in the graph of a training forward of ``model`` (fp32)."""
    found = []

    def backend(gm, example_inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if "autograd_function" in str(n.target))
        return gm

    torch._dynamo.reset()
    try:
        torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)(x.requires_grad_()).sum().backward()
    finally:
        torch._dynamo.reset()
    return found


def test_traced_the_adapted_layers_run_plain_ops():
    """Traced (``torch.compile``), an adapted layer computes ``LoraMatmuls``' forward as plain ops and leaves its
    backward to AOT autograd (``concept.lora.lora_matmuls``): an ``autograd.Function`` inside a nested compile region
    fails dynamo 2.11's comparison of the regions' graphs in a training step (``KeyError: example_value``), so
    ``--compile model`` could not train on the GPU image's torch. The same values and gradients as eager's.
    Negative control: the Function called when traced is in the graph."""
    fused = adapted(12.0)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    assert traced_functions(fused, x.clone()) == []
    eager = outputs_and_grads(fused, x, False)
    traced = outputs_and_grads(torch.compile(copy.deepcopy(fused), backend="aot_eager", fullgraph=True), x, False)
    torch._dynamo.reset()
    for g, w in zip(traced, eager):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_negative_control_the_function_traced_is_in_the_graph(monkeypatch):
    import concept.lora

    monkeypatch.setattr(concept.lora, "lora_matmuls", LoraMatmuls.apply)
    assert len(traced_functions(adapted(12.0), torch.randn(2, 5, 16))) == 2


def inductor_kernels(model, x, fold: bool | None, monkeypatch, bf16: bool = True) -> tuple[list, list]:
    """``model`` compiled by inductor (this CPU), one forward and backward, under bf16 autocast over its base stored
    in bf16 (``bf16``; else in fp32): the kernels inductor planned (``benchmarks.compiled_bytes``) and the outputs
    and gradients; ``fold``: :data:`concept.lora.FOLD_SCALE` (None: as the library sets it)."""
    import torch._dynamo
    import torch._inductor.config

    import concept.lora
    from benchmarks.compiled_bytes import KernelLog

    if fold is not None:
        monkeypatch.setattr(concept.lora, "FOLD_SCALE", fold)
    model = copy.deepcopy(model)
    if bf16:
        store_frozen_base(Holder(model), torch.bfloat16)
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), KernelLog() as log:
            found = outputs_and_grads(torch.compile(model, fullgraph=True), x, bf16)
    finally:
        torch._dynamo.reset()
    return log.kernels(), found


def test_traced_a_power_of_two_scale_multiplies_the_adapter_not_the_product(monkeypatch):
    """Compiled, the scale ``s`` (alpha / rank: 4 here, 2 by default) multiplies ``B`` [out, r] in the kernel that
    casts it, not the product [N, out]: no elementwise kernel over the rows for it, forward (``t s``) or backward
    (``g s``), fewer kernels and bytes (``concept.lora.FOLD_SCALE``); in fp32 the unfolded graph's bits, and
    eager's values and gradients within inductor's fp32 reordering.
    Negative control: unfolded, kernels that only multiply an [N, out] tensor by ``s``."""
    model = adapted(16.0)
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))
    folded, _ = inductor_kernels(model, x, None, monkeypatch)
    unfolded, _ = inductor_kernels(model, x, False, monkeypatch)
    scales = lambda kernels: [k for k in kernels if k["kind"] == "generated"  # noqa: E731
                              and set(k["ops"].split(",")) <= {"mul", "reshape"}]  # (a kernel that only scales)
    # unfolded: both layers' ``t s`` and the second layer's ``g s`` alone (the first one's fused into tanh's backward)
    assert len(scales(unfolded)) == 3 and scales(folded) == []
    assert len(folded) == len(unfolded) - 3
    assert sum(k["bytes"] for k in folded) < sum(k["bytes"] for k in unfolded)
    (_, folded_fp32), (_, unfolded_fp32) = (inductor_kernels(model, x, fold, monkeypatch, bf16=False)
                                            for fold in (None, False))
    for folded_value, unfolded_value, eager in zip(folded_fp32, unfolded_fp32, outputs_and_grads(model, x, False)):
        assert torch.equal(folded_value, unfolded_value)  # (a power of two: the same bits)
        torch.testing.assert_close(folded_value, eager, rtol=1e-5, atol=1e-4)


# -- the adapters cast together (concept.lora.AdapterCasts), once per forward ----------------------------------

class Layers(nn.Module):
    """Three adapted layers whose weights fall in three groups of trailing dims (A: 16 and 12 columns, B: 4);
    ``q_proj`` used ``uses`` times in one forward; ``checkpointed``: each layer run under a non-reentrant
    ``torch.utils.checkpoint``, as ``concept.backbone.run_layers`` runs them with --grad-checkpointing."""

    def __init__(self, uses: int = 1, checkpointed: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.k_proj = nn.Linear(16, 12, bias=False)
        self.v_proj = nn.Linear(12, 16, bias=False)
        self.uses, self.checkpointed = uses, checkpointed

    def forward(self, x):
        call = (lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False)) if self.checkpointed \
            else (lambda f, h: f(h))
        for _ in range(self.uses):
            x = torch.tanh(call(self.q_proj, x))
        return call(self.v_proj, torch.tanh(call(self.k_proj, x)))


def adapted_layers(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = add_lora(Layers(**kwargs), LoraSettings(rank=4, alpha=16.0, targets="q_proj,k_proj,v_proj"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    return model


def per_use(model: nn.Module) -> nn.Module:
    """A copy whose adapted layers cast their own adapters at each use (the path before AdapterCasts)."""
    copied = copy.deepcopy(model)
    copied.q_proj.adapter_casts.disabled = True
    return copied


def cast_calls(monkeypatch) -> list:
    calls = []
    apply = CastTogether.apply
    monkeypatch.setattr(CastTogether, "apply", lambda *a: calls.append(len(a) - 1) or apply(*a))
    return calls


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("kwargs", [{}, {"uses": 2}, {"checkpointed": True}], ids=["once", "q twice", "checkpointed"])
@pytest.mark.parametrize("bf16_base", [False, True], ids=["fp32 base", "bf16 base"])
def test_adapters_cast_together_equal_peft_and_per_use_casts_bit_for_bit(monkeypatch, kwargs, bf16_base):
    """Logits and every gradient under bf16 autocast: the batched cast equals the per-use casts bit for bit, and
    peft's forward, over two micro-batches accumulated (the second forward casts again). An adapter used twice
    in one graph takes a second cast: its gradients add up in fp32, as the per-use casts add them (peft's
    differs there: autocast's cast cache gives both uses one cast, their gradients add up in bf16)."""
    fused = adapted_layers(**kwargs)
    plain, separate = as_peft(fused), per_use(fused)
    if bf16_base:
        for m in (fused, plain, separate):
            store_frozen_base(Holder(m), torch.bfloat16)
    xs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    calls = cast_calls(monkeypatch)
    got = [t for x in xs for t in outputs_and_grads(fused, x, True)]
    uses = kwargs.get("uses", 1)
    casts = uses + kwargs.get("checkpointed", False)  # (the recomputation in backward casts once more)
    assert calls == [6] * casts * 2  # one cast of all 6 weights a forward (and one more per second use)
    del calls[:]
    assert_same(got, [t for x in xs for t in outputs_and_grads(separate, x, True)])
    assert not calls  # (the per-use path ran)
    if uses == 1:
        assert_same(got, [t for x in xs for t in outputs_and_grads(plain, x, True)])


def test_without_gradients_each_forward_casts_once(monkeypatch):
    """Evaluation, decoding: one cast a forward, which sees the weights as they are then (also when changed
    through ``.data``, which no version counter sees)."""
    fused = adapted_layers()
    plain = as_peft(fused)
    x = torch.randn(2, 5, 16)
    calls = cast_calls(monkeypatch)
    for step in range(3):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (autocast caches its casts while on)
            assert torch.equal(fused(x), plain(x))
        assert len(calls) == step + 1
        for m in (fused, plain):
            m.k_proj.lora_B.default.weight.data.add_(0.5)


@pytest.mark.parametrize("fault", ["wrong split", "perturbed view"])
def test_negative_control_a_wrong_batched_cast_is_caught(monkeypatch, fault):
    """A split one row off, or one view off by a bf16 step, makes the comparison above fail."""
    import concept.lora as lora

    fused = adapted_layers()
    plain = as_peft(fused)
    together = lora._cast_together

    def wrong(tensors, dtype):
        out = together(tensors, dtype)
        if dtype == torch.bfloat16:  # (the forward's cast)
            first = out[0]
            out[0] = torch.roll(first, 1, 0) if fault == "wrong split" else first * (1 + 2 ** -7)
        return out

    monkeypatch.setattr(lora, "_cast_together", wrong)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    got, want = outputs_and_grads(fused, x, True), outputs_and_grads(plain, x, True)
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.slow  # (5 s: a compilation)
def test_compiled_the_layers_cast_in_the_graph_with_no_graph_break(monkeypatch):
    """Under torch.compile (fullgraph, bf16 autocast) the cast together is left to the graph: no graph break,
    and the compiled forward and gradients equal eager's (which casts together) bit for bit."""
    torch._dynamo.reset()
    fused = adapted_layers()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused(x)

    assert torch._dynamo.explain(run)(x).graph_break_count == 0
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    calls = cast_calls(monkeypatch)
    got = outputs_and_grads(compiled, x, True)
    assert not calls  # (traced: the graph casts)
    for p in fused.parameters():
        p.grad = None
    assert_same(got, outputs_and_grads(fused, x, True))
    assert len(calls) == 1
    torch._dynamo.reset()
