"""concept: compress a pretrained LLM's token stream into discrete concept tokens inside the model.

Attributes are imported lazily, so ``import concept`` (and commands such as
``concept plugins list``) do not pay for torch until a model is needed.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "build": "builder", "load": "builder", "save": "builder", "calibrate": "streaming.calibration",
    "BuildConfig": "config", "ComponentRef": "config", "resolve": "config",
    "ConceptModel": "streaming.model", "ConceptOutput": "streaming.model",
    "ConceptError": "errors", "ConfigError": "errors", "generate": "generation",
}
_MODULES = ("hub", "precision")  # submodules handed on by name (the modeling file copied into exports reads them)
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'concept' has no attribute {name!r}")
