"""`speed`: the streaming model against the dense backbone on this GPU, each next to its ideal FLOP ratio.

The existing pytest-benchmark suites (what ``concept bench`` runs) with their GPU cases, at 8k tokens at the
default operating point (split 4,18,8, 0.125 concepts per token; 2k and 16k are `concept bench --long` cases
for a longer lease), inference in bf16 weights and training under bf16 autocast, with peak memory. The
stage's 150 s ran out after 4 cases on 2026-11-27 (the flex diagnosis had taken 91 s of them first), so the
cases now run in a plan, most decisive first (``GPU_PLAN``; ``benchmarks/conftest.py`` puts the planned cases
at the head of pytest's run, and each starts only with its cap left before the deadline):

1. the forward, `flex` eager against the dense backbone eager;
2. the forward compiled against the dense backbone compiled alike (``--compile model``, ``benchmarks.compiled.kit_choice``:
   each forward one graph, inductor, its layers nested regions from torch 2.11; ``on`` on a torch without them) and
   HF eager;
3. one training step, eager;
4. one training step, both models compiled (under ``model`` only where the stage has minutes for its compilations:
   :func:`gpu_plan`);
5. the decided forward's policy scan at 8k, on the host against on the device (the Triton kernel alone: a few
   seconds);
6. decoding, eager against compiled over static KV caches, streaming against dense (tokens/s);

then the other selected cases in the suites' order (`cascade`, the policy deciding, the deep attention alone,
decoding and prefill, the policy's scan, a trained model's forward and decoding with its adapters merged against
unmerged: ``benchmarks/test_merged.py``) until the suites' deadline, which leaves ``DIAGNOSIS_SHARE`` of the
budget to the flex diagnosis after them (issue 40; ``flex_diagnosis.py``, its decisive variants first). The
xformers cases are deselected, with the reason, where its kernels do not run (the plugin's probe). Each
row is timed by CUDA events (median of 20 after warm-up) and profiled once per side: device busy, kernel
launches, host syncs, aten ops, and the 8 kernels with the most device time (``SIDE_top_device``, which `report`
tables under the forward rows; ``benchmarks/conftest.py``); the forward's rows at 8k (forced `flex`, the policy
deciding, `cascade`) also where each host sync came from (``sync_stacks``: the Python stack of each, profiled
once more ``with_stack``). Their per-row JSON (``--concept-results``)
becomes ``speed.json``, with every case's outcome and seconds in the order run; the run is saved as a
pytest-benchmark baseline under the GPU's name (``speed-baseline.json``; `report` files it under
``benchmarks/baselines/<gpu>/``). From the rows: which backend is fastest at each length, and what ``auto``
should choose on CUDA (a recommendation in the JSON; ``auto.py`` is not changed here).
"""
from __future__ import annotations

import json
import shlex
import shutil
import time
from collections import Counter
from pathlib import Path

from ..conftest import DEADLINE_ENV, PLAN_ENV, SYNC_STACKS_ENV
from . import flex_diagnosis
from .common import ROOT, Stage, kit_env, read_json
from .pytest_run import run_pytest
from .setup_stage import needs_setup, smollm2_ready, xformers_unavailable


def kit_choice() -> str:
    """The compile choice of the compiled cases (``benchmarks.compiled.kit_choice``: ``model``, or ``on`` where this
    torch has no layer regions; imported here, not at the module's import: it imports torch)."""
    from ..compiled import kit_choice as choice

    return choice()

SUITES = ("test_forward.py", "test_train_step.py", "test_attention.py", "test_decode.py", "test_policy_scan.py",
          "test_compiled_decode.py", "test_adapters.py", "test_merged.py")
# the GPU cases of a 15-minute lease: 8k tokens, the default ratio and build; not `chunked` (5-10x slower than
# `flex` on the H100, 2026-11-26) nor the time-ordered comparison mask (measured then: 0.01-0.07x dense)
GPU_SELECTION = ("(T8192 and (r0.125 or default) and not chunked and not ordered) or adapter_cost_on_the_gpu")
# (the adapters' cost a projection, ``benchmarks/test_adapters.py``: the demo recipe's training rows, not 8k tokens)
# the cases to run first, in this order, each with its cap: the seconds it must have left before the suites'
# deadline to start (its compilations, warm-up and rounds; estimates: no compiled 8k case has finished on a
# GPU yet, the eager forward took under 15 s on the H100, 2026-11-27)
GPU_PLAN = (
    ("benchmarks/test_forward.py::test_forward_default_point_vs_dense[default-T8192-flex]", 0),
    ("benchmarks/test_forward.py::test_forward_compiled_vs_dense_compiled[default-T8192-compiled]", 30),
    ("benchmarks/test_train_step.py::test_train_step_default_point_vs_dense[default-B1-T8192-flex]", 15),
    ("benchmarks/test_train_step.py::test_train_step_compiled_vs_dense_compiled[default-B1-T8192-compiled]", 30),
    ("benchmarks/test_policy_scan.py::test_host_scan_vs_device_scan_on_the_gpu[default-B1-T8192-device]", 10),
    # (15: the `triton` side compiles its three kernels on its first call, a few seconds, inside the case)
    ("benchmarks/test_adapters.py::test_adapter_cost_on_the_gpu[default-demo-recipe]", 15),
    ("benchmarks/test_compiled_decode.py::test_compiled_decode_vs_dense[default-T8192-compiled-decode]", 45),
)
# the caps of the cases whose compilations ``--compile model`` makes longer (``gpu_plan``): the forward at 8k (on this
# CPU under torch 2.11 its first forward compiles 1.7x ``on``'s seconds; on the H200 ``on``'s took 7.7 s and the
# dense side's 23.2 s), and a training step at 8k, compiled anew for its shapes (setup's graphs are for 128-token
# rows): 2.8x ``on``'s compilation for streaming, 3.2x for dense (docs/benchmarks.md, "The regions on the GPU image's
# torch"), some 3 minutes for both, more than the suites' share of a 2.5-minute stage (120 s). The case then does not
# start (its skip says why) and the cases after it run; setup's compiled rows measure compiled training at the demo
# recipe. A longer stage (--minutes) runs it.
WHOLE_CAPS = {GPU_PLAN[1][0]: 60, GPU_PLAN[3][0]: 200}


def gpu_plan(choice: str) -> tuple:
    """:data:`GPU_PLAN` with the caps of a ``choice`` (``model``: :data:`WHOLE_CAPS`)."""
    from concept.config import WHOLE_CHOICE

    caps = WHOLE_CAPS if choice == WHOLE_CHOICE else {}
    return tuple((node, caps.get(node, cap)) for node, cap in GPU_PLAN)


# one small case per suite: seconds on a CPU
DRY_SELECTION = ("chunked-T1024-r0.25 or tiny-llama-T512-chunked or tiny-llama-T512-compiled or tiny-llama-B2-T256 "
                 "or (prefill and tiny) or B16-T128 or tiny-llama-T256-compiled-decode or test_adapter_cost")
# the dry run's plan: the same five on the tiny backbone (the compiled forward and step skip: no --compile here)
DRY_PLAN = (
    ("benchmarks/test_forward.py::test_forward_vs_dense[tiny-llama-T512-chunked]", 0),
    ("benchmarks/test_forward.py::test_forward_compiled_vs_dense_compiled[tiny-llama-T512-compiled]", 1),
    ("benchmarks/test_train_step.py::test_train_step_vs_dense[tiny-llama-B2-T256]", 1),
    ("benchmarks/test_train_step.py::test_train_step_compiled_vs_dense_compiled[tiny-llama-B2-T256-compiled]", 1),
    ("benchmarks/test_compiled_decode.py::test_compiled_decode_vs_dense[tiny-llama-T256-compiled-decode]", 1),
)
# the cases whose rows say where each side's host syncs come from (one more call per side, profiled with Python's
# stacks; ``sync_stacks`` in speed.json): the 2026-11-27 lease counted 3 syncs in the forced `flex` forward at 8k
# that no CPU counter finds (dense: 1), 7 with the policy deciding, 29 with `cascade`
GPU_SYNC_STACKS = ("benchmarks/test_forward.py::test_forward_default_point_vs_dense[default-T8192-flex]",
                   "benchmarks/test_forward.py::test_forward_default_point_decided_by_the_policy_vs_dense"
                   "[default-T8192-decided]",
                   "benchmarks/test_forward.py::test_forward_default_point_vs_dense[default-T8192-cascade]")
DRY_SYNC_STACKS = ("benchmarks/test_forward.py::test_forward_vs_dense[tiny-llama-T512-chunked]",)
DIAGNOSIS_SHARE = 0.2  # of the stage's budget, kept for the flex diagnosis after the suites (30 s of 150)
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


def sync_stacks(rows: list[dict]) -> dict:
    """Case -> side -> where its host syncs came from (``concept.profiling.sync_stacks``), from the rows that
    have them (``GPU_SYNC_STACKS``)."""
    return {row["case"]: {k[: -len("_sync_stacks")]: v for k, v in row.items() if k.endswith("_sync_stacks")}
            for row in rows if any(k.endswith("_sync_stacks") for k in row)}


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
    selection = DRY_SELECTION if stage.dry else GPU_SELECTION
    xformers = xformers_unavailable()
    if xformers:  # each case would only skip or fail inside the budget (2026-11-27: failed)
        selection = f"({selection}) and not xformers"
        stage.skip("the xformers cases", xformers)
    pytest_args = [*(f"benchmarks/{s}" for s in SUITES), "-q", "-rs", "--rootdir", str(ROOT), f"--device={device}",
                   f"--dtype={'fp32' if stage.dry else 'bf16'}", "-k", selection,
                   f"--benchmark-storage=file://{storage}", f"--benchmark-save={machine}",
                   f"--concept-results={rows_path}"] + ([] if stage.dry else ["--smollm2", "--long", f"--compile={kit_choice()}"])
    plan = DRY_PLAN if stage.dry else gpu_plan(kit_choice())
    suites_s = stage.remaining() - DIAGNOSIS_SHARE * stage.budget_s
    env = {**kit_env(stage.work, stage.dry), PLAN_ENV: json.dumps(plan), DEADLINE_ENV: str(time.time() + suites_s),
           SYNC_STACKS_ENV: json.dumps(DRY_SYNC_STACKS if stage.dry else GPU_SYNC_STACKS)}
    report = run_pytest(stage, pytest_args, env, "speed", deadline=time.monotonic() + suites_s)
    rows = read_json(rows_path) or []
    cases = [{k: t[k] for k in ("id", "outcome", "seconds", "message")} for t in report["tests"]]
    for t in report["tests"]:
        if t["outcome"] in ("failed", "error"):
            stage.problem(f"{t['id']} {t['outcome']}: {t['message'][:300]}")
    if report["interrupted"]:
        stage.skip("the remaining benchmark cases", f"the suites' share of the time budget ({suites_s:.0f} s of "
                                                    f"{stage.budget_s:.0f} s) ran out after {len(report['tests'])} cases")
    saved = baseline_file(storage, machine)
    if saved is not None:
        shutil.copyfile(saved, stage.out / "speed-baseline.json")
    else:
        stage.skip("the pytest-benchmark baseline", "pytest-benchmark saved none (no timed case completed)")
    ratio = None if stage.dry else 0.125
    best = fastest(rows, ratio)
    result = {"device": device, "machine_id": machine, "selection": selection, "plan": [node for node, _ in plan],
              "counts": report["counts"],
              "rows": rows, "cases": cases, "fastest": best, "auto_recommendation": recommend(best),
              "flex_diagnosis": {}, "sync_stacks": sync_stacks(rows),
              "baseline": {"file": "speed-baseline.json", "path": str(saved.relative_to(storage.parent)),
                           "name": machine} if saved else None,
              "command": "python -m pytest " + shlex.join(a for a in pytest_args if a != str(ROOT) and not a.startswith(
                  ("--rootdir", "--benchmark-storage", "--concept-results")))}
    stage.say(f"{len(rows)} rows; fastest: " + "; ".join(f"{s} " + ", ".join(f"{T}: {v['fastest']}" for T, v in by.items())
                                                       for s, by in best.items()))
    for case, sides in result["sync_stacks"].items():
        stage.say(f"host syncs of {case}: " + "; ".join(
            f"{side} " + (", ".join(f"{r['count']}x {r['call']} from {r['ours']}" for r in found) or "none")
            for side, found in sides.items()))
    stage.write("running", result)  # the suites' rows kept, should the call be cut during the diagnosis
    result["flex_diagnosis"] = flex_diagnosis.in_stage(stage)  # issue 40: what the suites left (flex_diagnosis.py)
    return stage.finish(result)
