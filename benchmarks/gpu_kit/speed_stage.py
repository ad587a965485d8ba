"""`speed`: the streaming model against the dense backbone on this GPU, each next to its ideal FLOP ratio.

The existing pytest-benchmark suites (what ``concept bench`` runs) with their GPU cases, most
decisive first: the full forward (eager; compiled, against the dense backbone compiled alike and HF
eager: issue 39's forward target), a training step, the deep attention alone, decoding and prefill, the
policy's scan, then decoding eager against compiled over static KV caches, streaming against dense
(``test_compiled_decode.py``, tokens/s; it starts only with its cap left before the stage's deadline),
at 8k tokens at the default operating point (split 4,18,8, 0.125 concepts per token; 2k and 16k are `concept bench --long` cases for a longer lease), inference in bf16 weights and training under
bf16 autocast, with peak memory. Each row is timed by CUDA events (median of 20 after warm-up) and
profiled once per side: device busy, kernel launches, host syncs, aten ops (``benchmarks/conftest.py``). Their per-row JSON
(``--concept-results``) becomes ``speed.json``; the run is saved as a pytest-benchmark baseline
under the GPU's name (``speed-baseline.json``; `report` files it under
``benchmarks/baselines/<gpu>/``). From the rows: which backend is fastest at each length, and what
``auto`` should choose on CUDA (a recommendation in the JSON; ``auto.py`` is not changed here).
"""
from __future__ import annotations

import shlex
import shutil
import time
from collections import Counter
from pathlib import Path

from . import flex_diagnosis
from .common import ROOT, Stage, kit_env, read_json
from .pytest_run import run_pytest
from .setup_stage import needs_setup, smollm2_ready

# in the order they run (pytest runs the files in the order given): the most decisive first, so that a budget
# that runs out cuts the least
SUITES = ("test_forward.py", "test_train_step.py", "test_attention.py", "test_decode.py", "test_policy_scan.py",
          "test_compiled_decode.py")  # (last: its two compilations take the longest; it starts only with CAP_S left)
# the GPU cases of a 15-minute lease: 8k tokens, the default ratio and build; not `chunked` (5-10x slower than
# `flex` on the H100, 2026-11-26) nor the time-ordered comparison mask (measured then: 0.01-0.07x dense)
GPU_SELECTION = "T8192 and (r0.125 or default) and not chunked and not ordered"
# one small case per suite: seconds on a CPU
DRY_SELECTION = ("chunked-T1024-r0.25 or tiny-llama-T512-chunked or tiny-llama-B2-T256 or (prefill and tiny) "
                 "or B16-T128 or tiny-llama-T256-compiled-decode")
NOT_BACKENDS = {"flex-time-ordered"}  # a comparison mask, not a backend `auto` could choose
MODES = {"train": "training", "forward": "prefill / evaluation"}  # auto.py's columns, from these suites


def fastest(rows: list[dict], ratio: float | None) -> dict:
    """Per suite and length: the exact backend with the largest speed-up over dense, and all of them."""
    out: dict = {}
    for r in rows:
        backend = r.get("backend")
        if not backend or backend in NOT_BACKENDS or "suite" not in r or "T" not in r or r["suite"].endswith("-dense"):
            continue
        if r["suite"] == "attention" and ratio is not None and r.get("ratio") != ratio:
            continue
        out.setdefault(r["suite"], {}).setdefault(str(r["T"]), {})[backend] = round(r["speedup"], 3)
    return {suite: {T: {"fastest": max(by, key=by.get), "speedups": by}
                    for T, by in sorted(lengths.items(), key=lambda item: int(item[0]))}
            for suite, lengths in out.items()}


def recommend(best: dict) -> dict:
    """What `auto` should pick on CUDA per mode: the backend fastest at the most lengths (a tie goes to
    the one fastest at the longest length)."""
    from concept_plugins.attention.auto import AutoBackend

    current = AutoBackend.choice("cuda")
    out = {"current_choice_on_cuda": current}
    for suite, mode in MODES.items():
        lengths = best.get(suite)
        if not lengths:
            out[mode] = {"backend": None, "reason": f"no {suite} case was measured"}
            continue
        wins = Counter(v["fastest"] for v in lengths.values())
        longest = lengths[max(lengths, key=int)]["fastest"]
        top = max(wins.values())
        choice = longest if wins[longest] == top else next(b for b, n in wins.items() if n == top)
        out[mode] = {"backend": choice, "fastest_by_length": {T: v["fastest"] for T, v in lengths.items()},
                     "change": choice != current,
                     "reason": f"fastest at {wins[choice]} of {len(lengths)} lengths ({', '.join(lengths)} tokens)"}
    return out


def baseline_file(storage: Path, name: str) -> Path | None:
    found = sorted(storage.glob(f"*/[0-9][0-9][0-9][0-9]_{name}.json"))
    return found[-1] if found else None


def run(stage: Stage, args) -> int:
    if needs_setup(stage):
        return stage.finish({})
    if not stage.dry and not smollm2_ready(stage.work):
        stage.problem("SmolLM2 is not set up on this machine: make every set-up call first (the last one carries "
                      "the last part), then `speed`")
        return stage.finish({})
    from concept_cli.bench_cmd import machine_id

    device = "cpu" if stage.dry else "cuda"
    machine = machine_id(device)
    folder = stage.work / "speed"
    storage = folder / "baselines" / machine
    shutil.rmtree(storage, ignore_errors=True)  # one saved run per stage run
    rows_path = folder / "rows.json"
    rows_path.unlink(missing_ok=True)
    diagnosis = flex_diagnosis.in_stage(stage)  # issue 40: <= 60 s, before the suites (flex_diagnosis.py)
    selection = DRY_SELECTION if stage.dry else GPU_SELECTION
    pytest_args = [*(f"benchmarks/{s}" for s in SUITES), "-q", "-rs", "--rootdir", str(ROOT), f"--device={device}",
                   f"--dtype={'fp32' if stage.dry else 'bf16'}", "-k", selection,
                   f"--benchmark-storage=file://{storage}", f"--benchmark-save={machine}",
                   f"--concept-results={rows_path}"] + ([] if stage.dry else ["--smollm2", "--long", "--compile=on"])
    env = kit_env(stage.work, stage.dry)
    env["CONCEPT_BENCH_DEADLINE"] = str(time.time() + stage.remaining())  # the decode row's time cap
    report = run_pytest(stage, pytest_args, env, "speed")
    rows = read_json(rows_path) or []
    cases = [{k: t[k] for k in ("id", "outcome", "message")} for t in report["tests"]]
    for t in report["tests"]:
        if t["outcome"] in ("failed", "error"):
            stage.problem(f"{t['id']} {t['outcome']}: {t['message'][:300]}")
    if report["interrupted"]:
        stage.skip("the remaining benchmark cases", f"the time budget ({stage.budget_s:.0f} s) ran out after "
                                                    f"{len(report['tests'])} cases")
    saved = baseline_file(storage, machine)
    if saved is not None:
        shutil.copyfile(saved, stage.out / "speed-baseline.json")
    else:
        stage.skip("the pytest-benchmark baseline", "pytest-benchmark saved none (no timed case completed)")
    ratio = None if stage.dry else 0.125
    best = fastest(rows, ratio)
    result = {"device": device, "machine_id": machine, "selection": selection, "counts": report["counts"],
              "rows": rows, "cases": cases, "fastest": best, "auto_recommendation": recommend(best),
              "flex_diagnosis": diagnosis,
              "baseline": {"file": "speed-baseline.json", "path": str(saved.relative_to(storage.parent)),
                           "name": machine} if saved else None,
              "command": "python -m pytest " + shlex.join(a for a in pytest_args if a != str(ROOT) and not a.startswith(
                  ("--rootdir", "--benchmark-storage", "--concept-results")))}
    stage.say(f"{len(rows)} rows; fastest: " + "; ".join(f"{s} " + ", ".join(f"{T}: {v['fastest']}" for T, v in by.items())
                                                       for s, by in best.items()))
    return stage.finish(result)
