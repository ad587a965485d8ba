"""One training step (forward + backward, LoRA on every projection) of the streaming model vs the
dense baseline on the same batch, measured side by side.

    .venv/bin/python -m pytest benchmarks/test_train_step.py --smollm2
"""
from __future__ import annotations

import pytest
import torch

from concept.dense import DenseModel
from concept.flops import Shape, evenly_spaced_keep, forward_flops, head_classes
from concept.lora import LoraSettings, add_lora

from .conftest import side_by_side
from .test_forward import RATIO, _model

CASES = [("tiny-llama", 2, 256), ("smollm2", 4, 128), ("smollm2", 2, 512)]


@pytest.mark.parametrize("backbone,B,T", CASES, ids=[f"{b}-B{n}-T{t}" for b, n, t in CASES])
def test_train_step_vs_dense(benchmark, record, request, device, backbone, B, T):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    model = _model(backbone, "chunked")
    add_lora(model.backbone, LoraSettings())
    model.to(device)
    dense = DenseModel(model.backbone)
    model.train(), dense.train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (B, T)).to(device)
    keep = evenly_spaced_keep(T, RATIO)[None].expand(B, T).to(device)
    # ideal: forward FLOPs ratio (backward scales the same way for the layers)
    ideal = forward_flops(Shape.from_hf_config(model.backbone.config), model.split, keep[0].cpu(),
                          head_classes(model))

    def step(m, **kw):
        m(ids, labels=ids, **kw).loss.backward()
        m.zero_grad(set_to_none=True)

    if benchmark.disabled:
        step(model, keep=keep), step(dense)
        return
    timing = side_by_side(lambda: step(dense), lambda: step(model, keep=keep), rounds=3, device=device)
    benchmark.pedantic(lambda: step(model, keep=keep), rounds=2, iterations=1)
    record(benchmark, f"train step {backbone} B={B} T={T} r={RATIO}", timing, ideal.speedup,
           tokens=B * T, dense_tokens_per_s=B * T / timing["dense_s"], concept_tokens_per_s=B * T / timing["concept_s"])
