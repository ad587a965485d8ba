"""``--report-to wandb``: a Weights & Biases run (project ``$WANDB_PROJECT``, default ``concept``; its files
in ``RUN/wandb``), the training config as its config, every metric at its optimizer step. ``WANDB_MODE=offline``
logs without an account."""
from __future__ import annotations

import os
from pathlib import Path

from . import scalars


class WandbTracker:
    def __init__(self, out: Path, config: dict, run_name: str):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "concept"), name=run_name, dir=str(out),
                              config=config)

    def log(self, step: int, row: dict) -> None:
        self.run.log({k: v for k, v in scalars(row).items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()
