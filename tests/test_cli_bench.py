"""`concept bench`: pytest-benchmark in a subprocess, per-machine baselines, regressions, bad input."""
import json

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


def test_bench_bad_input(tmp_path):
    r = run("--compare", "nothing", "--storage", tmp_path)
    assert r.exit_code == 1 and "no baseline named 'nothing'" in r.stderr and "concept bench --save nothing" in r.stderr
    r = run("--compare", "x", "--fail-on", "mean:ten", "--storage", tmp_path)
    assert r.exit_code == 2 and "expected STAT:N%" in r.stderr
    r = run("--fail-on", "mean:10%")
    assert r.exit_code == 2 and "needs --compare" in r.stderr
    r = run("--suite", "nope")
    assert r.exit_code == 2


def test_smoke_runs_every_suite_once(tmp_path):
    r = run("--smoke", "-k", "tiny or T1024", "--storage", tmp_path)
    assert r.exit_code == 0, r.output
    assert "passed" in r.stderr


def test_machine_id_is_a_folder_name():
    mid = machine_id("cpu")
    assert mid and "/" not in mid and mid == mid.lower()
