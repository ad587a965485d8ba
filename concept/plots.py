"""PNG plots of a training run (matplotlib, headless).

Each plot is drawn by a ``*_figure`` function that returns the matplotlib figure (what the tests read
back: every line's data) and saved by the matching ``*_curves`` function, atomically.
"""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    from .fs import write_atomic

    plt = _pyplot()
    path = Path(path)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return path


def curves_figure(rows: list[dict], target_ratio: float | None = None):
    """Loss (train and held-out) and, when the rows have one, realised concepts-per-token against the step."""
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    has_ratio = any("ratio" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if has_ratio else 1, figsize=(11 if has_ratio else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in rows], label="train loss", lw=1)
    evals = [r for r in rows if r.get("eval")]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval"]["nll"] for r in evals], "o-", label="held-out NLL", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.legend()
    ax.grid(alpha=0.3)
    if has_ratio:
        ax = axes[0][1]
        ax.plot(steps, [r.get("ratio") for r in rows], label="train ratio", lw=1)
        if evals:
            ax.plot([r["step"] for r in evals], [r["eval"].get("ratio") for r in evals], "o-", label="held-out ratio")
        if target_ratio is not None:
            ax.axhline(target_ratio, color="k", ls="--", lw=1, label=f"target {target_ratio}")
        ax.set_xlabel("step")
        ax.set_ylabel("concepts per token")
        ax.set_ylim(0, 1)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def training_curves(rows: list[dict], path: Path, target_ratio: float | None = None) -> Path | None:
    """Save :func:`curves_figure` as a PNG at ``path`` (nothing when there are no rows)."""
    if not rows:
        return None
    return _save(curves_figure(rows, target_ratio), path)


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
    plt = _pyplot()
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
    return _save(planner_figure(runs), path)
