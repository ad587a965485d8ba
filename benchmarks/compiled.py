"""The compiled side of the benchmarks: the dense backbone under ``torch.compile`` in the mode the concept
model compiles in, and the concept model through its own ``compile`` option (``concept.compiled``).

The honest baseline is the best dense model a user can run, so a compiled concept model is measured against
a dense backbone compiled the same way (and, next to it, against HF eager). On CUDA both use
``mode="reduce-overhead"`` (CUDA graphs), what ``--compile on`` picks there; on a CPU the dense side is
traced by dynamo only (``backend="eager"``): the plumbing, in seconds, never a speed claim.

A streaming model compiles only with a static concept budget (``BuildConfig.max_ratio``): the compiled
builds get :data:`BUDGET` unless they set one (:func:`budgeted`).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from concept.streaming.operating_point import has_budget

GPU_MODE = "reduce-overhead"
BUDGET = 0.25  # the compiled streaming builds' max_ratio: twice the default 0.125 concepts per token


def dense_compile_kwargs(device) -> dict:
    """``torch.compile`` keywords for the dense side on ``device``."""
    return {"mode": GPU_MODE} if torch.device(device).type == "cuda" else {"backend": "eager"}


def compile_dense(module, device):
    return torch.compile(module, **dense_compile_kwargs(device))


def budgeted(config):
    """``config`` (a ``BuildConfig``) with a static concept budget: its own ``max_ratio`` (the default ``auto``
    included), else :data:`BUDGET`."""
    return dataclasses.replace(config, max_ratio=config.max_ratio if has_budget(config.max_ratio) else BUDGET)


def build_option(choice: str = "on") -> dict:
    """``concept.build`` keywords for a compiled model (its config :func:`budgeted`)."""
    return {"compile": choice}


def train_option(choice: str = "on") -> dict:
    """``TrainConfig`` fields for compiled training (the source build :func:`budgeted`)."""
    return {"compile": choice}


def first_calls(fns: dict, device) -> dict:
    """Each of ``fns`` (name -> call) once, timed to the device's end: ``NAME_first_s``, the first call's seconds,
    compilation included (the compiled rows report it next to their steady times)."""
    out = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        out[f"{name}_first_s"] = time.perf_counter() - start
    return out
