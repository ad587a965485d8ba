"""The CPU proxies of a training step's device work, before and after issue 39's items 1-2: aten ops per step,
casts of frozen weights per step, and the largest [rows, V] tensor (the logits) a step builds.

    .venv/bin/python -m pytest benchmarks/test_step_counts.py -s

Each model has SmolLM2's 30 decoder layers (the op counts follow the layers, not their width) at a tiny
width (64, vocabulary 512), LoRA on every projection, one step of the demo recipe's shape (rows of 128
tokens, here 2 of them) under bf16 autocast: forward, loss, backward, AdamW (``step_counts.training_step``).
``today``: the fp32 base under autocast, the CE from the whole batch's logits; ``new``: the frozen base
stored in bf16 and the chunked CE. The streaming model is the default build's split (4,18,8) with the
null policy, the pruned baseline its FLOP-matched block at 0.125 concepts per token. Counted by
``StepCounter`` (a ``TorchDispatchMode``); the numbers are exact counts, the same on every run.
"""
from __future__ import annotations

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.dense import DenseModel
from concept.flops import Shape, head_classes, matched_prune
from concept.lora import LoraSettings, add_lora
from concept.precision import store_frozen_base

from .step_counts import StepCounter, frozen_parameters, training_step

SPLIT = (4, 18, 8)
KINDS = ["streaming", "pruned", "dense"]
B, T, VOCAB = 2, 128, 512


def model_of(kind: str, split=SPLIT):
    torch.manual_seed(0)
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": sum(split), "hidden": 64, "heads": 4,
                                                          "kv_heads": 2, "intermediate": 128, "vocab": VOCAB}),
                      split=",".join(map(str, split)))
    model = concept.build(cfg)
    if kind != "streaming":
        removed = None
        if kind == "pruned":
            prune = matched_prune(Shape.from_hf_config(model.backbone.config), split, head_classes(model),
                                  DEFAULT_TARGET_RATIO, T)
            removed = prune.removed if prune.kept < prune.num_layers else None  # (as the baseline: none to remove)
        model = DenseModel(model.backbone, removed=removed)
    add_lora(model.backbone, LoraSettings())
    return model.train()


def counts(kind: str, split=SPLIT, T=T) -> dict[str, StepCounter]:
    """Both versions on one model: ``today`` (fp32 base), then the base stored in bf16 and ``new``; each
    counted on its second step (the optimizer's state exists from the first on)."""
    model = model_of(kind, split)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    found = {}
    for version in ("today", "new"):
        if version == "new":
            store_frozen_base(model, torch.bfloat16)
        training_step(model, batch, version, optimizer)
        found[version] = StepCounter(frozen_parameters(model), vocab=VOCAB)
        with found[version]:
            training_step(model, batch, version, optimizer)
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_ops_and_frozen_casts_per_training_step(benchmark, kind):
    if benchmark.disabled and kind != "dense":  # (bf16 matmuls are slow on a CPU without bf16 units)
        pytest.skip("the smoke run counts the dense step only")
    split, length = ((1, 2, 1), 16) if benchmark.disabled else (SPLIT, T)  # the smoke run: 4 layers, 16 tokens
    found = counts(kind, split, length)
    row = {"case": f"train step {kind} {sum(split)} layers B={B} T={length}", "suite": "step-counts"}
    for version, c in found.items():
        row.update({f"{version}_ops": c.total, f"{version}_frozen_casts": sum(c.frozen_casts.values()),
                    f"{version}_copies": c.ops["_to_copy"] + c.ops["copy_"], f"{version}_logit_rows": c.logit_rows})
    row["ops_ratio"] = row["new_ops"] / row["today_ops"]
    benchmark.extra_info.update(row)
    print(f"\n{row}")
    assert row["new_frozen_casts"] == 0 < row["today_frozen_casts"]
    assert row["new_ops"] < row["today_ops"]
    if not benchmark.disabled:
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # (no timing: the counts are the result)
