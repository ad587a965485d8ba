"""The planner-executor's diagnostics plot (``planner.png`` beside ``curves.png``)."""
from __future__ import annotations

from pathlib import Path

from ..plots import pyplot, save_figure

PLANNER_PANELS = (
    ("train NLL(y | plan)", ("loss",)),
    ("plan length (concepts / example)", ("plan_len",)),
    ("ΔNLL vs the trained plan (nats)", ("delta_nll_shuffle", "delta_nll_mask", "delta_nll_dropout")),
    ("planner entropy per type (nats)", ("entropy/",)),
    ("cos(e_soft, e_hard)", ("cos_soft_hard",)),
    ("E-step: margin S(z1) − S(z2) (nats)", ("estep_margin",)),
    ("E-step: flip rate and staleness gap", ("flip_rate", "staleness_gap")),
    ("gradient norm per group", ("grad_norm/",)),
)


def panel_keys(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    """The metrics a panel plots: each key itself, and every metric under a key that ends in ``/``."""
    return sorted({k for r in rows for k in r
                   if any(k == key or (key.endswith("/") and k.startswith(key)) for key in keys)})


def planner_figure(runs: dict[str, list[dict]]):
    """The planner diagnostics of one or more planner-executor runs (metrics.jsonl rows by run label)
    against the step, one panel per signal; a step where a metric was not logged is left out of its line."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(20, 7.5), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, (title, keys) in zip(axes.flat, PLANNER_PANELS):
        for n, (label, rows) in enumerate(runs.items()):
            names = panel_keys(rows, keys)
            for name in names:
                points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
                if points:
                    ax.plot(*zip(*points), styles[n % len(styles)], lw=1.2, marker="." if len(points) < 30 else None,
                            label=f"{label}: {name}" if len(names) > 1 else label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def planner_curves(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """Save :func:`planner_figure` as a PNG at ``path`` (nothing when no run has rows)."""
    runs = {label: rows for label, rows in runs.items() if rows}
    if not runs:
        return None
    return save_figure(planner_figure(runs), path)
