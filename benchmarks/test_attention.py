"""Attention only: the deep stack's block-sparse attention over the packed layout vs dense causal
attention over the same T tokens (one layer, SmolLM2's head shape: 9 query heads, 3 KV heads,
head_dim 64).

    .venv/bin/python -m pytest benchmarks/test_attention.py            # T = 1k, 4k
    .venv/bin/python -m pytest benchmarks/test_attention.py --long     # + T = 8k, 16k
    .venv/bin/python -m pytest benchmarks/test_attention.py --long --device cuda   # the GPU cases
    .venv/bin/python -m pytest benchmarks/test_attention.py --long --device cuda --dtype bf16 -k r0.125   # the GPU kit's

Backends: the exact ones of the registry (``cascade``: dense kernels on tiles, merged by log-sum-exp),
``xformers`` once per layout (``xformers-gathered``: each
segment's concept prefix copied as K/V, one call; ``xformers-shared``: every key once, partials
merged by their log-sum-exps; only where xformers' CUDA kernels run), and ``flex-time-ordered``:
FlexAttention with the same rule over the slots in *time* order instead of concepts first (the
"dense time-ordered mask" the concepts-first layout is measured against: its BlockMask can skip
far fewer tiles).

The plan (masks, key ranges) is built once per forward and shared by all deep layers, so it
is built outside the timed call; its build time is recorded as ``plan_s``.
"""
from __future__ import annotations

import time

import pytest
import torch

from concept.attention import sdpa
from concept.flops import deep_pairs, evenly_spaced_keep
from concept.packing import PackedLayout, SlotMeta, allowed, pack
from concept.registry import registry

from .conftest import GPU_LENGTHS, dtype_name, gpu_case, side_by_side

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
LENGTHS = [1024, 4096, 8192, 16384]
RATIOS = [0.1, 0.25, 0.5]
BACKENDS = ["chunked", "cascade", "flex", "flex-time-ordered", "xformers-gathered", "xformers-shared", "sdpa"]
CASES = [(b, t, r) for b in BACKENDS for t in LENGTHS for r in RATIOS if not (b == "sdpa" and t > 4096)]
GPU_RATIO = 0.125  # the default operating point's concepts per token: the GPU cases (CUDA only)
CASES += [(b, t, GPU_RATIO) for b in BACKENDS for t in GPU_LENGTHS if not (b == "sdpa" and t > 4096)]


def time_ordered(layout: PackedLayout) -> PackedLayout:
    """The same slots in time order (concepts at their emitting token's place, padding last)."""
    meta = layout.meta
    order = torch.argsort(meta.time + (~meta.valid) * layout.length, dim=1, stable=True)
    fields = (meta.time, meta.keep, meta.seg, meta.valid, meta.doc, meta.sub)
    return PackedLayout(layout.num_concepts, SlotMeta(*(None if t is None else t.gather(1, order) for t in fields)),
                        layout.concept_src, layout.tail_src, layout.slot_of_time, layout.concept_rank)


def make_plan(backend: str, layout: PackedLayout):
    if backend == "flex-time-ordered":
        if layout.meta.time.device.type != "cuda":
            pytest.skip("flex-time-ordered: a GPU comparison (torch's CPU FlexAttention is slower than dense anyway)")
        return registry("attention").get("flex")().plan(time_ordered(layout))
    if backend.startswith("xformers-"):
        from concept_plugins.attention.xformers import XFormersConfig, kernel_unavailable

        if kernel_unavailable():
            pytest.skip(f"xformers: {kernel_unavailable()}")
        which = backend.split("-")[1]
        plan = registry("attention").get("xformers")(XFormersConfig(layout=which)).plan(layout)
        getattr(plan, which)()  # the layout is built on first use: here, so that plan_s counts it
        return plan
    return registry("attention").get(backend)().plan(layout)


@pytest.mark.parametrize("backend,T,ratio", CASES, ids=[f"{b}-T{t}-r{r}" for b, t, r in CASES])
def test_attention_vs_dense_causal(benchmark, record, request, device, dtype, backend, T, ratio):
    if ratio == GPU_RATIO:
        gpu_case(request, device, T, real_backbone=False)
    if T > 4096 and not request.config.getoption("--long"):
        pytest.skip("pass --long for the 8k- and 16k-token cases")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, T, HEAD_DIM, generator=g).to(device, dtype)
    k, v = (torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
    keep = evenly_spaced_keep(T, ratio)[None].to(device)
    scale = HEAD_DIM ** -0.5
    start = time.perf_counter()
    plan = make_plan(backend, pack(keep, torch.ones_like(keep)))
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
    record(benchmark, f"attention {backend} T={T} r={ratio}", timing, ideal, T=T, ratio=ratio, plan_s=plan_s,
           suite="attention", backend=backend, dtype=dtype_name(dtype))


def test_time_ordered_layout_is_the_same_rule():
    """The time-ordered comparison layout allows exactly the same (query, key) pairs."""
    keep = evenly_spaced_keep(64, 0.25)[None]
    layout = pack(keep, torch.ones_like(keep))
    other = time_ordered(layout)
    a, b = allowed(layout.meta, layout.meta)[0], allowed(other.meta, other.meta)[0]
    t_a, t_b = layout.meta.time[0], other.meta.time[0]
    assert torch.equal(t_b, torch.arange(64))
    # a pair (query at time i, key at time j) is allowed in both layouts or in neither
    pos_a = torch.argsort(t_a)
    assert torch.equal(a[pos_a][:, pos_a], b)
