"""Full forward of the streaming model vs the dense backbone on the same tokens.

    .venv/bin/python -m pytest benchmarks/test_forward.py              # tiny backbone (fast)
    .venv/bin/python -m pytest benchmarks/test_forward.py --smollm2    # + SmolLM2-135M at T=2048
"""
from __future__ import annotations

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.flops import Shape, evenly_spaced_keep, forward_flops, head_classes

from .conftest import side_by_side

RATIO = 0.25


def _model(backbone: str, attention: str, length_policy: ComponentRef | None = None):
    policy = length_policy or ComponentRef("null")
    if backbone == "smollm2":
        cfg = BuildConfig(split="4,22,4", attention=ComponentRef(attention), length_policy=policy)
    else:
        cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2,
                                                              "intermediate": 512, "vocab": 1024}),
                          split="1,6,1", attention=ComponentRef(attention), vocabulary=ComponentRef("embedding", {"size": 256}),
                          length_policy=policy)
    return concept.build(cfg)


CASES = [("tiny-llama", 512, "chunked"), ("tiny-llama", 512, "sdpa"),
         ("smollm2", 2048, "chunked"), ("smollm2", 2048, "sdpa")]


@pytest.mark.parametrize("backbone,T,attention", CASES, ids=[f"{b}-T{t}-{a}" for b, t, a in CASES])
def test_forward_vs_dense(benchmark, record, request, device, backbone, T, attention):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    model = _model(backbone, attention).to(device)
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (1, T)).to(device)
    keep = evenly_spaced_keep(T, RATIO)[None].to(device)
    ideal = forward_flops(Shape.from_hf_config(model.backbone.config), model.split, keep[0].cpu(),
                          head_classes(model))
    with torch.no_grad():
        if benchmark.disabled:  # smoke run (CI): one call each, no timing claims
            model(ids, keep=keep), model.backbone(ids)
            return
        timing = side_by_side(lambda: model.backbone(ids), lambda: model(ids, keep=keep), device=device)
        benchmark.pedantic(lambda: model(ids, keep=keep), rounds=3, iterations=1)
    record(benchmark, f"forward {backbone} T={T} r={RATIO} {attention}", timing, ideal.speedup, T=T, ratio=RATIO)
