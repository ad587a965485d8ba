"""A length policy's sequential rule along each row: on the device where it can, on the host otherwise.

The policies whose decision at t depends on earlier decisions (`null` with its ratio tracker, `threshold`,
`entropy`, `mtp`) describe their rule twice: as a step on one row's plain numbers (the host scan,
``concept.streaming.host_scan``: the reference, and the path on a CPU) and as the name and integer
parameters of its Triton kernel (``concept.streaming.device_scan``). :func:`scan_rule` runs the device
kernel on CUDA when Triton is installed (no host sync: nothing is read back) and the host scan otherwise
(one declared sync, "policy scan"); both decide the same, bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import device_scan
from .host_scan import Rule, State, scan_rows, state_tensors


@dataclass(frozen=True)
class DeviceRule:
    """A rule's device form: the name of its op ``concept::<op>`` and the parameters after (valid, reset,
    inputs). The op returns keep and three state fields at most; the rule's are the first ones."""
    op: str
    params: tuple = ()


def scan_rule(rule: Rule, init: State, inputs: Sequence[torch.Tensor], valid: torch.Tensor,
              reset: torch.Tensor | None, dtypes: Sequence[torch.dtype],
              device: DeviceRule | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """keep [B, T] and each state field after the last token ([B] tensors of ``dtypes``), on ``valid``'s device.

    With ``device`` given and ``device_scan.runs_on(valid.device)`` (CUDA with Triton), the rule's Triton
    kernel decides, with no host sync; otherwise ``rule`` runs along each row on the host
    (``host_scan.scan_rows``: one declared sync)."""
    if device is not None and device_scan.runs_on(valid.device):
        op: Callable = getattr(device_scan.ops(), device.op)
        inputs = [x.detach() for x in inputs]
        keep, *states = op(valid, reset, *inputs, *device.params)
        return keep, tuple(states[:len(dtypes)])
    keep, finals = scan_rows(rule, init, inputs, valid, reset)
    return keep, state_tensors(finals, valid.device, dtypes)
