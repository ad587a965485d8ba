"""One default build under two of its settings, side by side with the dense backbone: what ``test_deep_block.py``
(the deep block against the layout) and ``test_budget.py`` (``auto``'s rule against the one before) share.

The default build (SmolLM2-135M with ``--smollm2``, else the tiny random backbone; split 4,18,8, `auto` attention:
`chunked` on a CPU, `flex` on CUDA), its decisions forced evenly at 0.125 concepts per token: a no-grad forward of
one row, or a training step (forward + backward, LoRA on every projection). The GPU cases (8k tokens, 128 rows)
skip on a CPU; the smoke run (``--benchmark-disable``) runs every side once on the tiny backbone and 64 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from concept.dense import DenseModel
from concept.flops import evenly_spaced_keep
from concept.lora import LoraSettings, add_lora
from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

from .conftest import autocast
from .test_forward import _model

CASES = [("forward", 1, 1024), ("forward", 1, 8192), ("train", 4, 128), ("train", 128, 128)]
IDS = [f"{k}-B{b}-T{t}" for k, b, t in CASES]


@dataclass
class Case:
    model: torch.nn.Module  # the default build
    dense: torch.nn.Module  # its backbone as the dense model
    keep: torch.Tensor  # [B, T] the forced decisions
    run: Callable  # run(module, **forward kwargs): one no-grad forward, or one training step
    B: int
    T: int
    precision: torch.dtype


def case(request, benchmark, device, dtype, kind: str, B: int, T: int) -> Case:
    """The build, the dense side and the call of one of :data:`CASES` (``pytest.skip`` for a GPU case on a CPU)."""
    real = request.config.getoption("--smollm2")
    if (T == 8192 or B == 128) and device.type != "cuda":
        pytest.skip("a GPU case (--device cuda)")
    if benchmark.disabled:  # the smoke run: the same code on the tiny backbone and a short row
        real, B, T = False, min(B, 2), 64
    model = _model("default" if real else "tiny-llama", "auto")
    precision = dtype if device.type == "cuda" else torch.float32
    if kind == "train":
        add_lora(model.backbone, LoraSettings())
    model.to(device).train(kind == "train")
    dense = DenseModel(model.backbone).train(kind == "train")
    torch.manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (B, T), device=device)
    keep = evenly_spaced_keep(T, DEFAULT_TARGET_RATIO)[None].expand(B, T).to(device)

    def run(m, **kw):
        with autocast(device, precision):
            if kind == "forward":
                with torch.no_grad():
                    return m(ids, **kw).logits
            loss = m(ids, labels=ids, **kw).loss
        loss.backward()
        m.zero_grad(set_to_none=True)

    return Case(model, dense, keep, run, B, T, precision)
