"""Plugin registry: one entry-point group per component kind.

Modelled on lm-evaluation-harness's ``Registry``: listing is lazy (it reads entry-point
metadata and imports nothing), lookups fail loudly with suggestions, and a plugin that
cannot be imported only breaks the commands that need it.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from .contracts import BASES, missing_members
from .errors import PluginConflictError, PluginImportError, UnknownComponentError, one_line

# kind (config slot) -> entry-point group
KINDS: dict[str, str] = {
    "backbone": "concept.backbones",
    "length_policy": "concept.length_policies",
    "sampler": "concept.samplers",
    "position_scheme": "concept.position_schemes",
    "vocabulary": "concept.vocabularies",
    "attention": "concept.attention_backends",
    "tail_fusion": "concept.tail_fusions",
    "family": "concept.families",
}

BUILTIN_DIST = "concept"
# kinds whose components are torch modules (the built-ins all subclass torch.nn.Module)
MODULE_KINDS = ("length_policy", "sampler", "position_scheme", "vocabulary", "tail_fusion")


@dataclass(frozen=True)
class Provider:
    """One entry point offering a component name (not imported)."""

    kind: str
    name: str
    target: str
    dist: str | None
    version: str | None

    @property
    def label(self) -> str:
        if self.dist == BUILTIN_DIST:
            return "builtin"
        if self.dist is None:
            return "unknown distribution"
        return f"{self.dist}=={self.version}"


def _provider(kind: str, ep: EntryPoint) -> Provider:
    dist = getattr(ep, "dist", None)
    name = dist.metadata["Name"] if dist is not None else None
    version = dist.version if dist is not None else None
    return Provider(kind, ep.name, ep.value, name, version)


class Registry:
    """All providers of one component kind, discovered from entry points."""

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise UnknownComponentError(_unknown("component kind", kind, list(KINDS)))
        self.kind = kind
        self.group = KINDS[kind]
        self._loaded: dict[str, type] = {}

    def providers(self) -> dict[str, list[Provider]]:
        """name -> providers (more than one means a conflict). Imports nothing."""
        found: dict[str, dict[tuple[str | None, str], Provider]] = {}
        for p in _scan(self.kind, self.group):
            # The same distribution can be visible twice (e.g. an editable install); count it once.
            found.setdefault(p.name, {})[(p.dist, p.target)] = p
        return {name: list(ps.values()) for name, ps in sorted(found.items())}

    def names(self) -> list[str]:
        return list(self.providers())

    def provider(self, name: str) -> Provider:
        providers = self.providers()
        if name not in providers:
            raise UnknownComponentError(_unknown(f"{self.kind.replace('_', ' ')}", name, list(providers)))
        ps = providers[name]
        if len({p.dist for p in ps}) > 1 or len(ps) > 1:
            who = " and ".join(f"{p.label} ({p.target})" for p in ps)
            raise PluginConflictError(
                f"{self.kind.replace('_', ' ')} '{name}' is provided by more than one distribution: {who}. "
                f"Uninstall one of them."
            )
        return ps[0]

    def get(self, name: str) -> type:
        """Import and return the component class registered as ``name``."""
        if name in self._loaded:
            return self._loaded[name]
        p = self.provider(name)
        ep = EntryPoint(name=p.name, value=p.target, group=self.group)
        what = f"{self.kind.replace('_', ' ')} plugin '{name}' from {p.label} ({p.target})"
        try:
            obj = ep.load()
        except (Exception, SystemExit) as exc:  # any import-time failure of third-party code (sys.exit included)
            raise self.failure(name, "failed to import", exc) from exc
        problem = kind_problem(self.kind, obj)
        if problem:
            hint = "" if isinstance(obj, type) else ("; its entry point must name the component class "
                                                     "(package.module:ClassName)")
            raise PluginImportError(f"{what} {problem}{hint}: fix or uninstall {p.dist or 'that package'}")
        self._loaded[name] = obj
        return obj


    def start(self, name: str):
        """An instance of the component ``name``, made with no arguments (a family): a failure of its code is a
        ``PluginImportError`` of one line naming its package, as a failed import is."""
        cls = self.get(name)
        try:
            return cls()
        except (Exception, SystemExit) as exc:  # third-party code: any failure, reported as its package's
            raise self.failure(name, "failed to start", exc) from exc

    def failure(self, name: str, verb: str, exc: BaseException) -> PluginImportError:
        """One line: the plugin ``name`` (its package and target) ``verb`` (e.g. "failed to import") with
        ``exc``, and the fix."""
        p = self.provider(name)
        return PluginImportError(one_line(
            f"{self.kind.replace('_', ' ')} plugin '{name}' from {p.label} ({p.target}) {verb}: "
            f"{type(exc).__name__}: {exc}; fix or uninstall {p.dist or 'the package that provides it'}"))


def kind_problem(kind: str, obj) -> str | None:
    """What keeps ``obj`` (an entry point's target) from being a component of ``kind``, or None: it must be a
    class deriving from the kind's base in ``concept.contracts`` (``BASES``, as lm-eval's ``Registry(base_cls=...)``)
    and defining the members the base requires; of a torch-module kind, also a ``torch.nn.Module`` subclass."""
    if not isinstance(obj, type):
        return f"is {_described(obj)}, not a class"
    base = BASES[kind]
    what = kind.replace("_", " ")
    if kind in MODULE_KINDS:
        import torch  # (a module kind's plugin imports torch anyway)

        if not issubclass(obj, torch.nn.Module):
            return (f"is the class {obj.__qualname__}, not a torch.nn.Module (every {what} is one: "
                    f"class {obj.__name__}({base.__name__}, torch.nn.Module))")
    if not issubclass(obj, base):
        mixed = f"{base.__name__}, torch.nn.Module" if kind in MODULE_KINDS else base.__name__
        return (f"is the class {obj.__qualname__}, which does not derive from concept.contracts.{base.__name__} "
                f"(every {what} does: from concept.contracts import {base.__name__}; class {obj.__name__}({mixed}))")
    missing = missing_members(obj, base)
    if missing:
        return (f"is the class {obj.__qualname__}, which does not define {', '.join(missing)} "
                f"(required by concept.contracts.{base.__name__})")
    return None


def _described(obj) -> str:
    import types

    if isinstance(obj, types.ModuleType):
        return f"the module {obj.__name__}"
    if callable(obj):
        return f"the function {getattr(obj, '__qualname__', obj)!r}"
    return f"{type(obj).__name__} {obj!r}"[:80]


_SCANS: dict[tuple, dict[str, list[Provider]]] = {}


def _scan(kind: str, group: str) -> list[Provider]:
    """The providers of ``group``'s entry points, read once for each ``sys.path`` (a scan of every installed
    distribution's metadata takes a tenth of a second, and every run folder read asks for the families)."""
    key = (tuple(sys.path), entry_points)  # (a package put on the path, or a patched lookup, scans again)
    if key not in _SCANS:
        _SCANS.clear()
        _SCANS[key] = {}
    scanned = _SCANS[key]
    if group not in scanned:
        scanned[group] = [_provider(kind, ep) for ep in entry_points(group=group)]
    return scanned[group]


def _unknown(what: str, name: str, available: list[str]) -> str:
    msg = f"unknown {what} '{name}'."
    close = difflib.get_close_matches(name, available, n=3, cutoff=0.5)
    if close:
        msg += f" Did you mean {' or '.join(repr(c) for c in close)}?"
    msg += f" Available: {', '.join(available) if available else '(none installed)'}."
    return msg


_REGISTRIES: dict[str, Registry] = {}


def registry(kind: str) -> Registry:
    if kind not in _REGISTRIES:
        _REGISTRIES[kind] = Registry(kind)
    return _REGISTRIES[kind]


@dataclass
class CheckResult:
    kind: str
    name: str
    provider: str
    target: str
    status: str  # ok | error | conflict
    detail: str = ""


def check_all(conformance=None) -> list[CheckResult]:
    """Import every registered plugin and report ok / error / conflict for each; with ``conformance`` (a
    ``(kind, cls) -> problem or None``, e.g. ``concept.conformance.problem``, which the registry does not import:
    it sits above the registry), also run each component's tiny conformance forward."""
    results = []
    for kind in KINDS:
        reg = registry(kind)
        for name, ps in reg.providers().items():
            label = ", ".join(p.label for p in ps)
            target = ", ".join(p.target for p in ps)
            try:
                cls = reg.get(name)
                if kind == "family":  # the registry makes a family with no arguments: that must work too
                    reg.start(name)
                status, detail = "ok", ""
                reason = cls.unavailable_reason() if kind != "family" else ""
                if reason:
                    status, detail = "ok", f"limited: {reason}"
                if conformance is not None:
                    found = conformance(kind, cls)
                    if found:
                        status, detail = "error", one_line(
                            f"{kind.replace('_', ' ')} plugin '{name}' from {label} ({target}) fails its conformance "
                            f"check: {found}; fix or uninstall {ps[0].dist or 'the package that provides it'}")
            except PluginConflictError as exc:
                status, detail = "conflict", str(exc)
            except PluginImportError as exc:
                status, detail = "error", str(exc)
            results.append(CheckResult(kind, name, label, target, status, detail))
    return results
