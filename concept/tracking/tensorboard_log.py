"""``--report-to tensorboard``: event files in ``RUN/tensorboard`` (``tensorboard --logdir RUN``), every
metric a scalar at its optimizer step, the training config as text. A resumed run purges the events past its
checkpoint (``SummaryWriter(purge_step=...)``), as metrics.jsonl drops those rows."""
from __future__ import annotations

import json
from pathlib import Path

from . import scalars


class TensorBoardTracker:
    def __init__(self, out: Path, config: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"), purge_step=first_step)
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, default=str)}\n```", first_step)

    def log(self, step: int, row: dict) -> None:
        for key, value in scalars(row).items():
            if key != "step":
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
