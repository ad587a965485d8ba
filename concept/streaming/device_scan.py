"""Sequential length-policy rules run on the device: one Triton kernel per rule, no host synchronisation.

The same rules as the host scan (``concept.streaming.host_scan``), written for a GPU
(``concept.streaming.scan_kernels``, imported on first use): each program takes a row (on CUDA; a block of
rows in the interpreter), keeps its state in registers and loops over t, reading the per-token inputs the
policy computed for all t at once and writing keep [B, T] and the state after the last token. Nothing is
read back to the host: a decided forward and a training step then have no host sync at all (CUDA graphs can
capture them). Each kernel is a ``torch.library.triton_op`` (``concept::null_tracker_scan``,
``concept::chunk_scan``, ``concept::tracked_chunk_scan``, ``concept::threshold_scan``), so ``torch.compile``
traces it with ``fullgraph=True``; it decides what the host scan decides, bit for bit (integers; ``threshold``'s
sums added in p's dtype in the same order), which ``tests/test_device_scan.py`` checks in Triton's interpreter on
CPU and the GPU kit's ``exact`` stage on CUDA.

Where it runs (:func:`runs_on`): on CUDA when Triton is installed; on a CPU only inside ``choose(True)``
(tests), which needs Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is first imported).
Elsewhere the host scan runs; ``concept.streaming.scan.scan_rule`` makes that choice for the policies.

Every rule: a document start (``reset`` True at t) puts the row's state back to its start before its token;
padding (``valid`` False) keeps nothing and leaves the state as it is.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from .scan_choice import CHOICE as _choice

AVAILABLE = importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Triton runs its kernels in its interpreter (numpy, on CPU tensors): ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device) -> bool:
    """Whether the sequential rules run on the device here: CUDA with Triton installed (unless
    :func:`choose` said ``False``), and a CPU inside ``choose(True)`` (Triton's interpreter)."""
    kind, chosen = torch.device(device).type, _choice["device"]
    if not AVAILABLE or chosen is False:
        return False
    return kind == "cuda" or (chosen is True and kind == "cpu")


@contextlib.contextmanager
def choose(device: bool, rows: int = 16):
    """Inside: ``True`` runs the device scan on CPU tensors too (Triton's interpreter, ``rows`` rows per program:
    tests, no speed); ``False`` runs the host scan everywhere (the reference, on CUDA too)."""
    if device and not (AVAILABLE and interpreted()) and not torch.cuda.is_available():
        raise RuntimeError("the device scan on a CPU needs triton and TRITON_INTERPRET=1 before triton is imported")
    before = dict(_choice)
    _choice.update(device=device, rows=rows)
    try:
        yield
    finally:
        _choice.update(before)


def ops():
    """The ops ``torch.ops.concept.*_scan`` (importing ``concept.streaming.scan_kernels`` registers them)."""
    # lazy: Triton and torch's Triton support take seconds to import, which the host scan never needs
    from . import scan_kernels  # noqa: F401  (registers the ops)
    return torch.ops.concept
