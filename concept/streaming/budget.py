"""The static concept budget a streaming model runs with (``BuildConfig.max_ratio``; ``concept.packing.budget``
and ``cap_boundaries`` apply it).

``max_ratio`` takes

- a number in (0, 1]: that budget, as it is;
- ``"auto"`` (the default of new builds): derived from the length policy, like its ``max_run`` / ``max_chunk``
  (``concept.streaming.gap``):

  * a policy with a target ratio r (its ``target_ratio`` buffer: `null`, `threshold`, `mtp`; the trainer
    keeps it at the step's target, the build's calibration at its own): ``min(1, 2 r)``, twice the target,
    0.25 at the default 0.125, with a slack of :data:`SLACK` boundaries: a row's first n real tokens keep at
    most ``ceil(2 r n) + 4``. The per-document ratio tracker holds a document near r, so a row goes over
    ``ceil(2 r n)`` only in a burst at its start: on two 20-step default runs, 0.72-0.77 % of the policy's
    boundaries without a slack (in a row's first tokens), 0-0.03 % with 2, none with 4
    (``benchmarks/budget_binding.py``, ``docs/results.md``);
  * a policy that bounds its own rate (``max_boundary_rate``: `fixed`, one boundary every ``every`` tokens):
    that bound, which the cap then never binds;
  * neither (`entropy`: its rate is set by ``tau`` and nothing tracks it): none (the budget would have to be
    the whole row to be safe, a middle stack over every token);

- ``"none"`` or 0: no budget (the packed layout's widths follow the batch: host syncs, as before).

The resolved value is a plain float read on the host (the target's host copy: ``gap.target_of``), so it costs
no device sync. It follows the policy's target: a ratio curriculum (``--ratio-warmup``) changes the budget,
and so the shapes, as its target moves (a compiled model then compiles once per target).
"""
from __future__ import annotations

import math

from . import gap
from .operating_point import MAX_RATIO_AUTO, MAX_RATIO_NONE

HEADROOM = 2.0  # auto: the budget in units of the policy's target ratio
SLACK = 4  # auto: boundaries a row may have beyond ceil(max_ratio * n), for a burst at its start


def from_target(target: float) -> float:
    """``auto`` for a policy with a target ratio: ``min(1, HEADROOM * target)`` (none for a target <= 0)."""
    if not math.isfinite(target) or target <= 0:
        return 0.0
    return min(1.0, HEADROOM * target)


def auto(policy) -> float:
    """``max_ratio = "auto"`` for this length policy now (0.0: no budget)."""
    bound = getattr(policy, "max_boundary_rate", None)
    if bound is not None:
        return min(1.0, float(bound))
    if getattr(policy, "target_ratio", None) is not None:
        return from_target(gap.target_of(policy))
    return 0.0


def slack(value, policy) -> int:
    """The budget's slack: :data:`SLACK` for ``auto`` from a target ratio; 0 for a policy's own rate bound
    (it never goes over it) and for a number, which is the budget exactly as given."""
    if value != MAX_RATIO_AUTO or getattr(policy, "max_boundary_rate", None) is not None:
        return 0
    return SLACK if auto(policy) else 0


def resolve(value, policy) -> float:
    """The budget a ``max_ratio`` setting stands for with ``policy``, as a float (0.0: none)."""
    if value == MAX_RATIO_AUTO:
        return auto(policy)
    if value == MAX_RATIO_NONE or value is None:
        return 0.0
    return float(value)
