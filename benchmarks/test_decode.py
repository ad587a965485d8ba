"""Decode tokens/s: the streaming model with its three KV caches vs the dense backbone with
transformers' DynamicCache, side by side, after the same prompt, at several context lengths.

    .venv/bin/python -m pytest benchmarks/test_decode.py              # tiny backbone (fast)
    .venv/bin/python -m pytest benchmarks/test_decode.py --smollm2    # + SmolLM2-135M at 512..4096

Each round prefills both models on the prompt (untimed), then times STEPS greedy decoding
steps of each, alternating. Two streaming models per context length:

* ``null`` (the learned policy, untrained head): the NULL bias is set so that about RATIO of the
  prompt's tokens emit a concept; the decisions during decoding are the policy's own, so the
  ratio realised while decoding can differ from RATIO;
* ``fixed`` (``fixed`` policy, a concept every 1 / RATIO = 4 tokens): exactly RATIO.

Each case's name and ``extra_info`` carry the ratio realised in the timed steps
(``decode_ratio``) and over the prompt (``prompt_ratio``); the ideal speed-up is computed from
the realised decisions (``concept.flops.decode_flops``).
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from concept import ComponentRef
from concept.decoding import ConceptDecoder, DenseDecoder
from concept.flops import Shape, decode_flops, head_classes

from .conftest import synchronize
from .test_forward import _model

RATIO = 0.25
STEPS = 32
CONTEXTS = [("tiny-llama", 256), ("tiny-llama", 1024), ("smollm2", 512), ("smollm2", 2048), ("smollm2", 4096)]
POLICIES = {"null": ComponentRef("null"), "fixed": ComponentRef("fixed", {"every": round(1 / RATIO)})}
CASES = [(b, t, p) for b, t in CONTEXTS for p in POLICIES]


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


def _decode(decoder, ids, steps):
    """Prefill (untimed), then ``steps`` greedy steps (timed). Returns (seconds, decoder)."""
    decoder, logits = _prefill(decoder, ids)
    synchronize(logits.device)
    start = time.perf_counter()
    _steps(decoder, logits, steps)
    synchronize(logits.device)
    return time.perf_counter() - start, decoder


@pytest.mark.parametrize("backbone,T,policy", CASES, ids=[f"{b}-T{t}-{p}" for b, t, p in CASES])
def test_decode_vs_dense(benchmark, record, request, device, backbone, T, policy):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    model = _model(backbone, "chunked", POLICIES[policy]).eval().to(device)
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (1, T)).to(device)
    if hasattr(model.length_policy, "null_bias"):
        _calibrate(model, ids, RATIO)
    if benchmark.disabled:  # smoke run (CI): a few steps each, no timing claims
        _decode(ConceptDecoder(model), ids, 2), _decode(DenseDecoder(model.backbone), ids, 2)
        return
    dense_s, concept_s = [], []
    _decode(DenseDecoder(model.backbone), ids, 2), _decode(ConceptDecoder(model), ids, 2)  # warm-up
    for _ in range(3):
        dense_s.append(_decode(DenseDecoder(model.backbone), ids, STEPS)[0])
        seconds, decoder = _decode(ConceptDecoder(model), ids, STEPS)
        concept_s.append(seconds)
    d, c = statistics.median(dense_s), statistics.median(concept_s)
    keep = torch.tensor(decoder.keep[0])
    classes = head_classes(model)
    ideal = decode_flops(Shape.from_hf_config(model.backbone.config), model.split, keep, classes, STEPS)
    kv = decoder.kv_stats()[0]
    benchmark.pedantic(_steps, setup=lambda: (_prefill(ConceptDecoder(model), ids), {}), rounds=3, iterations=1)
    decode_ratio, prompt_ratio = float(keep[-STEPS:].float().mean()), float(keep[:T].float().mean())
    record(benchmark, f"decode {backbone} ctx={T} {policy} r={decode_ratio:.2f} ({STEPS} steps)",
           {"dense_s": d, "concept_s": c, "speedup": d / c}, ideal.speedup,
           T=T, policy=policy, target_ratio=RATIO, dense_tokens_per_s=STEPS / d, concept_tokens_per_s=STEPS / c,
           decode_ratio=decode_ratio, prompt_ratio=prompt_ratio, ratio=decode_ratio,
           kv_bytes=kv["bytes"], dense_kv_bytes=kv["dense_bytes"], kv_saving=kv["dense_bytes"] / kv["bytes"])
