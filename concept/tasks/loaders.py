"""The offline tasks' datasets (lm-eval ``custom_dataset``): each task's JSONL in ``data/`` next to this
file, as a ``datasets.DatasetDict`` with one ``test`` split. lm-eval imports this file by its path from
the task YAMLs, so it imports nothing of the library. ``python -m concept.tasks.build`` writes the data."""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str):
    import datasets

    path = DATA / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the data of task {name} is missing; rebuild it with "
                                f"`python -m concept.tasks.build`")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def cloze(**_):
    return _load("concept_cloze")


def code_continuation(**_):
    return _load("concept_code_continuation")


def docstring_name(**_):
    return _load("concept_docstring_name")
