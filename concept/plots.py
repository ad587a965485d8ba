"""PNG plots of a training run (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def training_curves(rows: list[dict], path: Path, target_ratio: float | None = None) -> Path | None:
    """Loss (train and held-out) and realised concepts-per-token against the step."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    has_ratio = any("ratio" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if has_ratio else 1, figsize=(11 if has_ratio else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in rows], label="train loss", lw=1)
    evals = [(r["step"], r["eval"]["nll"]) for r in rows if r.get("eval")]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out NLL", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.legend()
    ax.grid(alpha=0.3)
    if has_ratio:
        ax = axes[0][1]
        ax.plot(steps, [r.get("ratio") for r in rows], label="train ratio", lw=1)
        if evals:
            ax.plot([r["step"] for r in rows if r.get("eval")], [r["eval"].get("ratio") for r in rows if r.get("eval")],
                    "o-", label="held-out ratio")
        if target_ratio is not None:
            ax.axhline(target_ratio, color="k", ls="--", lw=1, label=f"target {target_ratio}")
        ax.set_xlabel("step")
        ax.set_ylabel("concepts per token")
        ax.set_ylim(0, 1)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
