"""``--dtype``, declared once for the commands that run a loaded model (``eval``, ``generate``, ``chat``, ``serve``):
``concept.load``'s ``dtype`` (``concept.precision``), ``auto`` by default as ``concept train``'s: bf16 on a CUDA
device, fp32 elsewhere."""
from __future__ import annotations

import click

from concept.config import DEFAULT_DTYPE, DTYPES, INFERENCE_DTYPE_HELP


def dtype_option():
    return click.option("--dtype", type=click.Choice(DTYPES), default=DEFAULT_DTYPE, show_default=True,
                        help=INFERENCE_DTYPE_HELP)
