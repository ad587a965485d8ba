"""Where the length policies' device scan runs, and how many rows a program takes: the state that
``concept.streaming.device_scan`` sets (``choose``) and its kernels (``concept.streaming.scan_kernels``) read,
in a module of its own so that neither imports the other's."""
from __future__ import annotations

import torch

# device: None, CUDA only; True, CPU too (the interpreter); False, never. rows: per program in the interpreter
CHOICE = {"device": None, "rows": 16}


def rows_per_program(device) -> int:
    """One row per program on a GPU (the rows spread over the SMs); a block of rows in the interpreter, whose
    cost is per program step (``choose``'s ``rows``)."""
    return 1 if torch.device(device).type == "cuda" else CHOICE["rows"]
