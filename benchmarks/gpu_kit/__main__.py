"""``python -m benchmarks.gpu_kit STAGE... [--out DIR] [--minutes M]`` (``--dry``: every stage on the CPU).

    python3 -m benchmarks.gpu_kit setup exact --out $OUT      # on the GPU machine (docs/gpu.md)
    python -m benchmarks.gpu_kit --dry                         # every stage on this CPU, tiny backbone, < 1 min
    python -m benchmarks.gpu_kit report                        # the results that came back -> the docs
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import traceback
from pathlib import Path

from . import exact_stage, quality_stage, report_stage, setup_stage, speed_stage
from .common import CALL_LIMIT_S, KIT, ROOT, STAGE_ORDER, WORK, KitError, Stage, activate, read_json

MODULES = {"setup": setup_stage, "exact": exact_stage, "speed": speed_stage, "quality": quality_stage,
           "report": report_stage}
# each stage's default time budget (minutes): the two set-up calls (setup + exact, setup + speed) take 9.5 minutes
# at most with the machine's start, less in practice; a 15-minute lease's plan is in docs/gpu.md
# (setup: 5.5 minutes since 2026-11-28, from quality's worst case: its compiled rows are the training target's, and
# under `--compile model` the streaming model's compilation on the image's torch 2.11 is about 2.8x `on`'s (the
# H200's 38 s: about 105 s), which 4 minutes left no room after for compiled dense, the target's other half: 5.5
# minutes hold compilations of up to about 115 s; docs/gpu.md)
BUDGET_MIN = {"setup": 5.5, "exact": 3.0, "speed": 2.5, "quality": 7.0, "report": 2.0}
DEVICE_STAGES = ("setup", "exact", "speed", "quality")
# the plan of a 15-minute lease (docs/gpu.md), in minutes: the machine's start, then call 1 (setup + exact; its
# setup ends within half a minute: SmolLM2 is not there yet), call 2 (setup + speed), call 3 (quality: what is left
# but the margin), back to back
LEASE_MIN, START_MIN, CALL1_SETUP_MIN, MARGIN_MIN = 15.0, 1.5, 0.5, 1.0


def quality_minutes(lease: float = LEASE_MIN) -> float:
    """The quality call's minutes in the lease's plan when every earlier stage takes its whole budget."""
    calls = CALL1_SETUP_MIN + BUDGET_MIN["exact"] + BUDGET_MIN["setup"] + BUDGET_MIN["speed"]
    return lease - START_MIN - calls - MARGIN_MIN
# a dry run checks the code, not the time: its budgets are this many times the device's (a shared CPU under load
# runs its stages several times slower than it does alone)
DRY_SLACK = 4


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="*", metavar="STAGE",
                   help=f"one or more of {', '.join(STAGE_ORDER)}, run in the order given (with --dry and none: all)")
    p.add_argument("--out", type=Path, help="folder for STAGE.json and STAGE.log (on the device: $OUT); "
                                            "default .gpukit/out, with --dry .gpukit/dry")
    p.add_argument("--dry", action="store_true",
                   help="run on this CPU with the tiny random backbone: the same JSON, in under a minute")
    p.add_argument("--minutes", type=float, help="each stage's time budget in minutes (default: "
                   + ", ".join(f"{k} {v:g}" for k, v in BUDGET_MIN.items()) + ")")
    p.add_argument("--again", action="store_true", help="setup: measure the training throughput again")
    p.add_argument("--total-minutes", type=float, default=14.0,
                   help="quality: minutes of the lease for quality over all its calls; sizes the plan at the first "
                        "call (default 14)")
    p.add_argument("--tokens", type=float, help="quality: at most this many training tokens per model "
                                                "(default: the aim, 3e7)")
    p.add_argument("--batch", type=int, help="quality: sequences of 128 tokens per step (default 128)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="quality: train the three models compiled alike: auto, where setup measured compiled training "
                        "faster and it fits more tokens into the minutes, its compilations counted; on, wherever "
                        "setup measured it faster; off, eager (default auto)")
    p.add_argument("--from", dest="sources", action="append", type=Path, metavar="DIR",
                   help="report: a folder holding the files that came back (repeatable; default .gpukit/results)")
    return p


def check(args) -> list[str]:
    problems = [f"unknown stage {s!r}: choose from {', '.join(STAGE_ORDER)}" for s in args.stages if s not in MODULES]
    if not args.stages and not args.dry:
        problems.append(f"name a stage ({', '.join(STAGE_ORDER)}), or pass --dry to run them all on this CPU")
    for name in ("minutes", "total_minutes", "tokens", "batch"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            problems.append(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    on_device = [s for s in args.stages if s in DEVICE_STAGES]
    total = sum(60 * (args.minutes or BUDGET_MIN[s]) for s in on_device)
    if not args.dry and total > CALL_LIMIT_S - 30:
        problems.append(f"the budgets of {', '.join(on_device)} add up to {total:.0f} s, more than one device call "
                        f"allows ({CALL_LIMIT_S} s with a margin): split them over calls, or pass --minutes")
    return problems


def work_folder(name: str, args, out: Path) -> Path:
    """Where a stage keeps its state: the device stages in .gpukit/work (a dry run, and `report`: inside --out)."""
    return WORK if name in DEVICE_STAGES and not args.dry else out / "work"


def run_stage(name: str, args, out: Path, argv: list[str]) -> int:
    """One stage. The device stages keep their state in .gpukit/work (a dry run: inside --out) and see the
    installed kit; `report` runs here and needs neither."""
    work = work_folder(name, args, out)
    if name in DEVICE_STAGES:
        activate(work, args.dry)
    budget = 60 * (args.minutes or BUDGET_MIN[name]) * (DRY_SLACK if args.dry else 1)
    stage = Stage(name, out, work, args.dry, budget, argv)
    try:
        return MODULES[name].run(stage, args)
    except KitError as exc:
        stage.problem(str(exc))
    except Exception as exc:  # an unexpected failure: one line here, the traceback in the log
        stage.raw(traceback.format_exc())
        stage.problem(f"{type(exc).__name__}: {exc} (the traceback is in {stage.log_path})")
    return stage.finish({})


def run_dry_in_parallel(stages: list[str], args, out: Path, argv: list[str]) -> int:
    """--dry with several stages: the device stages are independent there, so each runs in its own
    process at once (their output goes to STAGE.log); then `report`, which reads their JSON."""
    parallel = [s for s in stages if s in DEVICE_STAGES]
    extra = [a for a in argv if a not in stages]
    procs = {s: subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_kit", s, *extra], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for s in parallel}
    code = 0
    for name, proc in procs.items():
        code = max(code, proc.wait())
        data = read_json(out / f"{name}.json") or {}
        print(f"gpu_kit --dry: {name}: {data.get('status', 'no result')} in {data.get('seconds', 0):.1f} s "
              f"({out / (name + '.log')})", flush=True)
    for name in [s for s in stages if s not in DEVICE_STAGES]:
        code = max(code, run_stage(name, args, out, ["python", "-m", "benchmarks.gpu_kit", *argv]))
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    problems = check(args)
    if problems:
        print("gpu_kit: " + "\n  ".join(["bad arguments:", *problems]), file=sys.stderr)
        return 2
    stages = args.stages or list(STAGE_ORDER)
    out = args.out or KIT / ("dry" if args.dry else "out")
    command = ["python", "-m", "benchmarks.gpu_kit", *argv]
    if args.dry and len(stages) > 1:
        return run_dry_in_parallel(stages, args, out, [*argv, *([] if args.out else ["--out", str(out)])])
    code = 0
    for i, name in enumerate(stages):
        rc = run_stage(name, args, out, command)
        code = max(code, rc)
        if name == "setup" and rc and stages[i + 1:]:
            # a failed measurement (a throughput row) leaves the machine fit: the later stages run, and each
            # checks what it needs (speed and quality: SmolLM2 converted)
            if not setup_stage.machine_ok(work_folder(name, args, out)):
                print(f"gpu_kit: setup failed; not running {', '.join(stages[i + 1:])} (see {out / 'setup.json'})",
                      file=sys.stderr)
                break
            print(f"gpu_kit: setup had problems (see {out / 'setup.json'}), but the machine is set up: "
                  f"running {', '.join(stages[i + 1:])}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
