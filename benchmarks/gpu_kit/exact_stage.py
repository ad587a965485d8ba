"""`exact`: the CUDA exactness tests (pytest marker ``cuda``), with a pass / fail report per test.

Runs every test file that holds ``cuda``-marked tests (``tests/test_cuda.py``: every attention
backend against the naive reference in fp32 and bf16 with gradients, decoding against teacher
forcing, a bf16 training run resumed exactly; ``tests/test_xformers.py``'s kernel tests where
xformers is installed) with ``-m cuda``. A file whose top-level imports are missing on this machine
(xformers when no wheel fits) is left out, with the reason. Without a CUDA device (``--dry``) every
test skips, and the report has the same shape.

All of it, within a 15-minute lease: most of the stage's time is compilation on the host (FlexAttention,
inductor), not the GPU, so the tests run as SHARDS pytest processes at once (the machine has 16 cores), dealt
round-robin from the collected ids with the tests cut by the budget before (the bf16 resume, twice on
2026-11-26) at the head of the shards. The dry run collects and deals the same way, into DRY_SHARDS
process (the ids it runs are the collected ones). Where xformers' kernels do not run (the plugin's probe: on the GPU image of 2026-11-27 its
operators refused every call, "xFormers wasn't build with CUDA support"), the xformers tests are
deselected, with that reason under ``skipped``.
"""
from __future__ import annotations

import ast
import importlib.util
import subprocess
from pathlib import Path

from .common import ROOT, Stage, kit_env
from .pytest_run import collect, deal, run_pytest_shards
from .setup_stage import needs_setup, xformers_unavailable

MARKER = "pytest.mark.cuda"
SHARDS = 3  # pytest processes at once on the device
DRY_SHARDS = 1  # a dry run collects and deals the same way (its tests skip), into one process on a small CPU
XFORMERS = "xformers"  # in the id of every xformers test (tests/test_xformers.py, the `xformers` backend's cases)
# ahead in their shards: the bf16 resume (cut by the stage's budget twice, 2026-11-26), then the compiled training
# steps (each an inductor compilation on the host; under ``model`` the first CUDA graphs of the training step, which
# say whether call 2 needs ``CONCEPT_MODEL_CUDA_GRAPHS=0``: docs/gpu.md)
FIRST = ("test_bf16_training_resumes_exactly_on_cuda", "test_compiled_training_steps_equal_eager_on_cuda")


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
    args = ["-m", "cuda", "-q", "-rfEs"]
    try:
        ids = collect([*args, *files], env)
    except subprocess.TimeoutExpired:
        ids = []
    xformers = xformers_unavailable()
    if xformers and ids:  # deselected with the reason: each would only skip (or fail) inside the budget
        left_out = [i for i in ids if XFORMERS in i]
        ids = [i for i in ids if XFORMERS not in i]
        if left_out:
            stage.skip(f"the {len(left_out)} xformers tests", xformers)
    if ids:
        shards = deal(ids, DRY_SHARDS if stage.dry else SHARDS, FIRST)
        stage.say(f"{len(ids)} tests in {len(shards)} pytest processes at once")
    else:
        shards = [files]
        stage.warn("pytest collected no test ids (see exact.log's command); running the files in one process")
    report = run_pytest_shards(stage, shards, args, env, "exact")
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
              "pytest_seconds": report["seconds"], "shards": report["shards"], "tolerances": tolerances(),
              "command": "python -m pytest -m cuda " + " ".join(files)}
    stage.say(", ".join(f"{n} {k}" for k, n in counts.items()))
    return stage.finish(result)
