"""A length policy's sequential rule along each row: on the device where it can, on the host otherwise.

The policies whose decision at t depends on earlier decisions (`null` with its ratio tracker, `threshold`,
`entropy`, `mtp`) describe their rule twice: as a step on one row's plain numbers (the host scan,
``concept.streaming.host_scan``: the reference, and the path on a CPU) and as the name and integer
parameters of its Triton kernel (``concept.streaming.device_scan``). :func:`scan_rule` runs the device
kernel on CUDA when Triton is installed (no host sync: nothing is read back) and the host scan otherwise
(one declared sync, "policy scan"); both decide the same, bit for bit.

A kernel that fails on its first call on a device (Triton cannot compile it for this GPU, or the driver
refuses it) is not fatal: a warning names the kernel, the device and the error, and that rule decides on the
host from then on (the same decisions, with the host scan's one sync per forward). A kernel that has once run
and then fails raises as any op does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import warnings

import torch

from . import device_scan
from .host_scan import Rule, State, scan_rows, state_tensors


@dataclass(frozen=True)
class DeviceRule:
    """A rule's device form: the name of its op ``concept::<op>`` and the parameters after (valid, reset,
    inputs). The op returns keep and three state fields at most; the rule's are the first ones."""
    op: str
    params: tuple = ()


# a kernel's variants (op, device type, with resets, input dtypes, its switches): those that failed on their
# first call, and those that have run
_failed: set[tuple] = set()
_proven: set[tuple] = set()


def _device_scan(device: DeviceRule, valid, reset, inputs):
    """The rule's kernel, or None after (or at) its first-call failure on this device type (a warning says so)."""
    key = (device.op, valid.device.type, reset is None, tuple(x.dtype for x in inputs),
           tuple(p for p in device.params if isinstance(p, bool)))
    if key in _failed:
        return None
    op: Callable = getattr(device_scan.ops(), device.op)
    try:
        result = op(valid, reset, *inputs, *device.params)
    except Exception as exc:  # noqa: BLE001  (only a first call: a kernel that has run raises as any op does)
        if key in _proven:
            raise
        _failed.add(key)
        warnings.warn(f"the length policy's device scan (concept::{device.op}) failed on its first call on "
                      f"{valid.device.type}: {type(exc).__name__}: {str(exc)[:300]}; its decisions are made on the "
                      "host from now on (the same decisions, one host sync per forward). Please report it with "
                      "your torch, Triton and GPU versions", RuntimeWarning, stacklevel=3)
        return None
    _proven.add(key)
    return result


def scan_rule(rule: Rule, init: State, inputs: Sequence[torch.Tensor], valid: torch.Tensor,
              reset: torch.Tensor | None, dtypes: Sequence[torch.dtype],
              device: DeviceRule | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """keep [B, T] and each state field after the last token ([B] tensors of ``dtypes``), on ``valid``'s device.

    With ``device`` given and ``device_scan.runs_on(valid.device)`` (CUDA with Triton), the rule's Triton
    kernel decides, with no host sync; otherwise ``rule`` runs along each row on the host
    (``host_scan.scan_rows``: one declared sync)."""
    if device is not None and device_scan.runs_on(valid.device):
        result = _device_scan(device, valid, reset, [x.detach() for x in inputs])
        if result is not None:
            keep, *states = result
            return keep, tuple(states[:len(dtypes)])
    keep, finals = scan_rows(rule, init, inputs, valid, reset)
    return keep, state_tensors(finals, valid.device, dtypes)
