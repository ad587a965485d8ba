"""Build configuration: stdlib dataclasses, validated all at once, round-tripping to JSON.

A :class:`BuildConfig` holds one :class:`ComponentRef` (registry name + params) per slot.
Each component class declares its own ``Config`` dataclass; :func:`resolve` looks every
slot up in the registry, builds those dataclasses from the params, runs their checks and
the cross-component checks, and raises a single :class:`ConfigError` listing every problem.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from .errors import ConceptError, ConfigError, UnknownComponentError
from .registry import KINDS, Provider, registry

SLOTS = ("backbone", "length_policy", "sampler", "eval_sampler", "position_scheme", "vocabulary", "attention",
         "tail_fusion")
CONCEPT_INPUTS = ("identity", "embedding")
FAMILIES = ("streaming", "planner-executor")  # SPEC §2: the two concept model families (dense is a baseline)
SLOT_KIND = {slot: ("sampler" if slot == "eval_sampler" else slot) for slot in SLOTS}
assert set(SLOT_KIND.values()) == set(KINDS)

# The default operating point: the best measured streaming point at <= 0.6x the dense backbone's FLOPs
# (docs/results.md, "The default operating point: 4,18,8 at 0.125"). Split "auto" gives the shallow
# stack 2/15 and the deep stack 4/15 of the backbone's layers (4,18,8 on SmolLM2's 30), and the
# build's calibration, the trainer and the `null` policy aim at DEFAULT_TARGET_RATIO concepts per token.
AUTO_SHALLOW, AUTO_DEEP = 2 / 15, 4 / 15
DEFAULT_TARGET_RATIO = 0.125


@dataclass
class ComponentRef:
    name: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildConfig:
    backbone: ComponentRef = field(default_factory=lambda: ComponentRef("smollm2"))
    # "auto" (AUTO_SHALLOW / AUTO_DEEP of the layers: 4,18,8 on 30), counts "4,22,4" (shallow, middle,
    # deep) or fractions "0.15,0.7,0.15"
    split: str = "auto"
    length_policy: ComponentRef = field(default_factory=lambda: ComponentRef("null"))
    sampler: ComponentRef = field(default_factory=lambda: ComponentRef("gumbel-st"))
    eval_sampler: ComponentRef = field(default_factory=lambda: ComponentRef("argmax"))
    position_scheme: ComponentRef = field(default_factory=lambda: ComponentRef("time"))
    vocabulary: ComponentRef = field(default_factory=lambda: ComponentRef("embedding"))
    attention: ComponentRef = field(default_factory=lambda: ComponentRef("chunked"))
    tail_fusion: ComponentRef = field(default_factory=lambda: ComponentRef("none"))
    # what a concept feeds the middle stack: "identity" = the emitting token's shallow state plus the
    # discrete concept embedding behind a gate that starts at 0 (keep-all == the backbone exactly);
    # "embedding" = the discrete concept embedding alone
    concept_input: str = "identity"
    seed: int = 0
    # which model family the builder wires: "streaming" (concept.model) or "planner-executor"
    # (concept.planner_executor, configured by ``planner``: its concept types, plan budget, ...)
    family: str = "streaming"
    planner: dict[str, Any] = field(default_factory=dict)

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "BuildConfig":
        problems = _unknown_keys(data, [f.name for f in dataclasses.fields(cls)], "build config")
        if problems:
            raise ConfigError(problems)
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in SLOTS:
                if isinstance(value, str):
                    value = {"name": value}
                if not isinstance(value, dict) or "name" not in value:
                    problems.append(f"{key}: expected {{'name': ..., 'params': {{...}}}}, got {value!r}")
                    continue
                kwargs[key] = ComponentRef(value["name"], dict(value.get("params") or {}))
            elif key == "planner" and not isinstance(value, dict):
                problems.append(f"planner: expected an object of planner options, got {value!r}")
            else:
                kwargs[key] = value
        if problems:
            raise ConfigError(problems)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "BuildConfig":
        return cls.from_dict(json.loads(text))

    # -- overrides --------------------------------------------------------------------
    def apply_overrides(self, overrides: list[str], problems: list[str] | None = None) -> "BuildConfig":
        """Apply ``slot.key=value`` / ``key=value`` strings (values parsed as JSON when possible). The ones that
        cannot apply are added to ``problems`` (to be reported with :func:`resolve`'s, all at once), or raised
        as one ``ConfigError`` without it."""
        collect = problems is not None
        problems = problems if collect else []
        for item in overrides:
            if "=" not in item:
                problems.append(f"--set {item!r}: expected slot.key=value, e.g. sampler.tau=0.7")
                continue
            path, raw = item.split("=", 1)
            value = parse_value(raw)
            if path.startswith("planner."):
                self.planner[path.split(".", 1)[1]] = value
            elif "." in path:
                slot, key = path.split(".", 1)
                if slot not in SLOTS:
                    problems.append(_unknown_msg(f"--set {path}: slot", slot, list(SLOTS)))
                    continue
                getattr(self, slot).params[key] = value
            elif path in SLOTS:
                getattr(self, path).name = str(value)
            elif path in ("split", "seed", "concept_input", "family"):
                setattr(self, path, value if path == "seed" else str(raw))
            else:
                problems.append(_unknown_msg("--set key", path, list(SLOTS) + ["split", "seed", "concept_input",
                                                                              "family", "planner.KEY"]))
        if problems and not collect:
            raise ConfigError(problems)
        return self


def parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _unknown_msg(what: str, name: str, available: list[str]) -> str:
    close = difflib.get_close_matches(name, available, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown {what} '{name}'.{hint} Allowed: {', '.join(available)}."


def _unknown_keys(data: dict, allowed: list[str], where: str) -> list[str]:
    return [_unknown_msg(f"key in {where}:", k, allowed) for k in data if k not in allowed]


# -- component configs ---------------------------------------------------------------------

@dataclass
class NoOptions:
    """Config of a component without options."""


def _coerce(value: Any, tp: Any) -> Any:
    """Coerce a JSON/CLI value to a dataclass field type; raise ValueError if impossible."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except ValueError:
                pass
        raise ValueError(f"expected {tp}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and not value.lstrip("-").isdigit()
        ):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"expected a string, got {value!r}")
        return str(value)
    return value


def make_component_config(cls: type, params: dict, where: str) -> tuple[Any, list[str]]:
    """Build ``cls.Config`` from ``params``; return (config or None, problems)."""
    config_cls = getattr(cls, "Config", NoOptions)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    problems = _unknown_keys(params, list(fields), where) if fields else [
        f"{where}: takes no options, got {', '.join(sorted(params))}" for _ in [0] if params
    ]
    hints = typing.get_type_hints(config_cls)
    kwargs = {}
    for key, value in params.items():
        if key not in fields:
            continue
        try:
            kwargs[key] = _coerce(value, hints[key])
        except ValueError as exc:
            problems.append(f"{where}.{key}: {exc}")
    if problems:
        return None, problems
    cfg = config_cls(**kwargs)
    check = getattr(cfg, "validate", None)
    if callable(check):
        problems.extend(f"{where}.{p}" for p in check())
    return (None if problems else cfg), problems


@dataclass
class ResolvedComponent:
    slot: str
    name: str
    cls: type
    config: Any
    provider: Provider
    user_params: dict

    def describe(self) -> dict:
        params = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else {}
        return {
            "name": self.name,
            "provider": self.provider.label,
            "target": self.provider.target,
            "params": params,
            "set_by_user": sorted(self.user_params),
        }


@dataclass
class Plan:
    """A validated config: every component resolved, the split in layer counts."""

    config: BuildConfig
    components: dict[str, ResolvedComponent]
    split: tuple[int, int, int]
    backbone_info: Any
    planner: Any = None  # the planner-executor family: its validated ``PlannerSettings``

    @property
    def family(self) -> str:
        return self.config.family

    def describe(self) -> dict:
        extra = {"planner": self.planner.to_dict()} if self.planner is not None else {}
        return {
            "family": self.config.family,
            **extra,
            "config": self.config.to_dict(),
            "split": {"shallow": self.split[0], "middle": self.split[1], "deep": self.split[2]},
            "backbone": dataclasses.asdict(self.backbone_info),
            "components": {slot: c.describe() for slot, c in self.components.items()},
        }


def parse_split(spec: str, num_layers: int) -> tuple[tuple[int, int, int] | None, list[str]]:
    """Turn "auto", "4,22,4" or "0.15,0.7,0.15" into (shallow, middle, deep) layer counts. "auto" is the
    default operating point's split: AUTO_SHALLOW and AUTO_DEEP of the layers (at least one each)."""
    spec = str(spec).strip()
    if spec == "auto":
        shallow, deep = max(1, round(num_layers * AUTO_SHALLOW)), max(1, round(num_layers * AUTO_DEEP))
        counts = (shallow, num_layers - shallow - deep, deep)
        if counts[1] < 1:
            return None, [f"split: the backbone has {num_layers} layers; at least 3 are needed (one per stack)"]
        return counts, []
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 3:
        return None, [f"split: expected three values 'shallow,middle,deep' (e.g. '4,22,4'), got {spec!r}"]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        return None, [f"split: values must be numbers, got {spec!r}"]
    if all(v.is_integer() and v >= 1 for v in values) and not all(v < 1 for v in values):
        counts = tuple(int(v) for v in values)
    elif all(0 < v < 1 for v in values):
        if abs(sum(values) - 1) > 1e-6:
            return None, [f"split: fractions must sum to 1, got {sum(values):g} from {spec!r}"]
        shallow, deep = round(values[0] * num_layers), round(values[2] * num_layers)
        counts = (shallow, num_layers - shallow - deep, deep)
    else:
        return None, [
            f"split: every stack needs at least one layer; use counts >= 1 ('4,22,4') or fractions in (0,1), got {spec!r}"
        ]
    if min(counts) < 1:
        return None, [f"split: every stack needs at least one layer, {spec!r} gives {counts} for {num_layers} layers"]
    if sum(counts) != num_layers:
        return None, [f"split: {spec!r} sums to {sum(counts)} layers but the backbone has {num_layers}"]
    return counts, []


def resolve(config: BuildConfig, earlier: list[str] | tuple = ()) -> Plan:
    """Validate the whole config; raise one ConfigError listing every problem (``earlier``: the caller's
    own, e.g. ``--set`` items that did not apply, listed first)."""
    problems: list[str] = list(earlier)
    environment_problem = False
    components: dict[str, ResolvedComponent] = {}
    for slot in SLOTS:
        ref: ComponentRef = getattr(config, slot)
        reg = registry(SLOT_KIND[slot])
        try:
            provider = reg.provider(ref.name)
            cls = reg.get(ref.name)
        except UnknownComponentError as exc:
            problems.append(f"{slot}: {exc}")
            continue
        except ConceptError as exc:  # a broken or conflicting installed plugin: the environment, not the input
            problems.append(f"{slot}: {exc}")
            environment_problem = True
            continue
        cfg, errs = make_component_config(cls, ref.params, slot)
        problems.extend(errs)
        if cfg is not None:
            components[slot] = ResolvedComponent(slot, ref.name, cls, cfg, provider, dict(ref.params))

    if not isinstance(config.seed, int) or isinstance(config.seed, bool):
        problems.append(f"seed: expected an integer, got {config.seed!r}")
    if config.concept_input not in CONCEPT_INPUTS:
        problems.append(_unknown_msg("concept_input", str(config.concept_input), list(CONCEPT_INPUTS)))
    planner = None
    if config.family not in FAMILIES:
        problems.append(_unknown_msg("family", str(config.family), list(FAMILIES)))
    elif config.family == "planner-executor":
        from .planner_executor import PlannerSettings

        planner, errs = PlannerSettings.parse(config.planner)
        problems.extend(errs)
        levels = getattr(components["vocabulary"].config, "levels", 1) if "vocabulary" in components else 1
        if "vocabulary" in components and getattr(components["vocabulary"].config, "beam", 1) > 1:
            problems.append("vocabulary.beam: the levels' beam is the streaming family's; the planner-executor "
                            "searches its plans, levels included, with --beam (drop --set vocabulary.beam)")
        for t in planner.types if planner is not None and levels > 1 else ():
            if t.max_len % levels:
                problems.append(f"planner.types: {t.name!r} has max_len {t.max_len}, but with vocabulary.levels {levels} "
                                f"a concept is {levels} code tokens; use a multiple of {levels}")
        scheme = config.position_scheme.name
        if scheme != "per-type":
            problems.append(f"position_scheme: the planner-executor family numbers each token type's positions from 1 "
                            f"(SPEC §2.4); build it with --rope per-type, not {scheme!r}")
    elif config.planner:
        problems.append(f"planner: {', '.join(sorted(config.planner))} configure the planner-executor family; this "
                        f"build is {config.family!r} (pass --family planner-executor, or drop the planner options)")

    split, info = None, None
    if "backbone" in components:
        bb = components["backbone"]
        try:
            info = bb.cls.describe(bb.config)
        except ConceptError as exc:
            problems.append(f"backbone: {exc}")
        if info is not None:
            split, errs = parse_split(config.split, info.num_layers)
            problems.extend(errs)

    # Cross-component compatibility: each component may veto a combination, with its reason.
    if not problems and config.family == "streaming":  # (the other family uses no length policy, attention, ...)
        for comp in components.values():
            check = getattr(comp.cls, "check_compatible", None)
            if callable(check):
                problems.extend(f"{comp.slot} '{comp.name}': {p}" for p in check(comp.config, components))
    if problems:
        raise ConfigError(problems, exit_code=1 if environment_problem else 2)
    return Plan(config=config, components=components, split=split, backbone_info=info, planner=planner)
