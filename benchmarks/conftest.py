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


def side_by_side(dense_fn, concept_fn, rounds: int = 3) -> dict:
    """Median seconds of each, alternating dense / concept every round (after one warm-up each)."""
    dense_fn(), concept_fn()
    dense, concept = [], []
    for _ in range(rounds):
        for fn, acc in ((dense_fn, dense), (concept_fn, concept)):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    d, c = statistics.median(dense), statistics.median(concept)
    return {"dense_s": d, "concept_s": c, "speedup": d / c}


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
                      f"{'KV MiB dense':>12} {'KV MiB concept':>14} {'KV saving':>9}")
        for r in decode:
            tr.write_line(f"{r['case']:44} {r['dense_tokens_per_s']:11.2f} {r['concept_tokens_per_s']:13.2f} "
                          f"{r['decode_ratio']:14.3f} {r['dense_kv_bytes'] / 2**20:12.2f} "
                          f"{r['kv_bytes'] / 2**20:14.2f} {r['kv_saving']:8.2f}x")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_grad_enabled(True)
    yield
