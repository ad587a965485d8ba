"""Decode tokens/s: the streaming model with its three KV caches vs the dense backbone with
transformers' DynamicCache, side by side, after the same prompt, at several context lengths.

    .venv/bin/python -m pytest benchmarks/test_decode.py              # tiny backbone (fast)
    .venv/bin/python -m pytest benchmarks/test_decode.py --smollm2    # + SmolLM2-135M at 512..4096
    .venv/bin/python -m pytest benchmarks/test_decode.py --smollm2 --long --device cuda --dtype bf16   # + the GPU cases

Each round prefills both models on the prompt (untimed), then times STEPS greedy decoding
steps of each, alternating. Two streaming models per context length:

* ``null`` (the learned policy, untrained head): the NULL bias is set so that about RATIO of the
  prompt's tokens emit a concept; the decisions during decoding are the policy's own, so the
  ratio realised while decoding can differ from RATIO;
* ``fixed`` (``fixed`` policy, a concept every 1 / RATIO = 4 tokens): exactly RATIO.

Each case's name and ``extra_info`` carry the ratio realised in the timed steps
(``decode_ratio``) and over the prompt (``prompt_ratio``); the ideal speed-up is computed from
the realised decisions (``concept.flops.decode_flops``). On CUDA the peak memory of each model's
prefill and steps is recorded too.

The GPU cases: the default build (split 4,18,8 on SmolLM2) with the ``fixed`` policy at its
operating point (a concept every 8 tokens: 0.125 per token), after 2k / 8k / 16k tokens of context;
and **prefill** alone (the one-pass forward over the prompt that fills the KV caches, logits for
the last token only) against the dense backbone's prefill, next to its ideal FLOP ratio, with a third side: the
same prefill over the static layout instead of its deep block (``model.deep_block = False``).
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from concept import ComponentRef
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.decoding import DenseDecoder
from concept.streaming.decoding import ConceptDecoder
from concept.flops import Shape, decode_flops, evenly_spaced_keep, forward_flops, head_classes

from .conftest import GPU_LENGTHS, GPU_REPS, dtype_name, gpu_case, side_by_side_named, synchronize
from .test_forward import _model

RATIO = 0.25
STEPS = 32
CONTEXTS = [("tiny-llama", 256), ("tiny-llama", 1024), ("smollm2", 512), ("smollm2", 2048), ("smollm2", 4096)]
POLICIES = {"null": ComponentRef("null"), "fixed": ComponentRef("fixed", {"every": round(1 / RATIO)})}
CASES = [(b, t, p) for b, t in CONTEXTS for p in POLICIES]
DEFAULT_POLICY = ComponentRef("fixed", {"every": round(1 / DEFAULT_TARGET_RATIO)})  # the GPU cases' decisions
PREFILL_CASES = [("tiny-llama", 512)] + [("default", t) for t in GPU_LENGTHS]


def _calibrate(model, ids, ratio):
    """Move the NULL bias so that ``ratio`` of the prompt's tokens emit a concept (max-run forcing aside)."""
    with torch.no_grad():
        logit = model.length_policy.keep_logit(model(ids).head_logits).flatten()
        model.length_policy.null_bias += torch.quantile(logit.double(), 1 - ratio).float()


def _prefill(decoder, ids):
    return decoder, decoder.prefill(ids, torch.ones_like(ids, dtype=torch.bool))


def _steps(decoder, logits, steps=STEPS):
    for _ in range(steps):
        logits = decoder.step(logits.argmax(-1))


def _decode(decoder, ids, steps, peak=None):
    """Prefill (untimed), then ``steps`` greedy steps (timed). Returns (seconds, decoder). On CUDA,
    ``peak[name]`` gets the peak memory (MiB) of the prefill and the steps."""
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ids.device)
    decoder, logits = _prefill(decoder, ids)
    synchronize(logits.device)
    if cuda:  # CUDA events around the steps (docs/benchmarks.md)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _steps(decoder, logits, steps)
        end.record()
        synchronize(logits.device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        start = time.perf_counter()
        _steps(decoder, logits, steps)
        seconds = time.perf_counter() - start
    if cuda and peak is not None:
        peak["dense" if isinstance(decoder, DenseDecoder) else "concept"] = torch.cuda.max_memory_allocated(ids.device) / 2**20
    return seconds, decoder


@pytest.mark.parametrize("backbone,T,policy", CASES, ids=[f"{b}-T{t}-{p}" for b, t, p in CASES])
def test_decode_vs_dense(benchmark, record, request, device, backbone, T, policy):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    measure_decode(benchmark, record, _model(backbone, "chunked", POLICIES[policy]).eval().to(device), T, device,
                   f"decode {backbone} ctx={T} {policy}", policy=policy, target_ratio=RATIO)


@pytest.mark.parametrize("T", GPU_LENGTHS, ids=[f"default-T{t}-fixed" for t in GPU_LENGTHS])
def test_decode_default_point_vs_dense(benchmark, record, request, device, dtype, T):
    gpu_case(request, device, T)
    model = _model("default", "chunked", DEFAULT_POLICY).eval().to(device, dtype)
    measure_decode(benchmark, record, model, T, device, f"decode default ctx={T} fixed", policy="fixed",
                   target_ratio=DEFAULT_TARGET_RATIO, backend="chunked", dtype=dtype_name(dtype))


def measure_decode(benchmark, record, model, T, device, name, **extra):
    """Prefill both models on the same random prompt (untimed), then time STEPS greedy steps of each,
    alternating (median of 3 rounds; on CUDA of GPU_REPS, by CUDA events, then one profiled run of the steps
    of each), next to the ideal FLOP ratio of the realised decisions."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (1, T)).to(device)
    if hasattr(model.length_policy, "null_bias"):
        _calibrate(model, ids, RATIO)
    if benchmark.disabled:  # smoke run (CI): a few steps each, no timing claims
        _decode(ConceptDecoder(model), ids, 2), _decode(DenseDecoder(model.backbone), ids, 2)
        return
    dense_s, concept_s, peak = [], [], {}
    _decode(DenseDecoder(model.backbone), ids, 2), _decode(ConceptDecoder(model), ids, 2)  # warm-up
    for _ in range(GPU_REPS if device.type == "cuda" else 3):
        dense_s.append(_decode(DenseDecoder(model.backbone), ids, STEPS, peak)[0])
        seconds, decoder = _decode(ConceptDecoder(model), ids, STEPS, peak)
        concept_s.append(seconds)
    d, c = statistics.median(dense_s), statistics.median(concept_s)
    profiled = profile_steps(model, ids) if device.type == "cuda" else {}
    keep = torch.tensor(decoder.keep[0])
    classes = head_classes(model)
    ideal = decode_flops(Shape.from_hf_config(model.backbone.config), model.split, keep, classes, STEPS)
    kv = decoder.kv_stats()[0]
    benchmark.pedantic(_steps, setup=lambda: (_prefill(ConceptDecoder(model), ids), {}), rounds=3, iterations=1)
    decode_ratio, prompt_ratio = float(keep[-STEPS:].float().mean()), float(keep[:T].float().mean())
    memory = {"dense_peak_mib": peak["dense"], "concept_peak_mib": peak["concept"]} if peak else {}
    record(benchmark, f"{name} r={decode_ratio:.2f} ({STEPS} steps)",
           {"dense_s": d, "concept_s": c, "speedup": d / c, **memory}, ideal.speedup,
           T=T, dense_tokens_per_s=STEPS / d, concept_tokens_per_s=STEPS / c,
           decode_ratio=decode_ratio, prompt_ratio=prompt_ratio, ratio=decode_ratio,
           kv_bytes=kv["bytes"], dense_kv_bytes=kv["dense_bytes"], kv_saving=kv["dense_bytes"] / kv["bytes"],
           suite="decode", **profiled, **extra)


def profile_steps(model, ids) -> dict:
    """STEPS greedy steps of each decoder after its prefill, once under ``torch.profiler``: device busy,
    kernel launches, host syncs, aten ops (``dense_...`` / ``concept_...``)."""
    from concept.profiling import profile_call

    out = {}
    for name, make in (("dense", lambda: DenseDecoder(model.backbone)), ("concept", lambda: ConceptDecoder(model))):
        decoder, logits = _prefill(make(), ids)
        prof = profile_call(lambda: _steps(decoder, logits), ids.device)
        out.update({f"{name}_{k}": prof[k] for k in ("wall_s", "device_busy_s", "kernel_launches", "host_syncs",
                                                      "aten_ops")})
    return out


@pytest.mark.parametrize("backbone,T", PREFILL_CASES, ids=[f"{b}-T{t}" for b, t in PREFILL_CASES])
def test_prefill_vs_dense(benchmark, record, request, device, dtype, backbone, T):
    if backbone == "default":
        gpu_case(request, device, T)
    policy = DEFAULT_POLICY if backbone == "default" else POLICIES["fixed"]
    model = _model(backbone, "chunked", policy).eval().to(device, dtype)
    ratio = DEFAULT_TARGET_RATIO if backbone == "default" else RATIO
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (1, T)).to(device)
    valid = torch.ones_like(ids, dtype=torch.bool)

    def concept(block: bool = True):  # (block: the deep stack over the static layout's deep block, else the layout)
        model.deep_block = block
        return ConceptDecoder(model).prefill(ids, valid)

    fns = {"dense": lambda: DenseDecoder(model.backbone).prefill(ids, valid), "concept": concept,
           "layout": lambda: concept(False)}
    if benchmark.disabled:  # smoke run (CI): one call each, no timing claims
        for fn in fns.values():
            fn()
        return
    timing = side_by_side_named(fns, device=device)
    timing["layout_speedup"] = timing["dense_s"] / timing["layout_s"]
    timing["block_over_layout"] = timing["layout_s"] / timing["concept_s"]
    benchmark.pedantic(concept, rounds=3, iterations=1)
    shape = Shape.from_hf_config(model.backbone.config)
    flops = forward_flops(shape, model.split, evenly_spaced_keep(T, ratio), head_classes(model))
    lm_head = 2.0 * shape.hidden * shape.vocab  # per position; a prefill computes the last position's logits only
    ideal = (flops.dense - (T - 1) * lm_head) / (flops.concept - (T - 1) * lm_head)
    record(benchmark, f"prefill {backbone} T={T} r={ratio}", timing, ideal, T=T, ratio=ratio, backend="chunked",
           suite="prefill", dtype=dtype_name(dtype))
