"""The static concept budget a streaming model runs with (``BuildConfig.max_ratio``; ``concept.packing.budget``
and ``cap_boundaries`` apply it).

``max_ratio`` takes

- a number in (0, 1]: that budget, as it is;
- ``"auto"`` (the default of new builds): derived from the length policy, like its ``max_run`` / ``max_chunk``
  (``concept.streaming.gap``):

  * a policy with a target ratio r (a ``concept.contracts.TracksRatio``, its ``target_ratio`` buffer: `null`,
    `threshold`, `mtp`; the trainer keeps it at the step's target, the build's calibration at its own) and a
    per-document ratio tracker (its declared ``track`` gain above 0: `null` and `mtp` by default):
    ``min(1, 1.25 r)`` with a slack of 6 boundaries
    (:data:`TRACKED`): a row's first n real tokens keep at most ``ceil(1.25 r n) + 6``, 26 concept slots at
    T = 128 and 1,286 at 8k for the default r = 0.125. The tracker holds a document near r, so a row goes
    over ``ceil(1.25 r n)`` only in a burst at its start, which the slack takes: over the policy's boundaries
    of a 20-step tiny run and the demo's SmolLM2 run, on code and on prose, at 256 and 2,048 tokens a row,
    none dropped with a slack of 6 (``benchmarks/budget_binding.py``, ``docs/results.md``, "The default
    static budget, a quarter over the target");
  * a policy with a target ratio and no per-document tracker (`threshold`; `null` / `mtp` with ``track`` 0):
    nothing holds a row near r, so twice it, ``min(1, 2 r)`` with a slack of 4 (:data:`UNTRACKED`);
  * a policy that bounds its own rate (``LengthPolicy.max_boundary_rate`` not None: `fixed`, one boundary every
    ``every`` tokens):
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

from ..contracts import TracksRatio
from . import gap
from .operating_point import MAX_RATIO_AUTO, MAX_RATIO_NONE

# auto, (headroom in units of the policy's target ratio, slack in boundaries per row beyond ceil(budget * n)):
TRACKED = (1.25, 6)  # a policy with a per-document ratio tracker (the slack: a burst at a row's start)
UNTRACKED = (2.0, 4)  # a policy with a target ratio and no tracker (nothing holds a row near it)


def tracks_documents(policy) -> bool:
    """Whether the policy's per-document ratio tracker is on: a :class:`~concept.contracts.TracksRatio` whose
    ``track`` gain is above 0 (`null`, `mtp`; a third-party policy declares one the same way: the capability and
    its gain, not an attribute of that name alone)."""
    return isinstance(policy, TracksRatio) and float(policy.track) > 0


def rule(policy) -> tuple[float, int]:
    """``auto``'s (headroom, slack) for a policy with a target ratio: :data:`TRACKED` or :data:`UNTRACKED`."""
    return TRACKED if tracks_documents(policy) else UNTRACKED


def from_target(target: float, headroom: float) -> float:
    """``auto`` for a policy with a target ratio: ``min(1, headroom * target)`` (none for a target <= 0)."""
    if not math.isfinite(target) or target <= 0:
        return 0.0
    return min(1.0, headroom * target)


def auto(policy) -> float:
    """``max_ratio = "auto"`` for this length policy now (0.0: no budget)."""
    if policy.max_boundary_rate is not None:
        return min(1.0, float(policy.max_boundary_rate))
    if isinstance(policy, TracksRatio):
        return from_target(gap.target_of(policy), rule(policy)[0])
    return 0.0


def slack(value, policy) -> int:
    """The budget's slack: :func:`rule`'s for ``auto`` from a target ratio; 0 for a policy's own rate bound
    (it never goes over it) and for a number, which is the budget exactly as given."""
    if value != MAX_RATIO_AUTO or policy.max_boundary_rate is not None:
        return 0
    return rule(policy)[1] if auto(policy) else 0


def resolve(value, policy) -> float:
    """The budget a ``max_ratio`` setting stands for with ``policy``, as a float (0.0: none)."""
    if value == MAX_RATIO_AUTO:
        return auto(policy)
    if value == MAX_RATIO_NONE or value is None:
        return 0.0
    return float(value)
