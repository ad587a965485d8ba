"""A trained model's inference with its LoRA adapters merged into the base (``concept.load(..., merge_lora=True)``,
``--merge-lora``) against the same model with its adapters, side by side: a no-grad forward, and greedy decoding steps
after a prefill.

    .venv/bin/python -m pytest benchmarks/test_merged.py                 # tiny backbone (fast)
    .venv/bin/python -m pytest benchmarks/test_merged.py --smollm2       # + the default build on SmolLM2
    .venv/bin/python -m pytest benchmarks/test_merged.py --smollm2 --long --device cuda --dtype bf16   # + the GPU cases

The model is the default build (the tiny backbone: split 1,6,1) with LoRA's default settings (rank 8 on the seven
projections of every layer) whose ``B`` is random, as a trained run's is, and loaded as ``concept.load`` loads it: the
fused adapters, and under ``--dtype bf16`` its frozen base stored in bf16 under autocast, the adapters fp32
(``concept.precision.use_dtype``); the merged side is the same model merged in fp32 first. Each row: both sides'
median times (``dense_s`` the adapters', ``concept_s`` the merged model's, as ``sides`` names them; on CUDA by CUDA
events, with each side's device-busy time and kernel launches), ``speedup`` (adapters over merged), its ideal (the
ratio of the two sides' FLOPs, counted by ``torch.utils.flop_counter``: the adapters' products are about 1 % of
SmolLM2's, 5 % of the tiny backbone's) and the aten ops of one call of each side. The merged side does less work of another kind than FLOPs: each adapted projection's two small
matmuls and an add (and under bf16, the adapters' cast per forward) are gone; on a GPU those are kernels of a few
microseconds each.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from concept.lora import LoraSettings, add_lora, merge_adapters
from concept.precision import running, use_dtype
from concept.profiling import count_ops
from concept.streaming.decoding import ConceptDecoder

from .conftest import GPU_LENGTHS, dtype_name, gpu_case, side_by_side_named
from .test_forward import _model

STEPS = 16  # decoding steps a timed call runs
CASES = [("tiny-llama", 512, 256), ("smollm2", 2048, 512), ("default", GPU_LENGTHS[1], GPU_LENGTHS[0])]  # (T, prompt)


def with_adapters(backbone: str, seed: int = 0):
    """The build with LoRA (default settings), ``B`` random at a trained adapter's scale."""
    model = _model(backbone, "chunked")
    add_lora(model.backbone, LoraSettings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return model.eval()


def the_pair(backbone: str, device, dtype):
    """(adapters, merged): the same model with its adapters and merged, each in ``dtype``'s regime on ``device``."""
    adapters = with_adapters(backbone)
    merged = copy.deepcopy(adapters)
    merge_adapters(merged.backbone)
    for model in (adapters, merged):
        use_dtype(model.to(device), "bf16" if dtype == torch.bfloat16 else "fp32")
    return adapters, merged


def decode(model, ids, steps: int = STEPS):
    decoder = ConceptDecoder(model)
    with torch.no_grad(), running(model, ids.device):
        logits = decoder.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
        return lambda: _steps(decoder, logits, steps)


def _steps(decoder, logits, steps):
    with torch.no_grad(), running(decoder.model, logits.device):
        for _ in range(steps):
            logits = decoder.step(logits.argmax(-1))
    return logits


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("backbone,T,context", CASES, ids=[f"{b}-T{t}" for b, t, _ in CASES])
def test_merged_vs_adapters(benchmark, record, request, device, dtype, backbone, T, context):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    if backbone == "default":
        gpu_case(request, device, T)
    adapters, merged = the_pair(backbone, device, dtype)
    torch.manual_seed(0)
    ids = torch.randint(0, adapters.backbone.config.vocab_size, (1, T)).to(device)
    prompt = ids[:, :context]

    def forward(model):
        def call():
            with torch.no_grad():
                return model(ids).logits
        return call

    calls = {"forward": {"adapters": forward(adapters), "merged": forward(merged)},
             f"decode {STEPS} steps": {"adapters": decode(adapters, prompt), "merged": decode(merged, prompt)}}
    if benchmark.disabled:  # smoke run (CI): one call each, no timing claims
        for sides in calls.values():
            for fn in sides.values():
                fn()
        return
    for what, sides in calls.items():
        # the rows' two sides as every suite names them: "dense" the adapters (before), "concept" the merged model
        timing = side_by_side_named({"dense": sides["adapters"], "concept": sides["merged"]}, device=device)
        counted = {f"{side}_aten_ops_counted": count_ops(fn)[1].ops for side, fn in sides.items()}
        ideal = flops(sides["adapters"]) / flops(sides["merged"])
        record(benchmark, f"merged {backbone} T={T} {what}", timing, ideal, T=T, context=context,
               dtype=dtype_name(dtype), suite="merged", sides=("adapters", "merged"), **counted)
    benchmark.pedantic(calls["forward"]["merged"], rounds=3, iterations=1)
