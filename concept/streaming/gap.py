"""The maximum gap: how long a length policy may go without a concept before it forces one.

The option that bounds it (``max_run`` for `null` and `threshold`: NULL tokens in a row; ``max_chunk`` for
`entropy` and `mtp`: tokens per chunk, its concept included) takes

- an integer >= 1, as before;
- ``"auto"`` (the default): derived from the policy's target ratio r (its ``target_ratio`` buffer, which the
  trainer and the build's calibration set; the project's default target where the policy has none), as
  ``ceil(2 / r)``: twice the mean spacing of concepts at the target. At the default target 0.125 that is
  16, the fixed default these options had before, so a model at the default target decides exactly as
  it did; at 0.25 it is 8, at 1/32 it is 64 (a fixed 16 would have made a target below 1/17 unreachable);
- ``"none"``: no forcing at all (the gap, and the deep stack's tail, are then unbounded).

A bounded gap bounds the deep tail: a tail token attends to at most that many tail keys of its own
segment, the local window of the `cascade` attention backend, and the decoder's tail cache.
"""
from __future__ import annotations

import math

import torch

from ..contracts import TracksRatio
from ..lazy import tensor_version
from .operating_point import DEFAULT_TARGET_RATIO

AUTO, NONE = "auto", "none"
GAP_PER_SPACING = 2.0  # "auto": the bound in units of the mean spacing 1 / r at the target
UNBOUNDED = 2 ** 62  # "none": larger than any sequence, so the forcing rule never fires (and fits an int64)


def problems(name: str, value) -> list[str]:
    """What is wrong with a maximum-gap option's value (empty: nothing)."""
    if value in (AUTO, NONE) or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return []
    return [f"{name}: expected an integer >= 1, '{AUTO}' (derived from the target ratio) or '{NONE}' (no forcing), "
            f"got {value!r}"]


def from_target(target: float) -> int:
    """``auto``: ``ceil(2 / target)`` (at least 1); unbounded for a target that asks for no concepts (<= 0)."""
    if not math.isfinite(target) or target <= 0:
        return UNBOUNDED
    return max(1, math.ceil(GAP_PER_SPACING / target - 1e-9))


def target_of(policy) -> float:
    """The policy's target ratio: a :class:`~concept.contracts.TracksRatio`'s ``target_ratio`` buffer (read from
    the device once per change of the buffer, not once per decision), or the project's default for a policy
    without one."""
    if not isinstance(policy, TracksRatio):
        return DEFAULT_TARGET_RATIO
    buffer = policy.target_ratio
    if not isinstance(buffer, torch.Tensor):
        return float(buffer)
    value = policy.__dict__.get("_gap_target")
    if value is not None and torch.compiler.is_compiling():  # a compiled graph: the host copy, a constant of it
        return value  # (guarded by its value alone: the buffer refilled with the same number recompiles nothing;
        # the eager call before the graph's first read it; a tensor's _version cannot be traced)
    key = (id(buffer), tensor_version(buffer))
    if value is None or policy.__dict__.get("_gap_target_of") != key:
        policy.__dict__["_gap_target_of"], value = key, float(buffer)
        policy.__dict__["_gap_target"] = value
    return value


def set_target(policy, target: float) -> None:
    """Point ``policy`` (a :class:`~concept.contracts.TracksRatio`) at the target ratio ``target``: its
    ``target_ratio`` buffer filled (or attribute set), and the host copy :func:`target_of` reads kept with it, so
    the next decision reads nothing back from the device."""
    if not isinstance(policy, TracksRatio):
        raise TypeError(f"{type(policy).__name__} has no target ratio to set (it is not a TracksRatio)")
    buffer = policy.target_ratio
    if not isinstance(buffer, torch.Tensor):
        policy.target_ratio = target
        return
    with torch.no_grad():
        buffer.fill_(target)
    policy.__dict__["_gap_target_of"], policy.__dict__["_gap_target"] = (id(buffer), tensor_version(buffer)), float(target)



def resolve(value, policy) -> int:
    """The bound a policy's option stands for now, as an integer (``UNBOUNDED`` for ``none``)."""
    if value == NONE:
        return UNBOUNDED
    if value == AUTO:
        return from_target(target_of(policy))
    return int(value)
