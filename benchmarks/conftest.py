"""Benchmark helpers: side-by-side timing of the concept model and the dense backbone.

Speed is always reported as a ratio measured in one run (interleaved rounds on the same
input), next to the ideal FLOP ratio for the realised split, ratio and T. Absolute times on
a shared 2-core CPU are not comparable between runs; the ratios are.
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

RESULTS: list[dict] = []


def pytest_addoption(parser):
    parser.addoption("--smollm2", action="store_true", help="also run the cases on the real SmolLM2 backbone")
    parser.addoption("--long", action="store_true", help="also run the longest attention cases (16k tokens)")
    parser.addoption("--device", default="cpu", help="cpu or cuda")
    parser.addoption("--compile", default="off", help="the models' compile choice (concept.compiled; `concept bench --compile`)")
    parser.addoption("--concept-results", default=None, help="write the side-by-side rows to this JSON file")
    parser.addoption("--dtype", default="fp32", choices=("fp32", "bf16"),
                     help="bf16: the inference cases in bfloat16 weights, the training steps under bf16 autocast")


def pytest_benchmark_update_machine_info(config, machine_info):
    """torch, CUDA and GPU name next to pytest-benchmark's CPU and Python info."""
    machine_info["torch"] = torch.__version__
    machine_info["cuda"] = torch.version.cuda
    machine_info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine_info["threads"] = torch.get_num_threads()


def pytest_sessionfinish(session):
    path = session.config.getoption("--concept-results", default=None)
    if path:
        import json

        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=float)


@pytest.fixture
def compile_choice(request) -> str:
    """``concept bench --compile``: how a suite's models run their stacks (``concept.build(..., compile=)``)."""
    return request.config.getoption("--compile")


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


def side_by_side(dense_fn, concept_fn, rounds: int = 3, device=None) -> dict:
    """Median seconds of each, alternating dense / concept every round (after one warm-up each).
    On CUDA the clock waits for the device, and the peak memory of each is recorded too."""
    cuda = device is not None and torch.device(device).type == "cuda"
    dense_fn(), concept_fn()
    dense, concept, peak = [], [], {}
    for _ in range(rounds):
        for name, fn, acc in (("dense", dense_fn, dense), ("concept", concept_fn, concept)):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
                peak[name] = torch.cuda.max_memory_allocated(device) / 2**20
            acc.append(time.perf_counter() - start)
    d, c = statistics.median(dense), statistics.median(concept)
    out = {"dense_s": d, "concept_s": c, "speedup": d / c}
    if peak:
        out.update(dense_peak_mib=peak["dense"], concept_peak_mib=peak["concept"])
    return out


@pytest.fixture
def record():
    def add(benchmark, name: str, timing: dict, ideal_speedup: float, **extra):
        row = {"case": name, **timing, "ideal_speedup": ideal_speedup,
               "fraction_of_ideal": timing["speedup"] / ideal_speedup, **extra}
        benchmark.extra_info.update(row)
        RESULTS.append(row)
    return add


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("concept vs dense (measured side by side in this run)")
    tr.write_line(f"{'case':44} {'dense s':>9} {'concept s':>9} {'speedup':>8} {'ideal':>7} {'of ideal':>8}")
    for r in RESULTS:
        tr.write_line(f"{r['case']:44} {r['dense_s']:9.4f} {r['concept_s']:9.4f} {r['speedup']:8.2f} "
                      f"{r['ideal_speedup']:7.2f} {100 * r['fraction_of_ideal']:7.0f}%")
    decode = [r for r in RESULTS if "kv_saving" in r]
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
