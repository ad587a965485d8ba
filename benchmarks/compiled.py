"""The compiled side of the benchmarks: the dense backbone under ``torch.compile`` in the mode the concept
model compiles in, and the concept model through its own compile option where this build has one.

The honest baseline is the best dense model a user can run, so a compiled concept model is measured against
a dense backbone compiled the same way (and, next to it, against HF eager). On CUDA both use
``mode="reduce-overhead"`` (CUDA graphs), the mode of issue 39's ``--compile``; on a CPU the dense side is
traced by dynamo only (``backend="eager"``): the plumbing, in seconds, never a speed claim.

The concept model's option (``compile=`` of ``concept.build`` and a ``compile`` field of ``TrainConfig``) is
detected, not assumed: :func:`build_option` / :func:`train_option` give the keyword that turns it on, or
None with the reason where this build has none. Its value is read from the option's default (a bool: True;
a string: the choice that means on): the one place to change if the option takes another form.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

GPU_MODE = "reduce-overhead"
ON_VALUES = ("on", "true", "yes", GPU_MODE, "default", "max-autotune")  # what a string option may call "on"
MISSING = "this build of concept has no compile option (issue 39's `compile`)"


def dense_compile_kwargs(device) -> dict:
    """``torch.compile`` keywords for the dense side on ``device``."""
    return {"mode": GPU_MODE} if torch.device(device).type == "cuda" else {"backend": "eager"}


def compile_dense(module, device):
    return torch.compile(module, **dense_compile_kwargs(device))


def on_value(default, choices=None):
    """The value that turns an option on, from its default (and its declared choices)."""
    if default is None or isinstance(default, bool):
        return True
    return next((c for c in ON_VALUES if choices is None or c in choices), "on")


def build_option() -> tuple[dict | None, str]:
    """(``concept.build`` keywords for a compiled model, '') or (None, why not)."""
    import concept

    params = inspect.signature(concept.build).parameters
    if "compile" not in params:
        return None, MISSING
    return {"compile": on_value(params["compile"].default)}, ""


def train_option() -> tuple[dict | None, str]:
    """(``TrainConfig`` fields for compiled training, '') or (None, why not)."""
    from concept import options
    from concept.train_config import TrainConfig

    field = next((f for f in dataclasses.fields(TrainConfig) if f.name == "compile"), None)
    if field is None:
        return None, MISSING
    spec = field.metadata.get(options.KEY)
    return {"compile": on_value(field.default, getattr(spec, "choices", None))}, ""
