"""The deep stack over its block (``packing.DeepBlock``: concepts and tail in T slots) against the same model over the
layout's ``[concepts ; tail]`` (C + T slots; ``model.deep_block = False``) and the dense backbone, side by side in
one run, next to each one's static FLOP ideal (``flops.forward_flops(static_slots=..., deep_block=...)``).

    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_deep_block.py --smollm2 -s      # the real backbone
    PYTHONPATH=. .venv/bin/python -m pytest benchmarks/test_deep_block.py --smollm2 --device cuda --dtype bf16 -s

The default build (SmolLM2-135M, split 4,18,8, the `auto` budget, `auto` attention: `chunked` on a CPU, `flex` on
CUDA), its decisions forced evenly at 0.125 concepts per token (within the budget): a no-grad forward of one row, and
a training step (forward + backward, LoRA on every projection) of the demo recipe's rows of 128 tokens. Without
``--smollm2`` (and in the default suite, ``--benchmark-disable``) the tiny random backbone.
"""
from __future__ import annotations

import pytest
import torch

from concept.dense import DenseModel
from concept.flops import evenly_spaced_keep
from concept.lora import LoraSettings, add_lora
from concept.streaming.family import static_widths_flops
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

from .conftest import autocast, dtype_name, side_by_side_named
from .test_forward import _model

CASES = [("forward", 1, 1024), ("forward", 1, 8192), ("train", 4, 128), ("train", 128, 128)]


def ideals(model, T: int) -> dict:
    """The static FLOP ideal over the block and over the layout."""
    keep = evenly_spaced_keep(T, DEFAULT_TARGET_RATIO)
    return {f"{name}_ideal_speedup": static_widths_flops(model, keep, block)[0].speedup
            for name, block in (("block", True), ("layout", False))}


@pytest.mark.parametrize("kind,B,T", CASES, ids=[f"{k}-B{b}-T{t}" for k, b, t in CASES])
def test_deep_block_vs_layout_vs_dense(benchmark, record, request, device, dtype, kind, B, T):
    real = request.config.getoption("--smollm2")
    if (T == 8192 or B == 128) and device.type != "cuda":
        pytest.skip("a GPU case (--device cuda)")
    if benchmark.disabled:  # the smoke run: the same code on the tiny backbone and a short row
        real, B, T = False, min(B, 2), 64
    model = _model("default" if real else "tiny-llama", "auto")
    assert model.plans_deep_block()
    precision = dtype if device.type == "cuda" else torch.float32
    if kind == "train":
        add_lora(model.backbone, LoraSettings())
    model.to(device).train(kind == "train")
    dense = DenseModel(model.backbone).train(kind == "train")
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (B, T), device=device)
    keep = evenly_spaced_keep(T, DEFAULT_TARGET_RATIO)[None].expand(B, T).to(device)

    def run(m, block: bool | None = None, **kw):
        if block is not None:
            m.deep_block = block
        with autocast(device, precision):
            if kind == "forward":
                with torch.no_grad():
                    return m(ids, **kw).logits
            loss = m(ids, labels=ids, **kw).loss
        loss.backward()
        m.zero_grad(set_to_none=True)

    fns = {"dense": lambda: run(dense), "concept": lambda: run(model, True, keep=keep),
           "layout": lambda: run(model, False, keep=keep)}
    if benchmark.disabled:
        for fn in fns.values():
            fn()
        return
    timing = side_by_side_named(fns, rounds=5 if device.type == "cpu" else None, device=device)
    timing["layout_speedup"] = timing["dense_s"] / timing["layout_s"]
    timing["block_over_layout"] = timing["layout_s"] / timing["concept_s"]
    benchmark.pedantic(fns["concept"], rounds=1, iterations=1)
    flops = ideals(model, T)
    record(benchmark, f"deep block {kind} B={B} T={T} r={DEFAULT_TARGET_RATIO}", timing,
           flops["block_ideal_speedup"], layout_ideal_speedup=flops["layout_ideal_speedup"], T=T, B=B,
           tokens_per_s=B * T / timing["concept_s"], layout_tokens_per_s=B * T / timing["layout_s"],
           dense_tokens_per_s=B * T / timing["dense_s"], suite="deep-block", dtype=dtype_name(precision))
