"""Decode tokens/s, eager against compiled, streaming against dense: four decoders side by side after the same
prompt (docs/decoding.md, "Compiled decoding").

    .venv/bin/python -m pytest benchmarks/test_compiled_decode.py --compile on        # tiny backbone, CPU (inductor)
    .venv/bin/python -m pytest benchmarks/test_compiled_decode.py --smollm2 --long --device cuda --dtype bf16 --compile on

The sides: ``dense_eager`` (the backbone with transformers' DynamicCache, ``concept.decoding.DenseDecoder``),
``dense`` (the same layers over a static KV cache, one compiled step:
``concept.static_decoding.StaticDenseDecoder``), ``concept_eager`` (the streaming model's eager decoder,
``ConceptDecoder``) and ``concept`` (its static, compiled step, ``StaticConceptDecoder``); the row's
``speedup`` is compiled dense over compiled streaming, ``eager_speedup`` the same of the eager sides;
``ideal_speedup`` is the eager decoders' FLOP ratio (the middle stack only at a concept), ``static_ideal_speedup``
the compiled steps' (every stack every step, attention over the static capacities). Each is
prefilled once on the prompt (untimed); a call then runs STEPS (CUDA; CPU: CPU_STEPS) greedy steps from where
its last call ended (the sampled token stays on the device), so every side decodes the same number of tokens at the same
context. CPU: one warm-up call each, then the median of 3 alternating rounds; CUDA: ``gpu_side_by_side``
(CUDA events, 3 warm-up calls, where compilation happens, then the median of 20 alternating rounds, one
profiled call of each). ``--compile off`` (the dry run): the static step runs eagerly.

The GPU case: the default build (split 4,18,8 on SmolLM2) with the ``fixed`` policy at 0.125 concepts per
token, a static budget of 0.25, after 8k tokens. In the GPU kit it starts only while its cap is left before
the kit's deadline (the speed stage's plan, ``benchmarks/conftest.py``; the stage interrupts pytest at its
budget in any case).
"""
from __future__ import annotations

import pytest
import torch

from concept import ComponentRef
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.decoding import DenseDecoder
from concept.dense import DenseModel
from concept.flops import Shape, decode_flops, head_classes
from concept.static_decoding import StaticDenseDecoder
from concept.streaming.decoding import ConceptDecoder
from concept.streaming.static_decoding import StaticConceptDecoder

from .conftest import GPU_REPS, GPU_WARMUP, cpu_side_by_side, dtype_name, gpu_case, gpu_side_by_side
from .test_forward import _model

STEPS, CPU_STEPS = 32, 8  # greedy steps per timed call (CUDA, CPU: the GPU kit's dry run runs the CPU case)
CPU_ROUNDS = 3
CASES = [("tiny-llama", 256, 4), ("default", 8192, round(1 / DEFAULT_TARGET_RATIO))]  # (backbone, T, concept every)
SIDES = ("dense_eager", "dense", "concept_eager", "concept")  # ``dense`` / ``concept``: the compiled steps


def decoders(model, ids, calls: int, steps: int, choice: str | None) -> dict:
    """The four sides, prefilled on ``ids`` [1, T]: name -> (decoder, next-token logits). The static ones hold
    ``calls`` calls of ``steps`` steps."""
    valid = torch.ones_like(ids, dtype=torch.bool)
    made = {"dense_eager": DenseDecoder(model.backbone),
            "dense": StaticDenseDecoder(DenseModel(model.backbone).eval(), calls * steps, choice),
            "concept_eager": ConceptDecoder(model),
            "concept": StaticConceptDecoder(model, calls * steps, choice)}
    return {name: [d, d.prefill(ids, valid)] for name, d in made.items()}


def static_ideal(shape: Shape, split, steps: int, capacities: tuple[int, int, int], dense_capacity: int,
                 concept_classes: int) -> float:
    """The ideal FLOP ratio of the two compiled steps: both run every layer at every step (the streaming one its
    middle stack too, whatever the decisions) and attend over their caches' whole static capacities."""
    stacks = sum(n * (shape.linear(steps) + shape.attention(steps * c)) for n, c in zip(split, capacities))
    dense = sum(split) * (shape.linear(steps) + shape.attention(steps * dense_capacity))
    lm_head = 2.0 * steps * shape.hidden * shape.vocab
    return (dense + lm_head) / (stacks + 2.0 * steps * shape.hidden * concept_classes + lm_head)


def stepping(sides: dict, name: str, steps: int):
    """A call running ``steps`` greedy steps of side ``name`` from where it stopped."""
    def run():
        decoder, logits = sides[name]
        for _ in range(steps):
            logits = decoder.step(logits.argmax(-1))
        sides[name][1] = logits
    return run


@pytest.mark.parametrize("backbone,T,every", CASES, ids=[f"{b}-T{t}-compiled-decode" for b, t, _ in CASES])
def test_compiled_decode_vs_dense(benchmark, record, request, device, dtype, compile_choice, backbone, T, every):
    if backbone == "default":
        gpu_case(request, device, T)
    choice = None if compile_choice == "off" else compile_choice
    policy = ComponentRef("fixed", {"every": every})
    model = _model(backbone, "chunked", policy, max_ratio=2 / every).eval().to(device, dtype)
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (1, T)).to(device)
    cuda = device.type == "cuda"
    calls = (GPU_WARMUP + GPU_REPS + 1 if cuda else 1 + CPU_ROUNDS) + 3 + 1  # + pedantic's rounds, + a spare
    steps = STEPS if cuda else CPU_STEPS
    with torch.no_grad():
        sides = decoders(model, ids, calls, steps, choice)
        if benchmark.disabled:  # smoke run (CI): two steps each, no timing claims
            for name in SIDES:
                stepping(sides, name, 2)()
            return
        fns = {name: stepping(sides, name, steps) for name in SIDES}
        timing = gpu_side_by_side(fns, device) if cuda else cpu_side_by_side(fns, CPU_ROUNDS)
        benchmark.pedantic(fns["concept"], rounds=3, iterations=1)
        keep = torch.tensor(sides["concept"][0].keep[0])
    shape = Shape.from_hf_config(model.backbone.config)
    ideal = decode_flops(shape, model.split, keep, head_classes(model), steps).speedup  # the eager decoders'
    caches = sides["concept"][0].cache.stacks().values()
    static = static_ideal(shape, model.split, steps, tuple(c.capacity for c in caches), sides["dense"][0].cache.capacity,
                          head_classes(model))
    s = {name: timing[f"{name}_s"] for name in SIDES}

    label = f"decode {backbone} ctx={T} fixed compiled ({choice or 'static step eager'})"
    record(benchmark, label, timing, ideal, T=T, suite="decode-compiled", dtype=dtype_name(dtype), concept_compile=choice,
           steps=steps, decode_ratio=float(keep[-steps:].float().mean()), max_ratio=model.max_ratio,
           static_ideal_speedup=static, eager_speedup=s["dense_eager"] / s["concept_eager"], compile_speedup_concept=s["concept_eager"] / s["concept"],
           compile_speedup_dense=s["dense_eager"] / s["dense"],
           **{f"{name}_tokens_per_s": steps / s[name] for name in SIDES})
