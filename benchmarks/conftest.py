"""Benchmark helpers: side-by-side timing of the concept model and the dense backbone.

Speed is always reported as a ratio measured in one run (interleaved rounds on the same
input), next to the ideal FLOP ratio for the realised split, ratio and T. Absolute times on
a shared 2-core CPU are not comparable between runs; the ratios are.

On a GPU (``--device cuda``) every row separates the host from the device: each side is timed with
CUDA events after GPU_WARMUP calls (compilation happens there), median of GPU_REPS alternating calls,
next to its wall time; then one more call of each side runs under ``torch.profiler``
(``concept.profiling.profile_call``): the time the device was busy, kernel launches, host syncs and
aten ops of that call (``dense_device_busy_s``, ``concept_kernel_launches``, ... in the row), and its
kernels with the most device time (``concept_top_device``: name, device ms, calls).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch

RESULTS: list[dict] = []  # the side-by-side rows (``record``)
COUNTS: list[dict] = []  # aten ops and host syncs per call (benchmarks/test_op_counts.py)


def pytest_addoption(parser):
    parser.addoption("--smollm2", action="store_true", help="also run the cases on the real SmolLM2 backbone")
    parser.addoption("--long", action="store_true", help="also run the longest attention cases (16k tokens)")
    parser.addoption("--device", default="cpu", help="cpu or cuda")
    parser.addoption("--compile", default="off",
                     help="the concept model's compile choice (concept.compiled; `concept bench --compile`); not off: "
                          "also the compiled cases, the dense backbone compiled alike (benchmarks/compiled.py)")
    parser.addoption("--concept-results", default=None, help="write the side-by-side rows to this JSON file")
    parser.addoption("--dtype", default="fp32", choices=("fp32", "bf16"),
                     help="bf16: the inference cases in bfloat16 weights, the training steps under bf16 autocast")


def pytest_benchmark_update_machine_info(config, machine_info):
    """torch, CUDA and GPU name next to pytest-benchmark's CPU and Python info."""
    machine_info["torch"] = torch.__version__
    machine_info["cuda"] = torch.version.cuda
    machine_info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine_info["threads"] = torch.get_num_threads()


# The GPU kit's plan for its speed stage (benchmarks/gpu_kit/speed_stage.py): the cases to run first, in this
# order, each with its cap (it starts only with that many seconds left before the kit's deadline)
PLAN_ENV, DEADLINE_ENV = "CONCEPT_BENCH_PLAN", "CONCEPT_BENCH_DEADLINE"  # JSON [[node id, cap s], ...]; Unix time


def time_left() -> float:
    """Seconds to the GPU kit's deadline (infinite outside the kit)."""
    deadline = os.environ.get(DEADLINE_ENV)
    return float(deadline) - time.time() if deadline else float("inf")


def planned() -> dict[str, float]:
    """The kit's planned case ids, in order, with their caps (empty outside the kit)."""
    return {node: float(cap) for node, cap in json.loads(os.environ.get(PLAN_ENV) or "[]")}


# The cases whose rows also say where each side's host syncs come from (JSON [node id, ...]; the speed stage's):
# one more call of each side, profiled with Python's stacks (``concept.profiling.sync_stacks``), ``NAME_sync_stacks``
SYNC_STACKS_ENV = "CONCEPT_BENCH_SYNC_STACKS"


def sync_stacks_wanted() -> bool:
    """Whether the running case is one of :data:`SYNC_STACKS_ENV`'s."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return bool(current) and current in json.loads(os.environ.get(SYNC_STACKS_ENV) or "[]")


def add_sync_stacks(out: dict, fns: dict, device) -> dict:
    """``NAME_sync_stacks`` for each of ``fns`` where the running case wants them (after its timed calls)."""
    if sync_stacks_wanted():
        from concept.profiling import profile_call

        for name, fn in fns.items():
            out[f"{name}_sync_stacks"] = profile_call(fn, device, stacks=True)["sync_stacks"]
    return out


def pytest_collection_modifyitems(session, config, items):
    """The planned cases first, in the plan's order; the others after them, in their own order."""
    plan = list(planned())
    if plan:
        rank = {node: i for i, node in enumerate(plan)}
        items.sort(key=lambda item: rank.get(item.nodeid, len(plan)))  # (a stable sort)


def pytest_runtest_setup(item):
    cap = planned().get(item.nodeid)
    if cap is not None and time_left() < cap:
        pytest.skip(f"the GPU kit's deadline is {time_left():.0f} s away, less than this case's cap ({cap:.0f} s)")


def pytest_sessionfinish(session):
    path = session.config.getoption("--concept-results", default=None)
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS + [{"suite": "ops", **r} for r in COUNTS], f, indent=1, default=float)


@pytest.fixture
def compile_choice(request, device) -> str:
    """``concept bench --compile``: how a suite's models run their stacks (``concept.build(..., compile=)``); ``auto``
    as it decides on the suite's device (``concept.compiled.device_choice``: ``off`` on a CPU, so the compiled suites
    skip there)."""
    from benchmarks.compiled import suite_choice

    return suite_choice(request.config.getoption("--compile"), device.type)


@pytest.fixture
def device(request):
    name = request.config.getoption("--device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(name)


@pytest.fixture
def dtype(request):
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[request.config.getoption("--dtype")]


# The GPU cases (docs/gpu.md): the default operating point (split 4,18,8, 0.125 concepts per token)
# at long contexts, on CUDA only.
GPU_LENGTHS = (2048, 8192, 16384)


def gpu_case(request, device, T: int, real_backbone: bool = True) -> None:
    """Skip a GPU case unless it was asked for: a CUDA device, --long beyond 4k tokens, and --smollm2
    for the cases on the real backbone."""
    if device.type != "cuda":
        pytest.skip("a GPU case (the default operating point at 2k-16k tokens): pass --device cuda")
    if T > 4096 and not request.config.getoption("--long"):
        pytest.skip("pass --long for the 8k- and 16k-token cases")
    if real_backbone and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")


def skip_unavailable(backend: str) -> None:
    """Skip a case whose attention backend cannot run here (e.g. xformers without its CUDA kernels)."""
    from concept.registry import registry

    reason = getattr(registry("attention").get(backend), "unavailable_reason", lambda: "")()
    if reason:
        pytest.skip(f"attention {backend}: {reason}")


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autocast(device, dtype):
    """bf16 autocast for training steps (what the trainer does on CUDA); off for fp32."""
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# GPU timing (docs/benchmarks.md): warm-up calls, then the median of this many calls of each side
GPU_WARMUP, GPU_REPS = 3, 20


def side_by_side(dense_fn, concept_fn, rounds: int = 3, device=None) -> dict:
    """Median seconds of each, alternating dense / concept every round (after one warm-up each). On CUDA:
    :func:`gpu_side_by_side` (CUDA events, GPU_REPS rounds, a profiled call of each, peak memory)."""
    return side_by_side_named({"dense": dense_fn, "concept": concept_fn}, rounds, device)


def side_by_side_named(fns: dict, rounds: int | None = None, device=None) -> dict:
    """:func:`side_by_side` for any number of sides (name -> call): :func:`gpu_side_by_side` on CUDA, else
    :func:`cpu_side_by_side` (``rounds``, default 3)."""
    if device is not None and torch.device(device).type == "cuda":
        return gpu_side_by_side(fns, device)
    return cpu_side_by_side(fns, rounds or 3)


def cpu_side_by_side(fns: dict, rounds: int = 3) -> dict:
    """Each of ``fns`` (name -> call) once, then ``rounds`` rounds calling each in turn: ``NAME_s``, the
    median seconds (and ``speedup``, dense over concept, where both are there)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    if "dense" in fns and "concept" in fns:
        out["speedup"] = out["dense_s"] / out["concept_s"]
    return add_sync_stacks(out, fns, "cpu")


def gpu_side_by_side(fns: dict, device, warmup: int = GPU_WARMUP, reps: int = GPU_REPS) -> dict:
    """Each of ``fns`` (name -> call) on a CUDA device: ``warmup`` calls each, then ``reps`` rounds calling
    each in turn, timed by CUDA events around the call (``NAME_s``: the median) and by the host clock to the
    device's end (``NAME_wall_s``), with the peak memory (``NAME_peak_mib``); then one profiled call of each
    (``NAME_device_busy_s``, ``NAME_kernel_launches``, ``NAME_host_syncs``, ``NAME_aten_ops``, and what took
    the device time: ``NAME_top_device``, its :data:`TOP_DEVICE` largest kernels; ``NAME_short_kernels``, those of a
    few microseconds a call: ``concept.profiling.short_kernels``). With a
    ``dense`` and a ``concept`` entry, ``speedup`` is dense over concept."""
    from concept.profiling import profile_call

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize(device)
    spans = {name: [] for name in fns}
    walls = {name: [] for name in fns}
    peak = {name: 0.0 for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            torch.cuda.reset_peak_memory_stats(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            walls[name].append(time.perf_counter() - host)
            spans[name].append(start.elapsed_time(end) / 1e3)
            peak[name] = max(peak[name], torch.cuda.max_memory_allocated(device) / 2**20)
    out: dict = {"reps": reps, "warmup": warmup, "timer": "cuda events"}
    for name, fn in fns.items():
        prof = profile_call(fn, device)
        out.update({f"{name}_s": statistics.median(spans[name]), f"{name}_wall_s": statistics.median(walls[name]),
                    f"{name}_spread": (min(spans[name]), max(spans[name])), f"{name}_peak_mib": peak[name],
                    f"{name}_device_busy_s": prof["device_busy_s"], f"{name}_kernel_launches": prof["kernel_launches"],
                    f"{name}_host_syncs": prof["host_syncs"], f"{name}_aten_ops": prof["aten_ops"],
                    f"{name}_top_device": top_device(prof), f"{name}_short_kernels": prof.get("short_kernels")})
    if "dense" in fns and "concept" in fns:
        out["speedup"] = out["dense_s"] / out["concept_s"]
    return add_sync_stacks(out, fns, device)


TOP_DEVICE = 8  # a row's kernels with the most device time, per side (``NAME_top_device``)


def top_device(prof: dict, top: int = TOP_DEVICE, name_chars: int = 160) -> list[dict]:
    """What takes a profiled call's device time: its ``top`` kernels and copies (``concept.profiling``'s
    ``top_device``), each ``op`` (the name, cut to ``name_chars``: a C++ kernel's template arguments run long),
    ``device_ms`` (its own device time in the call) and ``calls``."""
    return [{"op": t["op"][:name_chars], "device_ms": t["device_ms"], "calls": t["calls"]}
            for t in prof["top_device"][:top]]


def renamed_sides(timing: dict, names: dict[str, str]) -> dict:
    """The ``NAME_...`` fields of :func:`gpu_side_by_side` / :func:`cpu_side_by_side` for the sides in ``names``
    (old name -> new name), renamed; the other sides' fields left out, the shared ones (``reps``...) kept."""
    own = [k for k in timing if k.endswith("_s") and not k.endswith(("_wall_s", "_busy_s"))]
    sides = sorted({k.rsplit("_s", 1)[0] for k in own}, key=len, reverse=True)
    out = {}
    for key, value in timing.items():
        side = next((n for n in sides if key.startswith(n + "_")), None)
        if side is None:
            out[key] = value
        elif side in names:
            out[names[side] + key[len(side):]] = value
    return out


@pytest.fixture
def record():
    def add(benchmark, name: str, timing: dict, ideal_speedup: float | None, **extra):
        """``ideal_speedup`` None: the two sides do the same work another way (``sides`` names them, e.g.
        ("step loop", "host scan")), so there is no FLOP ideal to compare against."""
        fraction = None if ideal_speedup is None else timing["speedup"] / ideal_speedup
        row = {"case": name, **timing, "ideal_speedup": ideal_speedup, "fraction_of_ideal": fraction, **extra}
        benchmark.extra_info.update(row)
        RESULTS.append(row)
    return add


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    mine = bool(tr.config.getoption("--concept-results", default=None))  # `concept bench` prints these tables itself
    if COUNTS and not mine:
        tr.section("aten ops and host syncs per call (concept.profiling.OpCounter)")
        tr.write_line(f"{'backbone':11} {'call':28} {'model':10} {'tokens':>7} {'aten ops':>9} {'host syncs':>10} "
                      f"{'not optim':>9} {'frozen casts':>12}  where")
        for r in COUNTS:
            sites = ", ".join(f"{k} x{n}" for k, n in r["sync_sites"].items())
            casts = "-" if r.get("frozen_weight_casts") is None else str(r["frozen_weight_casts"])
            tr.write_line(f"{r['backbone']:11} {r['what']:28} {r['model']:10} {r['tokens']:7d} {r['aten_ops']:9d} "
                          f"{r['host_syncs']:10d} {r['syncs_outside_optimizer']:9d} {casts:>12}  {sites}")
    on_device = [r for r in RESULTS if "concept_device_busy_s" in r]
    decode = [r for r in RESULTS if "kv_saving" in r]
    if not RESULTS or (mine and not on_device and not decode):
        return
    tr.section("concept vs dense (measured side by side in this run)")
    if not mine:
        tr.write_line(f"{'case':44} {'dense s':>9} {'concept s':>9} {'speedup':>8} {'ideal':>7} {'of ideal':>8}")
        for r in RESULTS:
            ideal = ("      -        -" if r["ideal_speedup"] is None else
                     f"{r['ideal_speedup']:7.2f} {100 * r['fraction_of_ideal']:7.0f}%")
            sides = f"  ({' / '.join(r['sides'])})" if r.get("sides") else ""
            tr.write_line(f"{r['case']:44} {r['dense_s']:9.4f} {r['concept_s']:9.4f} {r['speedup']:8.2f} {ideal}{sides}")
    if on_device:  # GPU rows: where each side's time goes (one profiled call each)
        tr.write_line("")
        tr.write_line(f"{'case (GPU: one profiled call)':44} {'side':8} {'events ms':>9} {'wall ms':>8} "
                      f"{'busy ms':>8} {'launches':>8} {'syncs':>5} {'aten ops':>8}")
        for r in on_device:
            for side, named in zip(("dense", "concept"), r.get("sides") or ("dense", "concept")):
                tr.write_line(f"{r['case']:44} {named:8} {1e3 * r[side + '_s']:9.2f} {1e3 * r[side + '_wall_s']:8.2f} "
                              f"{1e3 * r[side + '_device_busy_s']:8.2f} {r[side + '_kernel_launches']:8d} "
                              f"{r[side + '_host_syncs']:5d} {r[side + '_aten_ops']:8d}")
    if decode:
        tr.write_line("")
        tr.write_line(f"{'decode case':44} {'dense tok/s':>11} {'concept tok/s':>13} {'ratio (decode)':>14} "
                      f"{'ratio (prompt)':>14} {'KV MiB dense':>12} {'KV MiB concept':>14} {'KV saving':>9}")
        for r in decode:
            tr.write_line(f"{r['case']:44} {r['dense_tokens_per_s']:11.2f} {r['concept_tokens_per_s']:13.2f} "
                          f"{r['decode_ratio']:14.3f} {r.get('prompt_ratio', float('nan')):14.3f} "
                          f"{r['dense_kv_bytes'] / 2**20:12.2f} "
                          f"{r['kv_bytes'] / 2**20:14.2f} {r['kv_saving']:8.2f}x")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_grad_enabled(True)
    yield
