"""`concept bench`: pytest-benchmark in a subprocess, per-machine baselines, regressions, bad input."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from concept_cli.bench_cmd import machine_id
from concept_cli.main import cli


def run(*args):
    return CliRunner().invoke(cli, ["bench", *map(str, args)], catch_exceptions=False)


def test_save_compare_and_fail_on_a_regression(tmp_path):
    storage = tmp_path / "baselines"
    r = run("--suite", "forward", "-k", "tiny and chunked", "--save", "base", "--storage", storage, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["speedup"] > 0 and rows[0]["ideal_speedup"] > 1
    saved = list(storage.glob("*/0001_base.json"))
    assert saved and json.loads(saved[0].read_text())["machine_info"]["torch"]  # torch version recorded
    r = run("--suite", "forward", "-k", "tiny and chunked", "--compare", "base", "--fail-on", "mean:1000%",
            "--storage", storage)
    assert r.exit_code == 0, r.output
    assert "speed-up" in r.stdout and "Comparing against" in r.stderr
    # a baseline a thousand times faster than anything this machine does: a regression, exit 1
    baseline = json.loads(saved[0].read_text())
    for case in baseline["benchmarks"]:
        case["stats"].update({k: case["stats"][k] / 1000 for k in ("min", "max", "mean", "median")})
    (saved[0].parent / "0002_fast.json").write_text(json.dumps(baseline))
    r = run("--suite", "forward", "-k", "tiny and chunked", "--compare", "fast", "--fail-on", "mean:10%",
            "--storage", storage)
    assert r.exit_code == 1 and "regression" in r.stderr
    # a gate with no case to compare, and a --save with nothing to save, fail (issue 43: both exited 0)
    before = sorted(p.name for p in storage.rglob("*"))
    for args in (["--compare", "fast", "--fail-on", "mean:1%"], ["--save", "empty"]):
        r = run("--suite", "forward", "-k", "no_such_case", *args, "--storage", storage)
        assert r.exit_code == 1 and "no benchmark case ran" in r.stderr and "'no_such_case' matched none" in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error:"), r.stderr
    assert sorted(p.name for p in storage.rglob("*")) == before


def test_bench_bad_input(tmp_path):
    r = run("--compare", "nothing", "--storage", tmp_path)
    assert r.exit_code == 1 and "no baseline named 'nothing'" in r.stderr and "concept bench --save nothing" in r.stderr
    r = run("--compare", "x", "--fail-on", "mean:ten", "--storage", tmp_path)
    assert r.exit_code == 2 and "expected STAT:N%" in r.stderr
    r = run("--fail-on", "mean:10%")
    assert r.exit_code == 2 and "needs --compare" in r.stderr
    r = run("--suite", "nope")
    assert r.exit_code == 2


@pytest.mark.slow  # 55 s; `make test` runs the benchmark suites' smoke run itself (its second command)
def test_smoke_runs_every_suite_once(tmp_path):
    r = run("--smoke", "-k", "tiny or T1024", "--storage", tmp_path)
    assert r.exit_code == 0, r.output
    assert "passed" in r.stderr


def test_machine_id_is_a_folder_name():
    mid = machine_id("cpu")
    assert mid and "/" not in mid and mid == mid.lower()


def test_save_leaves_the_store_as_it_was_when_the_run_fails_or_is_interrupted(tmp_path, monkeypatch):
    """`--save` writes into a copy of the store and publishes only after a successful run: a failed run, a
    Ctrl-C during the run and an error while publishing leave every stored file byte-identical."""
    from concept import fs
    from concept_cli import bench_cmd
    from tests.faults import snapshot

    storage = tmp_path / "baselines"
    (storage / "machine").mkdir(parents=True)
    (storage / "machine" / "0001_old.json").write_text('{"benchmarks": []}')
    before = snapshot(storage)

    def writes_then(outcome):
        def fake_run(args):
            staged = next(a for a in args if a.startswith("--benchmark-storage=")).split("file://", 1)[1]
            (Path(staged) / "machine").mkdir(parents=True, exist_ok=True)
            (Path(staged) / "machine" / "0002_new.json").write_text("{}")  # what pytest-benchmark would save
            (Path(staged) / "machine" / "0001_old.json").write_text("clobbered")
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return fake_run

    monkeypatch.setattr(bench_cmd, "run_to_stderr", writes_then(1))  # the run fails
    r = run("--suite", "forward", "--save", "new", "--storage", storage)
    assert r.exit_code == 1 and "no baseline was saved" in r.stderr and snapshot(storage) == before
    monkeypatch.setattr(bench_cmd, "run_to_stderr", writes_then(KeyboardInterrupt()))  # Ctrl-C during the run
    r = CliRunner().invoke(cli, ["bench", "--suite", "forward", "--save", "new", "--storage", str(storage)])
    assert r.exit_code == 130 and snapshot(storage) == before
    monkeypatch.setattr(bench_cmd, "run_to_stderr", writes_then(0))  # publishing fails half-way
    real = fs.write_atomic
    monkeypatch.setattr(fs, "write_atomic", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    r = CliRunner().invoke(cli, ["bench", "--suite", "forward", "--save", "new", "--storage", str(storage)])
    assert r.exit_code == 1 and snapshot(storage) == before
    monkeypatch.setattr(fs, "write_atomic", real)
    r = run("--suite", "forward", "--save", "new", "--storage", storage)  # success: only the new file is added
    after = snapshot(storage)
    assert r.exit_code == 0 and after["machine/0001_old.json"] == before["machine/0001_old.json"]
    assert set(after) == set(before) | {"machine/0002_new.json"}
