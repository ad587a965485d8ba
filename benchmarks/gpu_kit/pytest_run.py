"""pytest from a stage: run it under the stage's budget and read back every test's outcome.

The outcomes come from pytest's own JUnit XML report (no plugin needed on the device), which
pytest writes even when the run is interrupted at the deadline.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from .common import Stage, python_cmd, run_logged

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
    junit = stage.work / f"{report}.xml"
    junit.unlink(missing_ok=True)
    run = run_logged(stage, python_cmd("-m", "pytest", *args, "-p", "no:cacheprovider", f"--junitxml={junit}",
                                       "-o", "junit_family=xunit2"), env=env, deadline=deadline)
    tests = read_junit(junit)
    return {**run, "tests": tests, "counts": counts(tests)}
