"""Full forward of the streaming model vs the dense backbone on the same tokens.

    .venv/bin/python -m pytest benchmarks/test_forward.py              # tiny backbone (fast)
    .venv/bin/python -m pytest benchmarks/test_forward.py --smollm2    # + SmolLM2-135M at T=2048
    .venv/bin/python -m pytest benchmarks/test_forward.py --smollm2 --long --device cuda --dtype bf16   # + the GPU cases
    ... --compile      # + the compiled cases (benchmarks/compiled.py)

The GPU cases run the default build (split 4,18,8 on SmolLM2) at its operating point, 0.125 concepts
per token, at 2k / 8k / 16k tokens (16k is past SmolLM2's 8192 trained positions: a speed case only).

Most cases force the decisions evenly at the ratio (``keep=``), so they time the stacks alone. The
``decided`` cases let the default length policy decide (`null` with its ratio tracker, a sequential
scan over the tokens), as training and evaluation do; their ideal is computed from the decisions
that forward made.

The ``compiled`` cases (``--compile``) time, side by side, the dense backbone in HF eager, the dense family's model
over the same backbone compiled as the concept model compiles (the library's ``compile``, ``benchmarks/compiled.py``:
``dense_model``), and the concept model built with its compile option, its policy deciding. Rows: the compiled
concept model against the compiled dense one (with ``speedup_vs_dense_eager`` beside it), and the compiled dense
model against HF eager.

Every side computes its [1, T, V] logits, the same work: HF's forward computes them, and the library's models,
which defer them until read (``concept.lazy``), are read for them (before 2026-11-28 the concept side skipped its
LM head, about 0.46 TFLOP at 8k, where the dense side did not).
"""
from __future__ import annotations

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.streaming.family import static_widths_flops
from concept.flops import Shape, evenly_spaced_keep, forward_flops, head_classes

from . import compiled
from .conftest import (GPU_LENGTHS, cpu_side_by_side, dtype_name, gpu_case, gpu_side_by_side, renamed_sides,
                       side_by_side, skip_unavailable)

RATIO = 0.25
GPU_BACKENDS = ("chunked", "flex", "xformers", "cascade")


def _model(backbone: str, attention: str, length_policy: ComponentRef | None = None, max_ratio: float | None = None,
           **build):
    """``default``: the default build (split auto = 4,18,8 on SmolLM2); ``smollm2``: split 4,22,4; else
    the tiny random backbone. ``max_ratio``: a static concept budget (None: the build's default, ``auto``, as a
    user's model has: a budget of 0, off, would size the packed layout from the decisions, two host syncs per
    forward); ``build``: more keywords of ``concept.build`` (e.g. ``compile``)."""
    policy = length_policy or ComponentRef("null")
    if backbone == "default":
        cfg = BuildConfig(attention=ComponentRef(attention), length_policy=policy)
    elif backbone == "smollm2":
        cfg = BuildConfig(split="4,22,4", attention=ComponentRef(attention), length_policy=policy)
    else:
        cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 8, "hidden": 256, "heads": 4, "kv_heads": 2,
                                                              "intermediate": 512, "vocab": 1024}),
                          split="1,6,1", attention=ComponentRef(attention), vocabulary=ComponentRef("embedding", {"size": 256}),
                          length_policy=policy)
    if max_ratio is not None:
        cfg.max_ratio = max_ratio
    return concept.build(cfg, **build)


CASES = [("tiny-llama", 512, "chunked"), ("tiny-llama", 512, "sdpa"), ("tiny-llama", 512, "cascade"),
         ("smollm2", 2048, "chunked"), ("smollm2", 2048, "sdpa"), ("smollm2", 2048, "cascade")]


@pytest.mark.parametrize("backbone,T,attention", CASES, ids=[f"{b}-T{t}-{a}" for b, t, a in CASES])
def test_forward_vs_dense(benchmark, record, request, device, backbone, T, attention):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    measure_forward(benchmark, record, _model(backbone, attention).to(device), T, RATIO, device,
                    f"forward {backbone} T={T} r={RATIO} {attention}", backend=attention)


@pytest.mark.parametrize("backbone,T", [("tiny-llama", 512), ("smollm2", 2048)], ids=["tiny-llama-T512", "smollm2-T2048"])
def test_forward_decided_by_the_policy_vs_dense(benchmark, record, request, device, backbone, T):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    measure_forward(benchmark, record, _model(backbone, "chunked").to(device), T, None, device,
                    f"forward {backbone} T={T} decided chunked", backend="chunked")


GPU_CASES = [(t, a) for t in GPU_LENGTHS for a in GPU_BACKENDS]


@pytest.mark.parametrize("T,attention", GPU_CASES, ids=[f"default-T{t}-{a}" for t, a in GPU_CASES])
def test_forward_default_point_vs_dense(benchmark, record, request, device, dtype, T, attention):
    gpu_case(request, device, T)
    skip_unavailable(attention)
    measure_forward(benchmark, record, _model("default", attention).to(device, dtype), T, DEFAULT_TARGET_RATIO,
                    device, f"forward default T={T} r={DEFAULT_TARGET_RATIO} {attention}", backend=attention,
                    dtype=dtype_name(dtype))


@pytest.mark.parametrize("T", GPU_LENGTHS, ids=[f"default-T{t}-decided" for t in GPU_LENGTHS])
def test_forward_default_point_decided_by_the_policy_vs_dense(benchmark, record, request, device, dtype, T):
    """The default build as training and evaluation run it: `flex`, its `null` policy deciding."""
    gpu_case(request, device, T)
    measure_forward(benchmark, record, _model("default", "flex").to(device, dtype), T, None, device,
                    f"forward default T={T} decided flex", backend="flex", dtype=dtype_name(dtype))


@pytest.mark.parametrize("backbone,T", [("tiny-llama", 512)] + [("default", t) for t in GPU_LENGTHS],
                         ids=["tiny-llama-T512-compiled"] + [f"default-T{t}-compiled" for t in GPU_LENGTHS])
def test_forward_compiled_vs_dense_compiled(benchmark, record, request, device, dtype, backbone, T):
    """The compiled model, its policy deciding, against the dense backbone compiled alike and HF eager."""
    choice = request.config.getoption("--compile")
    if choice == "off":
        pytest.skip("pass --compile for the compiled cases")
    if backbone == "default":
        gpu_case(request, device, T)
    attention = "flex" if device.type == "cuda" else "chunked"
    eager = _model(backbone, attention, max_ratio=compiled.BUDGET).to(device, dtype).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, eager.backbone.config.vocab_size, (1, T)).to(device)

    def measured():
        model = _model(backbone, attention, max_ratio=compiled.BUDGET, **compiled.build_option(choice)).to(
            device, dtype).eval()
        dense = compiled.dense_model(eager.backbone, device, choice)
        # every side its [1, T, V] logits, the same work: HF's forward computes them, the library's models defer them
        fns = {"dense_eager": lambda: eager.backbone(ids).logits, "dense": lambda: dense(ids).logits,
               "concept": lambda: model(ids).logits}
        with torch.no_grad():
            if benchmark.disabled:  # smoke run (CI): one call each, no timing claims
                for fn in fns.values():
                    fn()
                return None
            first = compiled.first_calls(fns, device)  # (the compilations)
            graphs = compiled.forward_graphs({"concept": model, "dense": dense}, fns, device)
            timing = gpu_side_by_side(fns, device) if device.type == "cuda" else cpu_side_by_side(fns)
            graphs = graphs.done()
            benchmark.pedantic(fns["concept"], rounds=3, iterations=1)
            return timing, first, graphs, model(ids).keep

    found, graphs_failed = compiled.without_failed_graphs(measured, device)
    if found is None:  # (the smoke run)
        return
    timing, first, graphs, keep = found
    if graphs_failed:
        graphs["no_grad_graphs_failed"] = graphs_failed
    label = f"{backbone} T={T} compiled (compile={choice}, dense alike)"
    common = dict(T=T, dtype=dtype_name(dtype), backend=attention, compile={"dense_model": choice}, concept_compile=choice,
                  max_ratio=eager.max_ratio, concept_slots=eager.concept_slots(T))
    ideal = forward_flops(Shape.from_hf_config(eager.backbone.config), eager.split, keep[0].cpu(), head_classes(eager))
    row = {**timing, **first, **graphs, "speedup": timing["dense_s"] / timing["concept_s"],
           "speedup_vs_dense_eager": timing["dense_eager_s"] / timing["concept_s"],
           **static_ideal(eager, keep[0].cpu())}
    record(benchmark, f"forward {label} decided", row, ideal.speedup, ratio=float(keep.float().mean()),
           suite="forward-compiled", **common)
    dense_row = renamed_sides(timing, {"dense_eager": "dense", "dense": "concept"})
    dense_row.update(dense_first_s=first["dense_eager_first_s"], concept_first_s=first["dense_first_s"])
    dense_row["speedup"] = dense_row["dense_s"] / dense_row["concept_s"]
    record(benchmark, f"forward dense {label} vs HF eager", dense_row, 1.0, suite="forward-compiled-dense",
           concept_model="the dense family's model compiled alike (this row's 'concept' side)", **common)


def measure_forward(benchmark, record, model, T, ratio, device, name, **extra):
    """The concept model (decisions forced evenly at ``ratio``; ``None``: made by its length policy)
    and its dense backbone on the same random tokens, side by side, next to the ideal FLOP ratio."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (1, T)).to(device)
    with torch.no_grad():
        keep = evenly_spaced_keep(T, ratio)[None].to(device) if ratio is not None else model(ids).keep
        ideal = forward_flops(Shape.from_hf_config(model.backbone.config), model.split, keep[0].cpu(),
                              head_classes(model))
        forced = {"keep": keep} if ratio is not None else {}
        concept = lambda: model(ids, **forced).logits  # noqa: E731  (its [1, T, V] logits, as HF's forward has them)
        if benchmark.disabled:  # smoke run (CI): one call each, no timing claims
            concept(), model.backbone(ids)
            return
        timing = side_by_side(lambda: model.backbone(ids).logits, concept, device=device)
        benchmark.pedantic(concept, rounds=3, iterations=1)
    realised = float(keep.float().mean())
    record(benchmark, name, timing, ideal.speedup, T=T, ratio=ratio if ratio is not None else realised,
           suite="forward" if ratio is not None else "forward-decided", **static_ideal(model, keep[0].cpu()), **extra)


def static_ideal(model, keep) -> dict:
    """``static_ideal_speedup``: the FLOP ideal of the widths a static layout computes
    (``concept.streaming.family.static_widths_flops``), next to ``ideal_speedup``, the ideal of a layout as wide as
    the decisions. Nothing for a model without a budget."""
    flops = static_widths_flops(model, keep) if hasattr(model, "concept_slots") else None
    if flops is None:
        return {}
    report, slots, _ = flops
    return {"static_ideal_speedup": report.speedup, "static_slots": slots}
