"""pytest from a stage: run it under the stage's budget and read back every test's outcome.

The outcomes come from pytest's own JUnit XML report (no plugin needed on the device), which
pytest writes even when the run is interrupted at the deadline.
"""
from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from .common import ROOT, Stage, python_cmd, run_logged_together

OUTCOMES = ("passed", "failed", "error", "skipped")


def test_id(case: ET.Element) -> str:
    """``tests/test_cuda.py::test_name[param]`` from a JUnit test case."""
    module = case.get("classname", "").replace(".", "/")
    return f"{module}.py::{case.get('name', '')}" if module else case.get("name", "")


def read_junit(path: Path) -> list[dict]:
    """Every test case of a JUnit XML file: ``{"id", "outcome", "seconds", "message"}``.

    A case without a name is not a test: pytest writes one for the interruption itself when the
    deadline's Ctrl-C stops a session (the test it stopped has no case of its own), so it is left out.
    """
    if not path.is_file():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    tests = []
    for case in root.iter("testcase"):
        if not case.get("name"):
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "").strip()
                break
        tests.append({"id": test_id(case), "outcome": outcome, "seconds": round(float(case.get("time", 0) or 0), 3),
                      "message": message[:2000]})
    return tests


def counts(tests: list[dict]) -> dict:
    return {o: sum(t["outcome"] == o for t in tests) for o in OUTCOMES}


def run_pytest(stage: Stage, args: list[str], env: dict, report: str, deadline: float | None = None) -> dict:
    """``python -m pytest ARGS`` with a JUnit report in the work folder; returns the run
    (``returncode``, ``seconds``, ``interrupted``), ``tests`` and their ``counts``."""
    return run_pytest_shards(stage, [[]], args, env, report, deadline)


def run_pytest_shards(stage: Stage, shards: list[list[str]], args: list[str], env: dict, report: str,
                      deadline: float | None = None) -> dict:
    """One ``python -m pytest ARGS SHARD`` per shard (lists of test ids), all at once, each with its JUnit
    report; the tests of all of them in shard order, the largest exit code, interrupted if any was."""
    junits = [stage.work / (f"{report}.xml" if len(shards) == 1 else f"{report}-{i + 1}.xml") for i in range(len(shards))]
    for junit in junits:
        junit.unlink(missing_ok=True)
    runs = run_logged_together(stage, [python_cmd("-m", "pytest", *args, *shard, "-p", "no:cacheprovider",
                                                  f"--junitxml={junit}", "-o", "junit_family=xunit2")
                                       for shard, junit in zip(shards, junits)], env=env, deadline=deadline)
    tests = [t for junit in junits for t in read_junit(junit)]
    return {"returncode": max(r["returncode"] for r in runs), "seconds": max(r["seconds"] for r in runs),
            "interrupted": any(r["interrupted"] for r in runs), "tests": tests, "counts": counts(tests),
            "shards": [{"tests": len(shard), **r} for shard, r in zip(shards, runs)]}


VERBOSITY = ("-q", "-qq", "-v", "-vv", "--quiet", "--verbose")


def collect_command(args: list[str]) -> list[str]:
    """``python -m pytest --collect-only -q ARGS`` with ARGS' own verbosity flags left out: one ``-q`` lists
    the ids, a second one (a stage's ``-q`` on top of this one, 2026-11-27) lists ``file: count`` lines instead."""
    return python_cmd("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                      *(a for a in args if a not in VERBOSITY))


def collect(args: list[str], env: dict, timeout: float = 180) -> list[str]:
    """The ids of the tests ``python -m pytest ARGS`` would run (``--collect-only``), in order."""
    proc = subprocess.run(collect_command(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return collected_ids(proc.stdout)


def collected_ids(text: str) -> list[str]:
    """Test ids from ``pytest --collect-only -q``'s output (its summary and warnings left out)."""
    return [line.strip() for line in text.splitlines() if "::" in line and not line.startswith((" ", "="))]


def deal(ids: list[str], shards: int, first: tuple[str, ...] = ()) -> list[list[str]]:
    """``ids`` dealt round-robin into at most ``shards`` lists, the tests whose function is named in ``first``
    ahead (each shard then starts with one of them), the others in the order given."""
    name = lambda i: i.split("::")[-1].split("[")[0]  # noqa: E731
    ordered = [i for i in ids if name(i) in first] + [i for i in ids if name(i) not in first]
    n = max(1, min(shards, len(ordered)))
    return [ordered[k::n] for k in range(n)]
