"""One training step (forward + backward, LoRA on every projection) of the streaming model vs the
dense baseline on the same batch, measured side by side.

    .venv/bin/python -m pytest benchmarks/test_train_step.py --smollm2
    .venv/bin/python -m pytest benchmarks/test_train_step.py --smollm2 --long --device cuda --dtype bf16   # + the GPU cases

The GPU cases: the default build at its operating point (0.125 concepts per token), one row of 2k / 8k
/ 16k tokens, per attention backend, under bf16 autocast (what the trainer does on CUDA).

The ``compiled`` cases (``--compile``): the same step with both models' stacks compiled by the library's
compile option (``concept.compiled.compile_model``; the streaming model with the static budget of
``benchmarks/compiled.py``; ``reduce-overhead``, CUDA graphs, on CUDA, where each step first marks a new
CUDA-graph step, as a training loop must), against the dense baseline compiled alike, the decisions forced
evenly at 0.125 concepts per token (within the budget).
"""
from __future__ import annotations

import pytest
import torch

from concept.compiled import compile_model
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.dense import DenseModel
from concept.flops import Shape, evenly_spaced_keep, forward_flops, head_classes
from concept.lora import LoraSettings, add_lora

from . import compiled
from .conftest import GPU_LENGTHS, autocast, dtype_name, gpu_case, side_by_side, skip_unavailable
from .test_forward import GPU_BACKENDS, RATIO, _model

CASES = [("tiny-llama", 2, 256), ("smollm2", 4, 128), ("smollm2", 2, 512)]
GPU_CASES = [(t, a) for t in GPU_LENGTHS for a in GPU_BACKENDS]


@pytest.mark.parametrize("backbone,B,T", CASES, ids=[f"{b}-B{n}-T{t}" for b, n, t in CASES])
def test_train_step_vs_dense(benchmark, record, request, device, backbone, B, T):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    measure_train_step(benchmark, record, _model(backbone, "chunked"), B, T, RATIO, device, torch.float32,
                       f"train step {backbone} B={B} T={T} r={RATIO}", backend="chunked")


@pytest.mark.parametrize("T,attention", GPU_CASES, ids=[f"default-B1-T{t}-{a}" for t, a in GPU_CASES])
def test_train_step_default_point_vs_dense(benchmark, record, request, device, dtype, T, attention):
    gpu_case(request, device, T)
    skip_unavailable(attention)
    measure_train_step(benchmark, record, _model("default", attention), 1, T, DEFAULT_TARGET_RATIO, device, dtype,
                       f"train step default B=1 T={T} r={DEFAULT_TARGET_RATIO} {attention}", backend=attention)


COMPILED_CASES = [("tiny-llama", 2, 256), ("default", 1, 8192)]


@pytest.mark.parametrize("backbone,B,T", COMPILED_CASES, ids=[f"{b}-B{n}-T{t}-compiled" for b, n, t in COMPILED_CASES])
def test_train_step_compiled_vs_dense_compiled(benchmark, record, request, device, dtype, compile_choice, backbone,
                                               B, T):
    if compile_choice == "off":
        pytest.skip("pass --compile for the compiled cases")
    if backbone == "default":
        gpu_case(request, device, T)
    attention = "flex" if device.type == "cuda" else "chunked"
    precision = dtype if device.type == "cuda" else torch.float32
    measure_train_step(benchmark, record, _model(backbone, attention, max_ratio=compiled.BUDGET), B, T,
                       DEFAULT_TARGET_RATIO, device, precision,
                       f"train step {backbone} B={B} T={T} r={DEFAULT_TARGET_RATIO} {attention} compiled ({compile_choice})",
                       backend=attention, compile_choice=compile_choice, suite="train-compiled")


def measure_train_step(benchmark, record, model, B, T, ratio, device, precision, name, compile_choice="off",
                       suite="train", **extra):
    """Forward + backward of the next-token loss (LoRA on every projection) of the concept model
    (decisions forced evenly at ``ratio``) and of the dense baseline, side by side, under autocast to
    ``precision`` (float32: none); with ``compile_choice`` both compiled (``compile_model``)."""
    add_lora(model.backbone, LoraSettings())
    model.to(device)
    dense = DenseModel(model.backbone)
    graphs = compile_choice != "off" and device.type == "cuda"  # reduce-overhead: CUDA graphs
    compile_model(model, compile_choice), compile_model(dense, compile_choice)
    model.train(), dense.train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (B, T)).to(device)
    keep = evenly_spaced_keep(T, ratio)[None].expand(B, T).to(device)
    # ideal: forward FLOPs ratio (backward scales the same way for the layers)
    ideal = forward_flops(Shape.from_hf_config(model.backbone.config), model.split, keep[0].cpu(),
                          head_classes(model))

    def step(m, **kw):
        if graphs:  # the previous step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device, precision):
            loss = m(ids, labels=ids, **kw).loss
        loss.backward()
        m.zero_grad(set_to_none=True)

    if benchmark.disabled:
        step(model, keep=keep), step(dense)
        return
    first = compiled.first_calls({"dense": lambda: step(dense), "concept": lambda: step(model, keep=keep)},
                                 device) if compile_choice != "off" else {}  # (the compilations)
    timing = {**side_by_side(lambda: step(dense), lambda: step(model, keep=keep), rounds=3, device=device), **first}
    benchmark.pedantic(lambda: step(model, keep=keep), rounds=2, iterations=1)
    record(benchmark, name, timing, ideal.speedup, tokens=B * T, dense_tokens_per_s=B * T / timing["dense_s"],
           concept_tokens_per_s=B * T / timing["concept_s"], T=T, ratio=ratio, suite=suite,
           dtype=dtype_name(precision), **({"compile": compile_choice} if compile_choice != "off" else {}), **extra)
