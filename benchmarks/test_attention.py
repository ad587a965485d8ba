"""Attention only: the deep stack's block-sparse attention over the packed layout vs dense causal
attention over the same T tokens (one layer, SmolLM2's head shape: 9 query heads, 3 KV heads,
head_dim 64).

    .venv/bin/python -m pytest benchmarks/test_attention.py            # T = 1k, 4k
    .venv/bin/python -m pytest benchmarks/test_attention.py --long     # + T = 16k

The plan (masks, key ranges) is built once per forward and shared by all deep layers, so it
is built outside the timed call; its build time is recorded as ``plan_s``.
"""
from __future__ import annotations

import time

import pytest
import torch

from concept.attention import sdpa
from concept.flops import deep_pairs, evenly_spaced_keep
from concept.packing import pack
from concept.registry import registry

from .conftest import side_by_side

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
LENGTHS = [1024, 4096, 16384]
RATIOS = [0.1, 0.25, 0.5]
BACKENDS = ["chunked", "flex", "sdpa"]
CASES = [(b, t, r) for b in BACKENDS for t in LENGTHS for r in RATIOS if not (b == "sdpa" and t > 4096)]


@pytest.mark.parametrize("backend,T,ratio", CASES, ids=[f"{b}-T{t}-r{r}" for b, t, r in CASES])
def test_attention_vs_dense_causal(benchmark, record, request, device, backend, T, ratio):
    if T > 4096 and not request.config.getoption("--long"):
        pytest.skip("pass --long for the 16k-token cases")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, T, HEAD_DIM, generator=g).to(device)
    k, v = (torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g).to(device) for _ in range(2))
    keep = evenly_spaced_keep(T, ratio)[None].to(device)
    scale = HEAD_DIM ** -0.5
    start = time.perf_counter()
    plan = registry("attention").get(backend)().plan(pack(keep, torch.ones_like(keep)))
    plan_s = time.perf_counter() - start
    ideal = (T * (T + 1) / 2) / deep_pairs(keep[0].cpu())
    with torch.no_grad():
        dense = lambda: sdpa(q, k, v, scale, is_causal=True)  # noqa: E731
        packed = lambda: plan(q, k, v, scale)  # noqa: E731
        if benchmark.disabled:  # smoke run (CI): one call each, no timing claims
            dense(), packed()
            return
        timing = side_by_side(dense, packed, rounds=5, device=device)
        benchmark.pedantic(packed, rounds=3, iterations=1)
    record(benchmark, f"attention {backend} T={T} r={ratio}", timing, ideal, T=T, ratio=ratio, plan_s=plan_s)
