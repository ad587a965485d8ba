"""The adapted projection's three Triton kernels (``concept.lora_triton``) against the matmuls they replace
(``concept.lora.LoraMatmuls``): outputs and the gradients of x, A and B.

Used two ways: ``TRITON_INTERPRET=1 python -m tests.lora_triton_cases`` runs every check on CPU tensors in
Triton's interpreter and prints a JSON report (``tests/test_lora_triton.py`` runs it in a subprocess: the
interpreter must be chosen before Triton is first imported), and ``tests/test_lora_triton.py``'s ``cuda`` tests
call the same checks on a GPU (compiled kernels).

- ``compare``: fp32, each result's relative L2 error against the matmuls' (the same products, summed in
  another order); bf16, each result's error against fp64 next to the matmuls' own (the kernels round ``y`` and
  ``dx`` once where the matmuls round twice). Shapes that fill no tile evenly, ranks 4 to 32, a frozen base of
  zeros (the output is the adapter's alone), a non-power-of-two scale, strided inputs.
- ``negative``: what the comparison must catch: the adapter scaled 1 % wrong (a base of zeros), and ranks past
  the kernels' rank tile dropped (a rank-32 adapter through a tile of 16).
- ``model``: a tiny streaming model with LoRA, one training forward and backward with ``--lora-kernel triton`` (and
  ``auto``, which where the kernels run is they, bit for bit)
  and with the matmuls: loss and every adapter gradient in fp32, against each other; under bf16 autocast, each
  against the fp32 matmuls.
"""
from __future__ import annotations

import copy
import json
import sys

import torch

from concept import lora_triton
from concept.lora import LoraMatmuls

# (rows, in, out, rank): none a multiple of the tiles (128 rows, 128 outputs, 64 of the reduction) but the last
SHAPES = [(200, 96, 80, 8), (130, 64, 192, 4), (257, 160, 48, 16), (96, 72, 40, 32), (128, 128, 128, 8)]
SCALES = (2.0, 0.3)  # a power of two (the defaults: alpha 16, rank 8) and not


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def operands(shape, seed: int, device, zero_base: bool = False):
    """fp64 x, W, A, B and an output gradient for ``shape``; x and the gradient strided (views of wider tensors)."""
    rows, fan_in, fan_out, rank = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * fan_in, generator=g, dtype=torch.float64)[:, ::2]
    w = torch.randn(fan_out, fan_in, generator=g, dtype=torch.float64) / fan_in ** 0.5
    a = torch.randn(rank, fan_in, generator=g, dtype=torch.float64) / fan_in ** 0.5
    b = torch.randn(fan_out, rank, generator=g, dtype=torch.float64)
    grad = torch.randn(fan_out, rows, generator=g, dtype=torch.float64).t()
    if zero_base:
        w = torch.zeros_like(w)
    return [t.to(device) for t in (x, w, a, b, grad)]


def results(products, tensors, dtype, scaling):
    """(y, dx, dA, dB) of ``products(x, W, A, B, s)`` on ``tensors`` cast to ``dtype``."""
    x, w, a, b, grad = (t.to(dtype) for t in tensors)
    x, a, b = (t.detach().requires_grad_() for t in (x, a, b))
    y = products(x, w, a, b, scaling)
    return [y, *torch.autograd.grad(y, (x, a, b), grad)]


def matmuls(x, w, a, b, scaling):
    return LoraMatmuls.apply(x, w, a, b, scaling, x.dtype)


def kernels(x, w, a, b, scaling):
    return lora_triton.lora_linear(x, w, a, b, scaling)


NAMES = ("y", "dx", "dA", "dB")


def compare(device="cpu") -> dict:
    report = {}
    for i, shape in enumerate(SHAPES):
        for scaling in SCALES:
            for zero_base in (False, True):
                tensors = operands(shape, i, device, zero_base)
                key = f"{shape} s={scaling}{' base 0' if zero_base else ''}"
                exact = results(matmuls, tensors, torch.float64, scaling)
                fp32 = zip(results(kernels, tensors, torch.float32, scaling),
                           results(matmuls, tensors, torch.float32, scaling))
                ours = results(kernels, tensors, torch.bfloat16, scaling)
                theirs = results(matmuls, tensors, torch.bfloat16, scaling)
                report[key] = {
                    "fp32": {n: relative(k, m) for n, (k, m) in zip(NAMES, fp32)},
                    "bf16": {n: relative(k, e) for n, k, e in zip(NAMES, ours, exact)},
                    "bf16_matmuls": {n: relative(m, e) for n, m, e in zip(NAMES, theirs, exact)},
                    "dtypes": sorted({str(t.dtype) for t in ours}),
                }
    return report


def negative_controls(device="cpu") -> dict:
    from concept import lora_triton_kernels

    tensors = operands(SHAPES[0], 0, device, zero_base=True)
    right = results(matmuls, tensors, torch.float32, 2.0)
    wrong_scale = results(kernels, tensors, torch.float32, 2.0 * 1.01)
    shape = SHAPES[3]  # rank 32
    tensors = operands(shape, 3, device)
    rank_tile = lora_triton_kernels._rank_tile
    lora_triton_kernels._rank_tile = lambda r: 16
    try:
        dropped = results(kernels, tensors, torch.float32, 2.0)
    finally:
        lora_triton_kernels._rank_tile = rank_tile
    want = results(matmuls, tensors, torch.float32, 2.0)
    return {"scale 1 % off": {n: relative(k, m) for n, k, m in zip(NAMES, wrong_scale, right)},
            "ranks past 16 dropped": {n: relative(k, m) for n, k, m in zip(NAMES, dropped, want)}}


def no_rows(device="cpu") -> dict:
    """A projection of an input with no rows: its output [0, out] and the adapters' gradients zeros, as the
    matmuls give."""
    tensors = operands((0, 64, 48, 8), 0, device)
    ours, theirs = results(kernels, tensors, torch.float32, 2.0), results(matmuls, tensors, torch.float32, 2.0)
    return {"shapes": [list(t.shape) for t in ours], "equal": all(torch.equal(k, m) for k, m in zip(ours, theirs))}


def model_step(device="cpu") -> dict:
    """A tiny streaming model's loss and adapter gradients, its projections through the kernels and through the
    matmuls (one model, each projection's ``adapter_kernel`` switched), fp32 and under bf16 autocast."""
    from concept.lora import LoraSettings, add_lora, fused_lora_class
    from tests.conftest import mixed_model
    from tests.test_host_syncs import forward_inputs

    model = copy.deepcopy(mixed_model("null")).to(device).train()
    add_lora(model.backbone, LoraSettings(kernel="triton"))
    g = torch.Generator().manual_seed(5)
    for name, p in model.backbone.named_parameters():
        if "lora_B" in name:  # (peft starts B at 0)
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    layers = [m for m in model.modules() if type(m) is fused_lora_class()]
    inputs = {k: v.to(device) for k, v in forward_inputs().items()}
    adapters = [p for n, p in model.backbone.named_parameters() if "lora_" in n]
    keep = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    keep[:, ::3] = True

    def run(kernel: str, autocast: bool):
        for m in layers:
            m.adapter_kernel = kernel
        torch.manual_seed(0)  # (training samples its concepts)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs, labels=inputs["input_ids"], keep=keep).loss
        return [loss, *torch.autograd.grad(loss, adapters)]

    report = {"layers": len(layers)}
    exact = run("matmuls", False)  # (fp32: the reference of both bf16 runs)
    ours = run("triton", False)
    report["fp32"] = {"loss": relative(ours[0], exact[0]), "gradients": len(ours) - 1,
                      "worst adapter gradient": max(relative(k, m) for k, m in zip(ours[1:], exact[1:]))}
    # ``--lora-kernel auto`` where the kernels run: the kernels, bit for bit
    report["auto is the kernels"] = all(torch.equal(a, k) for a, k in zip(run("auto", False), ours))
    ours, theirs = run("triton", True), run("matmuls", True)
    report["bf16 autocast, against fp32"] = {
        name: {"loss": relative(got[0], exact[0]),
               "worst adapter gradient": max(relative(k, m) for k, m in zip(got[1:], exact[1:]))}
        for name, got in (("kernels", ours), ("matmuls", theirs))}
    return report


def compiled_step(device="cuda") -> dict:
    """Two adapted projections (SmolLM2's widths, 512 rows) in a bf16 training step: compiled with inductor and
    ``fullgraph=True`` through the kernels, against eager through the matmuls (loss and adapter gradients)."""
    from torch import nn
    from torch._dynamo.utils import counters

    from concept.lora import LoraSettings, add_lora, fused_lora_class

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = nn.Linear(576, 1536, bias=False)
            self.down_proj = nn.Linear(1536, 576, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.up_proj(x)))

    torch.manual_seed(0)
    model = add_lora(Two(), LoraSettings(targets="up_proj,down_proj", kernel="triton")).to(device)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    layers = [m for m in model.modules() if type(m) is fused_lora_class()]
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    x = torch.randn(2, 256, 576, device=device)

    def step(fn, kernel: str):
        for m in layers:
            m.adapter_kernel = kernel
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = fn(x).float().pow(2).mean()
        return [loss, *torch.autograd.grad(loss, adapters)]

    torch._dynamo.reset()
    counters.clear()
    ours = step(torch.compile(model, fullgraph=True), "triton")
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    theirs = step(model, "matmuls")
    return {"graph_breaks": breaks, "loss": relative(ours[0], theirs[0]),
            "worst adapter gradient": max(relative(k, m) for k, m in zip(ours[1:], theirs[1:]))}


def main() -> int:
    if not lora_triton.interpreted():
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(json.dumps({"compare": compare(), "negative": negative_controls(), "model": model_step(),
                      "no_rows": no_rows()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
