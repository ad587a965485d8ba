"""The streaming family's operating point and how its build settings are written: the default target ratio
and split (``auto``), a split's spec (:func:`parse_split`) and the static budget ``max_ratio``
(:func:`max_ratio_problem`, :func:`has_budget`). Standard library only."""
from __future__ import annotations

# The default operating point: the best measured streaming point at <= 0.6x the dense backbone's FLOPs
# (docs/results.md, "The default operating point: 4,18,8 at 0.125"). Split "auto" gives the shallow
# stack 2/15 and the deep stack 4/15 of the backbone's layers (4,18,8 on SmolLM2's 30), and the
# build's calibration, the trainer and the `null` policy aim at DEFAULT_TARGET_RATIO concepts per token.
AUTO_SHALLOW, AUTO_DEEP = 2 / 15, 4 / 15
DEFAULT_TARGET_RATIO = 0.125
# max_ratio's words (besides a number in [0, 1]; 0 = none)
MAX_RATIO_AUTO, MAX_RATIO_NONE = "auto", "none"


def parse_max_ratio(raw):
    """A ``max_ratio`` as given on a command line (``0.25``, ``auto``, ``none``): a number where it is one,
    else the text as it is (:func:`max_ratio_problem` names what is wrong with it)."""
    if not isinstance(raw, str):
        return raw
    try:
        return float(raw)
    except ValueError:
        return raw.strip().lower()


def max_ratio_problem(value) -> str | None:
    """What is wrong with a ``max_ratio`` (None: nothing)."""
    if value in (MAX_RATIO_AUTO, MAX_RATIO_NONE):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return (f"max_ratio: a number in [0, 1], '{MAX_RATIO_AUTO}' (from the length policy's target ratio) or "
                f"'{MAX_RATIO_NONE}' (no static budget; so is 0), got {value!r}")
    return None


def has_budget(value) -> bool:
    """Whether a ``max_ratio`` asks for a static budget: ``auto`` or a number above 0 (``auto`` may still find
    none for a length policy with neither a target nor a bound: ``concept.streaming.budget``)."""
    return value == MAX_RATIO_AUTO or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)


def parse_split(spec: str, num_layers: int) -> tuple[tuple[int, int, int] | None, list[str]]:
    """Turn "auto", "4,22,4" or "0.15,0.7,0.15" into (shallow, middle, deep) layer counts. "auto" is the
    default operating point's split: AUTO_SHALLOW and AUTO_DEEP of the layers (at least one each)."""
    spec = str(spec).strip()
    if spec == "auto":
        shallow, deep = max(1, round(num_layers * AUTO_SHALLOW)), max(1, round(num_layers * AUTO_DEEP))
        counts = (shallow, num_layers - shallow - deep, deep)
        if counts[1] < 1:
            return None, [f"split: the backbone has {num_layers} layers; at least 3 are needed (one per stack)"]
        return counts, []
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 3:
        return None, [f"split: expected three values 'shallow,middle,deep' (e.g. '4,22,4'), got {spec!r}"]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        return None, [f"split: values must be numbers, got {spec!r}"]
    if all(v.is_integer() and v >= 1 for v in values) and not all(v < 1 for v in values):
        counts = tuple(int(v) for v in values)
    elif all(0 < v < 1 for v in values):
        if abs(sum(values) - 1) > 1e-6:
            return None, [f"split: fractions must sum to 1, got {sum(values):g} from {spec!r}"]
        shallow, deep = round(values[0] * num_layers), round(values[2] * num_layers)
        counts = (shallow, num_layers - shallow - deep, deep)
    else:
        return None, [
            f"split: every stack needs at least one layer; use counts >= 1 ('4,22,4') or fractions in (0,1), got {spec!r}"
        ]
    if min(counts) < 1:
        return None, [f"split: every stack needs at least one layer, {spec!r} gives {counts} for {num_layers} layers"]
    if sum(counts) != num_layers:
        return None, [f"split: {spec!r} sums to {sum(counts)} layers but the backbone has {num_layers}"]
    return counts, []
