"""A LoRA-adapted projection in three Triton kernels instead of eight matmuls (``--lora-kernel triton``).

``concept.lora.LoraMatmuls`` computes ``y = x W^T + s (x A^T) B^T`` as three matmuls forward and five backward,
each its own kernel (and cuBLAS adds a split-K reduction to each adapter weight gradient's). At the demo
recipe most of them are short: the adapter's products are 8 wide, and in the middle stack the base product too
(``docs/benchmarks.md``, "The step's kernels at their floors"). Here:

- forward, one kernel (``_forward_kernel``): each program's tile of ``y`` accumulates ``x W^T`` and ``x A^T``
  over the same loads of ``x`` (the adapter's r columns recomputed by each column tile: r / BLOCK_N more work,
  6 % at r = 8), then adds ``s h B^T`` in its epilogue; it also writes ``s h`` [N, r] for ``B``'s gradient;
- backward, one kernel (``_backward_kernel``) for ``dx = g W + (s g B) A``, the same way, each row tile also
  writing its shares of the adapters' gradients ``dA = (s g B)^T x`` and ``dB = g^T (s h)`` in fp32, and one
  (``_sum_kernel``) adding the row tiles' shares in order (no atomics: deterministic, so exact resume holds).

Three kernels a projection and step where :class:`~concept.lora.LoraMatmuls` has eight (ten with cuBLAS's
split-K reductions). The values are those of the matmuls up to the order of the fp32 sums: ``h`` and ``s g B``
are rounded to the compute dtype as the matmuls round them, ``y``, ``dx``, ``dA`` and ``dB`` once at the end (the
matmuls round the base and adapter products before adding them).

Each kernel launch is in a ``torch.library.triton_op`` (``concept::lora_forward``, ``concept::lora_backward``)
and :func:`lora_linear` their autograd, so ``torch.compile(fullgraph=True)`` traces them as user kernels.
Where they run (:func:`runs_on`): CUDA with Triton; a CPU only in Triton's interpreter (``TRITON_INTERPRET=1``,
tests). Imported on first use (``concept.lora`` imports this module only when a layer asks for the kernels).
"""
from __future__ import annotations

import importlib.util
import os

import torch

AVAILABLE = importlib.util.find_spec("triton") is not None
# Triton runs its kernels in its interpreter (numpy, on CPU tensors): read once, as Triton reads it
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return INTERPRETED


def runs_on(device) -> bool:
    """Whether the kernels run on ``device``: CUDA with Triton installed, or a CPU in Triton's interpreter."""
    kind = torch.device(device).type
    return AVAILABLE and (kind == "cuda" or (kind == "cpu" and INTERPRETED))


def chosen(kernel: str, device) -> bool:
    """Whether a projection with ``--lora-kernel kernel`` runs these kernels on ``device``: ``triton`` and ``auto``
    where they run (:func:`runs_on`), the matmuls elsewhere (``triton`` is refused there before a run starts:
    ``concept.training.check_training``; a run trained with it resumes or evaluates anywhere)."""
    return kernel != "matmuls" and runs_on(device)


def why_not(device) -> str | None:
    """Why ``--lora-kernel triton`` cannot run on ``device`` (None: it can), with the fix."""
    if not AVAILABLE:
        return "--lora-kernel triton needs the triton package (pip install triton); or use --lora-kernel matmuls"
    if not runs_on(device):
        return (f"--lora-kernel triton runs on CUDA devices (this run trains on {torch.device(device).type}); "
                "use --lora-kernel matmuls here")
    return None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scaling: float) -> torch.Tensor:
    """``x W^T + s (x A^T) B^T`` for 2-D ``x`` [N, in], ``W`` [out, in], ``A`` [r, in], ``B`` [out, r], all one
    dtype, in the kernels and their autograd (``W``'s gradient is never computed: a frozen base)."""
    # lazy: Triton and torch's Triton support take seconds to import, which the matmuls never need
    from . import lora_triton_kernels  # noqa: F401  (registers the ops and their autograd)

    return torch.ops.concept.lora_forward(x, weight, lora_a, lora_b, float(scaling))[0]
