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

from concept.lora import LoraMatmuls, LoraSettings, add_lora, fused_lora_class
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
