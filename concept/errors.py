"""Errors a user can act on. The CLI prints ``str(error)`` and exits with ``exit_code``."""
from __future__ import annotations


class ConceptError(Exception):
    """Base class: a problem with the user's input or environment, never a bug."""

    exit_code = 1


class ConfigError(ConceptError):
    """One or more problems with a build config, reported all at once."""

    exit_code = 2

    def __init__(self, problems: list[str], exit_code: int = 2):
        self.problems = list(problems)
        self.exit_code = exit_code
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):\n{lines}")


class UnknownComponentError(ConceptError):
    exit_code = 2


class PluginConflictError(ConceptError):
    exit_code = 1


class PluginImportError(ConceptError):
    exit_code = 1


class BackboneError(ConceptError):
    exit_code = 1


class RunFolderError(ConceptError):
    exit_code = 1


class TrainingError(ConceptError):
    """Training cannot go on: the weights or the loss became non-finite (the run keeps its last good
    checkpoint), a checkpoint could not be written."""

    exit_code = 1


def one_line(text: object, limit: int = 400) -> str:
    """``text`` (an exception's message, say) as one line for an ``error:`` message: its lines joined, runs of
    whitespace collapsed, cut at ``limit`` characters (a list of hundreds of keys stays readable)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 5].rstrip() + " ..."
