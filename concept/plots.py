"""PNG plots of a training run (matplotlib, headless); a family adds its own (``Family.plots``).

Each plot is drawn by a ``*_figure`` function that returns the matplotlib figure (what the tests read
back: every line's data) and saved by the matching ``*_curves`` function, atomically.
"""
from __future__ import annotations

from pathlib import Path

from .fs import write_atomic


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    plt = pyplot()
    path = Path(path)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return path


def curves_figure(rows: list[dict], target_ratio: float | None = None):
    """Loss (train and held-out) and, when the rows have one, realised concepts-per-token against the step."""
    plt = pyplot()
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
    """Save :func:`curves_figure` as a PNG at ``path`` (nothing when there are no rows); the target line: the
    last target the rows logged (``target_ratio``: a ratio curriculum ends at the run's target), if any."""
    if not rows:
        return None
    if target_ratio is None:
        target_ratio = next((r["target_ratio"] for r in reversed(rows) if r.get("target_ratio") is not None), None)
    return save_figure(curves_figure(rows, target_ratio), path)
