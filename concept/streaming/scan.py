"""A length policy's sequential rule along each row: on the device where it can, on the host otherwise.

The policies whose decision at t depends on earlier decisions (`null` with its ratio tracker, `threshold`,
`entropy`, `mtp`) describe their rule twice: as a step on one row's plain numbers (the host scan,
``concept.streaming.host_scan``: the reference, and the path on a CPU) and as the name and integer
parameters of its Triton kernel (``concept.streaming.device_scan``). :func:`scan_rule` runs the device
kernel on CUDA when Triton is installed (no host sync: nothing is read back) and the host scan otherwise
(one declared sync, "policy scan"); both decide the same, bit for bit.

Inside a graph being compiled (``--compile model``: the whole forward traced as one graph, ``concept.compiled``)
the host scan is the opaque op ``concept::host_scan``, which finds the rule by its device form (each policy
registers its rule's factory under its kernel's name, :func:`host_rule`; :func:`scan_rule` builds the rule from
it, :func:`rule_of`, eagerly too), so the graph holds the scan whole instead of breaking at its ``.tolist()``; it is the same
function, with the same declared sync, called from the graph.

A kernel that fails on its first call on a device (Triton cannot compile it for this GPU, or the driver
refuses it) is not fatal: a warning names the kernel, the device and the error, and that rule decides on the
host from then on (the same decisions, with the host scan's one sync per forward). A kernel that has once run
and then fails raises as any op does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ast
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


def scan_rule(device: DeviceRule, inputs: Sequence[torch.Tensor], valid: torch.Tensor, reset: torch.Tensor | None,
              dtypes: Sequence[torch.dtype]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """keep [B, T] and each state field after the last token ([B] tensors of ``dtypes``), on ``valid``'s device,
    of the rule whose device form is ``device`` (its host rule: :func:`rule_of`).

    Where ``device_scan.runs_on(valid.device)`` (CUDA with Triton) the rule's Triton kernel decides, with no host
    sync; otherwise its host rule runs along each row on the host (``host_scan.scan_rows``: one declared sync),
    inside a graph being traced as the opaque op ``concept::host_scan``."""
    if device_scan.runs_on(valid.device):
        result = _device_scan(device, valid, reset, [x.detach() for x in inputs])
        if result is not None:
            keep, *states = result
            return keep, tuple(states[:len(dtypes)])
    if torch.compiler.is_compiling():
        return _traced_host_scan(inputs, valid, reset, dtypes, device)
    keep, finals = scan_rows(*rule_of(device, dtypes), inputs, valid, reset)
    return keep, state_tensors(finals, valid.device, dtypes)


# each device op's host rule: op name -> factory(params, state dtypes) -> (rule, the state's start)
_host_rules: dict[str, Callable[[tuple, tuple], tuple[Rule, State]]] = {}


def host_rule(op: str):
    """Register a factory as the host rule of the device op ``op``: ``factory(params, dtypes) -> (rule, init)``,
    the step on one row's plain numbers that the kernel computes with those parameters (``DeviceRule.params``)
    and the state's dtypes. :func:`scan_rule`, eagerly, and a compiled graph's ``concept::host_scan`` find it by
    the op's name (:func:`rule_of`), so each rule is written once."""
    def register(factory):
        _host_rules[op] = factory
        return factory
    return register


def rule_of(device: DeviceRule, dtypes: Sequence[torch.dtype]) -> tuple[Rule, State]:
    """(the host rule, its state's start) of a rule's device form, for state fields of ``dtypes``."""
    return _host_rules[device.op](device.params, tuple(dtypes))


def _traced_host_scan(inputs, valid, reset, dtypes, device: DeviceRule):
    """:func:`scan_rule`'s host path as one opaque op of a graph being traced: the rule travels as its device form
    (the op's name and its parameters, ``repr``-ed: a constant of the graph), which :func:`rule_of` turns back
    into the same rule."""
    names = ",".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
    keep, states = torch.ops.concept.host_scan(device.op, repr(device.params), names, valid, reset,
                                               [x.detach() for x in inputs])
    return keep, tuple(s.to(dtype) for s, dtype in zip(states, dtypes))


@torch.library.custom_op("concept::host_scan", mutates_args=())
def _host_scan_op(op: str, params: str, dtypes: str, valid: torch.Tensor, reset: torch.Tensor | None,
                  inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [B, T] and the final states [n, B] in float64 (which holds every state field exactly: integers
    below 2**53, float32 sums) of the device op ``op``'s host rule with ``params`` (a ``repr``) and states of
    ``dtypes`` (torch's names, comma-separated)."""
    dtypes = [getattr(torch, name) for name in dtypes.split(",")]
    rule, init = rule_of(DeviceRule(op, ast.literal_eval(params)), dtypes)
    keep, finals = scan_rows(rule, init, inputs, valid, reset)
    states = state_tensors(finals, valid.device, dtypes)
    return keep, torch.stack([s.double() for s in states])


@_host_scan_op.register_fake
def _(op, params, dtypes, valid, reset, inputs):
    return valid.new_empty(valid.shape, dtype=torch.bool), valid.new_empty((len(dtypes.split(",")), valid.shape[0]),
                                                                           dtype=torch.float64)
