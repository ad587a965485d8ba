"""``--report-to csv``: ``metrics.csv`` beside ``metrics.jsonl``, one row per logged step, a column per metric
(nested ones as ``eval/nll``); a cell is empty where that step did not log the metric."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from .. import fs
from . import scalars

FILE = "metrics.csv"


class CSVTracker:
    def __init__(self, out: Path):
        self.path = Path(out) / FILE
        metrics = Path(out) / "metrics.jsonl"  # a resumed run: the rows kept up to its checkpoint
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        self.rows = [scalars(json.loads(line)) for line in lines if line.strip()]
        self.columns: list[str] = []
        self._rewrite()

    def log(self, step: int, row: dict) -> None:
        values = scalars(row)
        self.rows.append(values)
        if set(values) <= set(self.columns):
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(values)
        else:  # a new metric (e.g. the first held-out evaluation): the header grows, the file is rewritten
            self._rewrite()

    def _rewrite(self) -> None:
        for values in self.rows:
            self.columns += [k for k in values if k not in self.columns]
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns)
        writer.writeheader()
        writer.writerows(self.rows)
        fs.write_atomic(self.path, text.getvalue())

    def close(self) -> None:
        pass
