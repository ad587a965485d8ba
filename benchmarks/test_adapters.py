"""What a LoRA adapter costs a projection on the device: an adapted projection's forward and backward (the frozen base
``x W^T`` and the adapter's ``s (x A^T) B^T``, as ``concept.lora.LoraMatmuls`` computes them: 3 matmuls forward, 5
backward) against its frozen base alone (1 forward, 1 backward: the input's gradient), side by side, at the row counts
of the demo recipe's training step: the full-width layers' 16,384 rows (128 x 128 tokens) and the middle stack's
3,328 (26 concept slots a row of 128), for SmolLM2's four projection shapes (q / o 576 -> 576, k / v 576 -> 192,
gate / up 576 -> 1,536, down 1,536 -> 576), bf16, rank 8.

    .venv/bin/python -m pytest benchmarks/test_adapters.py                              # tiny shapes, this CPU
    .venv/bin/python -m pytest benchmarks/test_adapters.py --device cuda --long         # the GPU case

Why: with every kernel at least the shortest of its kind the H200 ran, the streaming step is estimated 1.38x lighter
than dense's, under the 1.4x bar, and most of its kernels at that floor are the adapters' small matmuls, 42 of a
layer's 56 (``docs/benchmarks.md``, "The step's kernels at their floors"). This case measures, on the device, what the
estimate assumed: each side's device time (the profiler's sum of its kernels' own time: no launch gaps counted, what a
CUDA graph of the step runs), its kernels and its short ones (under 5 us a call), per projection. The adapter's
device time at the middle stack's rows against the full-width rows says whether a fused adapter kernel (a
projection's base and adapter products in one kernel) is the lever the ratio bar asks for. Eager: the matmuls are
the library's (cuBLAS) as in the compiled step; the compiled step fuses the adapter's elementwise additions into
their neighbours, so this case counts a few small kernels that step has not.

Where Triton runs (CUDA), a third side, ``kernels``: the same adapted projection through ``--lora-kernel triton``'s
three Triton kernels (``concept.lora_triton``), its output checked the same way: what that option
saves a projection, and how near the base alone it comes.
"""
from __future__ import annotations

import pytest
import torch

from concept import lora_triton
from concept.lora import LoraMatmuls

from .conftest import gpu_case, side_by_side_named

RANK, SCALING = 8, 2.0  # the default LoRA settings (alpha 16, rank 8)
REPEATS = 10  # projections a timed call runs (a call of one is a few microseconds of device time)
# (name, rows, in, out): the demo recipe's full-width rows and the middle stack's, SmolLM2's projections
SMOLLM2 = [(f"{where} {name}", rows, d_in, d_out) for where, rows in (("full-width", 16384), ("middle", 3328))
           for name, d_in, d_out in (("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536),
                                     ("down", 1536, 576))]
TINY = [("tiny a", 64, 64, 64), ("tiny b", 48, 64, 32)]


def projection(rows: int, d_in: int, d_out: int, device, dtype):
    """An input that needs its gradient, the frozen base, the adapter (cast to ``dtype``, as the library casts it
    before a step) and the output gradient."""
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).to(device, dtype)  # noqa: E731
    x = make(rows, d_in).requires_grad_()
    a, b = make(RANK, d_in).requires_grad_(), make(d_out, RANK).requires_grad_()
    return x, make(d_out, d_in), a, b, make(rows, d_out)


def base_alone(x, weight, grad):
    """The frozen base's forward and backward: the input's gradient (returned, as a layer passes it on: nothing
    accumulated into ``.grad``)."""
    return torch.autograd.grad(torch.mm(x, weight.t()), x, grad)


def adapted(x, weight, a, b, grad, dtype):
    """The adapted projection's forward and backward: the input's and both adapters' gradients."""
    return torch.autograd.grad(LoraMatmuls.apply(x, weight, a, b, SCALING, dtype), (x, a, b), grad)


def adapted_by_kernels(x, weight, a, b, grad):
    """:func:`adapted` through ``--lora-kernel triton``'s kernels (``concept.lora_triton``)."""
    return torch.autograd.grad(lora_triton.lora_linear(x, weight, a, b, SCALING), (x, a, b), grad)


def measure_cases(cases, device, dtype) -> list[tuple[str, dict, dict]]:
    """Each case side by side (``dense``: the base alone; ``concept``: adapted; ``kernels``: adapted through the
    Triton kernels, where they run; each call ``REPEATS`` projections), with the per-projection figures: (name,
    timing, the case's fields)."""
    found = []
    triton = lora_triton.runs_on(device)
    for name, n, d_in, d_out in cases:
        x, weight, a, b, grad = projection(n, d_in, d_out, device, dtype)
        expected = torch.mm(x.float(), weight.float().t()) + SCALING * (x.float() @ a.float().t()) @ b.float().t()
        got = LoraMatmuls.apply(x, weight, a, b, SCALING, dtype)
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-3)  # (the adapted side computes it)
        sides = {"dense": lambda: [base_alone(x, weight, grad) for _ in range(REPEATS)],
                 "concept": lambda: [adapted(x, weight, a, b, grad, dtype) for _ in range(REPEATS)]}
        if triton:
            got = lora_triton.lora_linear(x, weight, a, b, SCALING)
            torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-3)
            sides["kernels"] = lambda: [adapted_by_kernels(x, weight, a, b, grad) for _ in range(REPEATS)]
        timing = side_by_side_named(sides, device=device)
        timing["speedup"] = timing["dense_s"] / timing["concept_s"]
        if triton:  # (the matmuls' adapted projection over the kernels')
            timing["kernels_speedup"] = timing["concept_s"] / timing["kernels_s"]
        timing.update({f"{side}_{key}_per_projection": timing[f"{side}_{key}"] / REPEATS
                       for side in sides for key in ("s", "device_busy_s", "kernel_launches")
                       if f"{side}_{key}" in timing})
        sides_named = ["frozen base alone", "with its adapter"] + (["its adapter by the Triton kernels"] * triton)
        fields = {"T": None, "rows": n, "d_in": d_in, "d_out": d_out, "rank": RANK, "repeats": REPEATS,
                  "suite": "adapter-cost", "sides": sides_named, "dtype": str(dtype).removeprefix("torch.")}
        found.append((name, timing, fields))
    return found


def run(benchmark, record, cases, device, dtype):
    found = measure_cases(cases, device, dtype)
    for name, timing, fields in found:
        record(benchmark, f"adapter cost {name} ({fields['rows']} x {fields['d_in']} -> {fields['d_out']})", timing,
               None, **fields)
    if not benchmark.disabled:  # (pytest-benchmark's own row: the last case's adapted projection)
        x, weight, a, b, grad = projection(*cases[-1][1:], device, dtype)
        benchmark.pedantic(lambda: adapted(x, weight, a, b, grad, dtype), rounds=3, iterations=1)
    return found


def test_adapter_cost(benchmark, record, device):
    """This CPU's tiny shapes (fp32): the case's code, and the adapted side's output against the reference."""
    if device.type == "cuda":
        pytest.skip("the GPU runs test_adapter_cost_on_the_gpu")
    found = run(benchmark, record, TINY, device, torch.float32)
    assert len(found) == len(TINY) and all(t["concept_s"] > 0 and t["dense_s"] > 0 for _, t, _ in found)


@pytest.mark.parametrize("recipe", ["default-demo-recipe"], ids=["default-demo-recipe"])
def test_adapter_cost_on_the_gpu(benchmark, record, request, device, recipe):
    """SmolLM2's projections at the demo recipe's two row counts, bf16, on CUDA."""
    gpu_case(request, device, 8192, real_backbone=False)
    found = run(benchmark, record, SMOLLM2, device, torch.bfloat16)
    assert all(t["concept_device_busy_s"] > t["dense_device_busy_s"] for _, t, _ in found)
