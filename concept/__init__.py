"""concept: compress a pretrained LLM's token stream into discrete concept tokens inside the model."""
from __future__ import annotations

__version__ = "0.1.0"

from .builder import build, load, save  # noqa: E402
from .config import BuildConfig, ComponentRef, resolve  # noqa: E402
from .errors import ConceptError, ConfigError  # noqa: E402
from .model import ConceptModel, ConceptOutput  # noqa: E402

__all__ = ["build", "load", "save", "BuildConfig", "ComponentRef", "resolve", "ConceptModel", "ConceptOutput",
           "ConceptError", "ConfigError", "__version__"]
