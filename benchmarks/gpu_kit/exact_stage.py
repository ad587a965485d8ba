"""`exact`: the CUDA exactness tests (pytest marker ``cuda``), with a pass / fail report per test.

Runs every test file that holds ``cuda``-marked tests (``tests/test_cuda.py``: every attention
backend against the naive reference in fp32 and bf16 with gradients, decoding against teacher
forcing, a bf16 training run resumed exactly; ``tests/test_xformers.py``'s kernel tests where
xformers is installed) with ``-m cuda``. A file whose top-level imports are missing on this machine
(xformers when no wheel fits) is left out, with the reason. Without a CUDA device (``--dry``) every
test skips, and the report has the same shape.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from .common import ROOT, Stage, kit_env
from .pytest_run import run_pytest
from .setup_stage import needs_setup

MARKER = "pytest.mark.cuda"


def missing_imports(path: Path) -> list[str]:
    """Top-level modules that ``path`` imports at module level and this machine lacks."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if n not in ("tests", "concept", "concept_cli", "concept_plugins")
                  and importlib.util.find_spec(n) is None)


def cuda_test_files(stage: Stage) -> list[str]:
    files = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if MARKER not in path.read_text():
            continue
        missing = missing_imports(path)
        if missing:
            stage.skip(str(path.relative_to(ROOT)), f"imports {', '.join(missing)}, which this machine lacks")
        else:
            files.append(str(path.relative_to(ROOT)))
    return files


def tolerances() -> dict:
    """``TOLERANCES`` and ``SHARPEN`` of tests/test_cuda.py, read from its source (no torch import here)."""
    values = {}
    for node in ast.parse((ROOT / "tests" / "test_cuda.py").read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", "") in (
                "TOLERANCES", "SHARPEN"):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return {"relative_l2": values["TOLERANCES"], "attention_sharpened": values["SHARPEN"]}


def run(stage: Stage, args) -> int:
    if needs_setup(stage):
        return stage.finish({})
    files = cuda_test_files(stage)
    env = {**kit_env(stage.work, stage.dry), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    report = run_pytest(stage, ["-m", "cuda", "-q", "-rfEs", *files], env, "exact")
    counts, tests = report["counts"], report["tests"]
    for t in tests:
        if t["outcome"] in ("failed", "error"):
            stage.problem(f"{t['id']} {t['outcome']}: {t['message'][:300]}")
    if report["interrupted"]:
        done = {t["id"] for t in tests}
        stage.skip("the remaining tests", f"the time budget ({stage.budget_s:.0f} s) ran out after {len(done)} tests")
    elif report["returncode"] not in (0, 1, 5) and not tests:
        stage.problem(f"pytest exited with code {report['returncode']} before running a test (see exact.log)")
    result = {"files": files, "counts": counts, "tests": tests, "pytest_exit": report["returncode"],
              "pytest_seconds": report["seconds"], "tolerances": tolerances(),
              "command": "python -m pytest -m cuda " + " ".join(files)}
    stage.say(", ".join(f"{n} {k}" for k, n in counts.items()))
    return stage.finish(result)
