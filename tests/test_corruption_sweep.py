"""The corruption sweep (``benchmarks/corruption_sweep.py``, issue 43 item 9) in the default suite: one run of
each kind (build, trained run, planner-executor, pruned baseline, export, frontier folder), each file damaged in
six ways (zero bytes, half, a flipped byte, a key removed, a wrong type, another build's file), read by every
command that reads it (inspect, eval, export, generate, ``train SRC --out``, ``train --resume``, a frontier
re-run). Expected: no traceback; a refusal is one error line and leaves the folder byte-identical; a file a
command trusts is refused by it. About a minute of CPU (setup included)."""
from __future__ import annotations

import collections

import pytest

from benchmarks import corruption_sweep as sweep

# the trained run's files (checked against the folder the sweep builds)
TRAINED_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "backbone.safetensors",
                 "checkpoint/adapter.safetensors", "checkpoint/modules.safetensors", "checkpoint/ratio_control.json",
                 "checkpoint/state.json", "checkpoint/trainer.pt", "concept.json", "curves.png", "metrics.jsonl",
                 "modules.safetensors", "train.json")
RESUME_CASES = [(rel, how) for rel in TRAINED_FILES for how in sweep.DAMAGES
                if sweep.applies(rel, how) and sweep.must_refuse("trained", rel, how, "train --resume")]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("corruption")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("HF_HUB_OFFLINE", "1")
        sweep.setup(root)
        assert tuple(sweep.files_of("trained", root / "run")) == TRAINED_FILES
        found = sweep.sweep(root)
    torch.set_num_threads(threads)
    return found


def shown(row: dict) -> str:
    return (f"{row['kind']} {row['file']} {row['damage']} / {row['command']}: exit {row['exit']}, expected "
            f"{row['expected']}, changed {row['changed'][:3]}: {row['message'][:200]}")


def test_every_reader_refuses_damage_in_one_line_and_changes_nothing(rows):
    readers = [r for r in rows if r["command"] != "train --resume"]
    assert [shown(r) for r in readers if not r["ok"]] == []
    assert not any(r["traceback"] for r in readers)
    kinds = collections.Counter(r["kind"] for r in rows)
    assert set(kinds) == set(sweep.KINDS) and min(kinds.values()) >= 40, kinds  # every kind, every damage
    assert {r["damage"] for r in rows} == set(sweep.DAMAGES)
    assert {r["command"] for r in rows} == set(sweep.COMMANDS)
    assert sum(r["expected"] == "refuse" and r["exit"] == 1 for r in rows) > 500


@pytest.mark.parametrize("rel, how", RESUME_CASES)
def test_resume_refuses_a_damaged_run_before_writing(rows, rel, how):
    found = [r for r in rows if (r["kind"], r["file"], r["damage"], r["command"]) == ("trained", rel, how,
                                                                                       "train --resume")]
    assert len(found) == 1 and found[0]["ok"], shown(found[0]) if found else "no such case"


def test_the_expectations_are_not_vacuous():
    """Negative controls of the sweep's own judgement: a traceback, a second error line, a refusal that changed
    the folder, a trusted file read without complaint: each fails the case."""
    class Result:
        def __init__(self, exit_code, stderr, exception=None):
            self.exit_code, self.stderr, self.exception = exit_code, stderr, exception

    same = {"a": "1"}
    ok = sweep.case_row("trained", "train.json", "half", "eval", Result(1, "error: x: bad; fix\n", SystemExit(1)),
                        same, same)
    assert ok["ok"]
    for result, after in ((Result(1, "", KeyError("step")), same), (Result(1, "error: one\nerror: two\n"), same),
                          (Result(1, "error: x\n"), {"a": "2"}), (Result(0, "done\n"), same),
                          (Result(2, "error: invalid config (2 problems):\n  - a\n  - b\n"), same)):
        assert not sweep.case_row("trained", "train.json", "half", "eval", result, same, after)["ok"]
    harmless = sweep.case_row("trained", "curves.png", "half", "eval", Result(0, "done\n"), same, same)
    assert harmless["ok"] and harmless["expected"] == "any"
