"""The model families (``concept.families`` entry points, :class:`concept.components.Family`).

The core looks a family up by name (``family("streaming")``) or by model (``family_of(model)``) and
asks it; it never names one. Every model the library builds names its family (``model.family``), the
baselines too (``dense`` / ``pruned``: ``concept.dense.DenseModel``).
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import PluginConflictError, PluginImportError
from .migrate import RecordFormatError, migrate_run
from .registry import BUILTIN_DIST, registry

_INSTANCES: dict = {}


BROKEN: dict[str, str] = {}  # name -> why, of each family that failed to import or start in this process


def family(name: str):
    """The family registered as ``name`` (one instance per name); an unknown name is an
    ``UnknownComponentError`` with suggestions, a family that fails to import or to start a
    ``PluginImportError`` of one line naming its package."""
    if name not in _INSTANCES:
        _INSTANCES[name] = registry("family").start(name)
    return _INSTANCES[name]


def family_of(model):
    """The family of a built model: the one its ``family`` names."""
    return family(model.family)


def of_run(folder) -> str | None:
    """The name of the family a run folder was built with, read from its ``concept.json`` (an older format
    through ``concept.migrate``) without importing any family; None for a folder whose record cannot be read
    (its readers report why)."""
    try:
        try:  # (an older baseline run's build is derived from its train.json: concept.migrate.baseline_build)
            train = json.loads((Path(folder) / "train.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            train = None
        record = migrate_run(json.loads((Path(folder) / "concept.json").read_text(encoding="utf-8")), train)
        name = record["config"]["family"]
    except (OSError, ValueError, KeyError, TypeError, RecordFormatError):
        return None
    return name if isinstance(name, str) else None


def names() -> list[str]:
    return registry("family").names()


def shipped(name: str) -> bool:
    """Whether the family ``name`` comes with this library (its module imports no torch: see
    ``tests/test_broken_family.py``), read from the entry points without importing it."""
    providers = registry("family").providers().get(name, [])
    return bool(providers) and all(p.dist == BUILTIN_DIST for p in providers)


def working(third_party: bool = True, also: str | None = None) -> dict:
    """Name -> family, of every family that imports (a broken plugin only breaks the runs of its own family:
    looking it up by name says what is wrong with it; why it failed is kept in ``BROKEN``). Without
    ``third_party``: only the library's own families and ``also`` (e.g. the one a command builds), imported
    without importing any other (``--help``, a streaming build)."""
    found = {}
    for name in names():
        if not third_party and not shipped(name) and name != also:
            continue
        try:
            found[name] = family(name)
        except (PluginImportError, PluginConflictError) as exc:
            BROKEN[name] = str(exc)
    return found


def sections() -> dict[str, str]:
    """Build-config section name -> the family that reads it (imports each family): its ``section`` and its
    ``build_section``'s (a section two families read names the first)."""
    found = {}
    for name, f in working().items():
        for section in (f.section, getattr(f.build_section, "name", None)):
            if section:
                found.setdefault(section, name)
    return found


def build_options(third_party: bool = True, also: str | None = None) -> dict[str, type]:
    """Family name -> the option dataclass of the ``concept build`` flags only it reads (``build_options``)."""
    return {name: f.build_options for name, f in working(third_party, also).items() if f.build_options is not None}


def build_sections(third_party: bool = True, also: str | None = None) -> dict[str, type]:
    """Family name -> the option dataclass of its build section (``Family.build_section``)."""
    return {name: f.build_section for name, f in working(third_party, also).items() if f.build_section is not None}


def structure(fam, plan) -> dict:
    """What ``concept build`` shows of a resolved ``plan`` of the family ``fam`` (``Family.structure``: by default
    its section's settings, ``{section: settings}``; nothing for a family without a section)."""
    return fam.structure(plan)
