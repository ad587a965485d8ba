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
from .families import family, sections
from .options import SEED_MAX, finite, option
from .registry import KINDS, Provider, registry

SLOTS = ("backbone", "length_policy", "sampler", "eval_sampler", "position_scheme", "vocabulary", "attention",
         "tail_fusion")
CONCEPT_INPUTS = ("identity", "identity-scaled", "embedding")
SLOT_KIND = {slot: ("sampler" if slot == "eval_sampler" else slot) for slot in SLOTS}
assert set(SLOT_KIND.values()) == set(KINDS) - {"family"}
# The build keys that only some families read (the streaming forward's components and layout; issue 41, item 1
# moves them into the streaming family's own section): a family names those it reads (``Family.slots``); for
# another family they are neither resolved nor written, printed or inspected, and setting one is refused.
FAMILY_KEYS = (*SLOTS[1:], "split", "concept_input", "max_ratio")

# The default operating point: the best measured streaming point at <= 0.6x the dense backbone's FLOPs
# (docs/results.md, "The default operating point: 4,18,8 at 0.125"). Split "auto" gives the shallow
# stack 2/15 and the deep stack 4/15 of the backbone's layers (4,18,8 on SmolLM2's 30), and the
# build's calibration, the trainer and the `null` policy aim at DEFAULT_TARGET_RATIO concepts per token.
AUTO_SHALLOW, AUTO_DEEP = 2 / 15, 4 / 15
DEFAULT_TARGET_RATIO = 0.125
# --compile (concept.compiled): off until a GPU measurement says otherwise; "on": the device's mode
COMPILE_CHOICES = ("off", "on", "default", "reduce-overhead", "max-autotune", "aot-eager")
# BuildConfig.max_ratio's words (besides a number in [0, 1]; 0 = none)
MAX_RATIO_AUTO, MAX_RATIO_NONE = "auto", "none"
COMPILE_HELP = ("Run the layer stacks compiled (torch.compile, fullgraph): --compile alone is `on` (CUDA graphs on "
                "CUDA, torch's default mode elsewhere); a streaming model needs a static budget (concept build "
                "--max-ratio). aot-eager: captured but not code-generated (debugging).")


def device_mode(choice: str, device_type: str) -> str:
    """The torch.compile mode of a ``compile`` choice (:data:`COMPILE_CHOICES`) on a device type."""
    if choice == "on":
        return "reduce-overhead" if device_type == "cuda" else "default"
    return choice


def uses_cuda_graphs(mode: str | None, device_type: str) -> bool:
    """Whether torch.compile's ``mode`` runs its graphs as CUDA graphs on a device type (``reduce-overhead``,
    ``max-autotune`` on CUDA): their outputs then live in memory a later compiled call reuses (``concept.compiled``)."""
    if device_type != "cuda" or mode in (None, "aot-eager"):
        return False
    import torch._inductor  # lazy: only a compiled model asks

    return bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs", False))


@dataclass
class ComponentRef:
    name: str
    params: dict[str, Any] = field(default_factory=dict)


def slot(default: str, *, help: str, **kwargs) -> Any:
    """A component slot of :class:`BuildConfig`: ``ComponentRef(default)`` unless another is chosen; its
    flag (``--SLOT NAME``) names another registered component of the slot's kind."""
    return option(None, help=f"{help} (default: {default}).", metavar="NAME", show_default=False,
                  default_factory=lambda: ComponentRef(default), **kwargs)


@dataclass
class BuildConfig:
    options_title = "model"  # their --help sections (concept.options.group_of)
    option_groups = {"components": SLOTS}

    backbone: ComponentRef = slot("smollm2", help="Backbone plugin; smollm2 is the offline SmolLM2-135M")
    # "auto" (AUTO_SHALLOW / AUTO_DEEP of the layers: 4,18,8 on 30), counts "4,22,4" (shallow, middle,
    # deep) or fractions "0.15,0.7,0.15"
    split: str = option("auto", metavar="TEXT", help="Layers per stack: 'auto' (2/15 shallow, 4/15 deep: 4,18,8 on "
                                                     "30 layers), counts '4,22,4' or fractions '0.15,0.7,0.15'.")
    length_policy: ComponentRef = slot("null", help="Length policy plugin")
    sampler: ComponentRef = slot("gumbel-st", help="Training sampler plugin")
    eval_sampler: ComponentRef = slot("argmax", help="Inference sampler plugin")
    position_scheme: ComponentRef = slot("time", help="Position scheme plugin", flag="--rope",
                                         aliases=("--position-scheme",))
    vocabulary: ComponentRef = slot("embedding", help="Concept vocabulary plugin")
    attention: ComponentRef = slot("chunked", help="Deep-stack attention backend")
    tail_fusion: ComponentRef = slot("none", help="What tail tokens take from their latest concept: none, update, "
                                                  "bridge")
    # what a concept feeds the middle stack: "identity" = the emitting token's shallow state plus the
    # discrete concept embedding behind a gate that starts at 0 (keep-all == the backbone exactly);
    # "identity-scaled" = the same with the gate in units of the shallow state's RMS; "embedding" = the
    # discrete concept embedding alone
    concept_input: str = option("identity", choices=CONCEPT_INPUTS,
                                help="Concept input: the emitting token's shallow state + a gated embedding "
                                     "(identity), the same with the gate in units of the shallow state "
                                     "(identity-scaled), or the discrete embedding alone (embedding).")
    seed: int = option(0, minimum=0, maximum=SEED_MAX, help="Seed for the new modules.")
    # streaming: the static concept budget (concept.packing.budget): a number, "auto" (derived from the length
    # policy: concept.streaming.budget) or "none" / 0 = off (layout widths follow the batch)
    max_ratio: float | str = option(
        MAX_RATIO_AUTO, metavar="R|auto|none",
        help="Streaming: static shapes. A row's first n real tokens emit at most ceil(max_ratio * n) boundaries "
             "(the model drops those over it), so the packed layout has ceil(max_ratio * T) concept slots per row "
             "whatever the decisions (no host sync, one compiled graph). auto: twice the length policy's target "
             "ratio, plus 4 boundaries of slack per row (0.25 at the default 0.125; fixed: its own rate "
             "1 / every); none or 0: off, widths follow the batch.")
    # which model family the builder wires (a ``concept.families`` entry point: ``concept plugins list``)
    family: str = option("streaming", metavar="NAME",
                         help="Model family (`concept plugins list --kind family`): streaming (online concept "
                              "compression) or planner-executor (the LLM plans typed concepts, then writes text from "
                              "the plan alone; configure its types with --set planner.types='[{\"name\": ..., "
                              "\"size\": K, \"max_len\": N}, ...]').")
    # the families' own options by section name (``--set SECTION.KEY=VALUE``; in JSON ``"SECTION": {...}``)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self):
        # a component named by a string (``BuildConfig(backbone="tiny-llama")``) is that component with its defaults
        for name in SLOTS:
            if isinstance(getattr(self, name), str):
                setattr(self, name, ComponentRef(getattr(self, name)))

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(data.pop("sections"))  # each family's section at the top level, under its own name
        for key in unread_keys(self.family):
            del data[key]
        return data

    def unread_set(self) -> list[str]:
        """The keys of :data:`FAMILY_KEYS` that this build's family does not read but that differ from their defaults
        (an option the user set for nothing)."""
        fresh = BuildConfig()
        return [key for key in unread_keys(self.family) if getattr(self, key) != getattr(fresh, key)]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "BuildConfig":
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "sections"]
        known = family_sections()
        problems = _unknown_keys(data, fields + list(known), "build config")
        if problems:
            raise ConfigError(problems)
        kwargs: dict[str, Any] = {"sections": {}}
        for key, value in data.items():
            if key in SLOTS:
                if isinstance(value, str):
                    value = {"name": value}
                if not isinstance(value, dict) or "name" not in value:
                    problems.append(f"{key}: expected {{'name': ..., 'params': {{...}}}}, got {value!r}")
                    continue
                kwargs[key] = ComponentRef(value["name"], dict(value.get("params") or {}))
            elif key in known:
                if not isinstance(value, dict):
                    problems.append(f"{key}: expected an object of {known[key]} options, got {value!r}")
                else:
                    kwargs["sections"][key] = dict(value)
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
        sections = family_sections()  # (reads the entry points once)
        for item in overrides:
            if "=" not in item:
                problems.append(f"--set {item!r}: expected slot.key=value, e.g. sampler.tau=0.7")
                continue
            path, raw = item.split("=", 1)
            value = parse_value(raw)
            head, _, key = path.partition(".")
            if key and head in sections:
                self.sections.setdefault(head, {})[key] = value
            elif "." in path:
                slot, key = path.split(".", 1)
                if slot not in SLOTS:
                    problems.append(_unknown_msg(f"--set {path}: slot", slot, list(SLOTS)))
                    continue
                getattr(self, slot).params[key] = value
            elif path in SLOTS:
                getattr(self, path).name = str(value)
            elif path in ("split", "seed", "concept_input", "family", "max_ratio"):
                setattr(self, path, value if path == "seed" else parse_max_ratio(raw) if path == "max_ratio"
                        else str(raw))
            else:
                problems.append(_unknown_msg("--set key", path, list(SLOTS) + [
                    "split", "seed", "concept_input", "family", "max_ratio", *(f"{s}.KEY" for s in sections)]))
        if problems and not collect:
            raise ConfigError(problems)
        return self


def parse_max_ratio(raw):
    """A ``max_ratio`` as given on a command line (``0.25``, ``auto``, ``none``): a number where it is one,
    else the text as it is (:func:`max_ratio_problem` names what is wrong with it)."""
    if not isinstance(raw, str):
        return raw
    try:
        return float(raw)
    except ValueError:
        return raw.strip().lower()


def max_ratio_problem(value) -> str | None:
    """What is wrong with a ``max_ratio`` (None: nothing)."""
    if value in (MAX_RATIO_AUTO, MAX_RATIO_NONE):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return (f"max_ratio: a number in [0, 1], '{MAX_RATIO_AUTO}' (from the length policy's target ratio) or "
                f"'{MAX_RATIO_NONE}' (no static budget; so is 0), got {value!r}")
    return None


def has_budget(value) -> bool:
    """Whether a ``max_ratio`` asks for a static budget: ``auto`` or a number above 0 (``auto`` may still find
    none for a length policy with neither a target nor a bound: ``concept.streaming.budget``)."""
    return value == MAX_RATIO_AUTO or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)


def unread_keys(name: str) -> tuple[str, ...]:
    """The keys of :data:`FAMILY_KEYS` that the family ``name`` does not read (``Family.slots``); none while the
    family cannot be looked up (``resolve`` says why)."""
    try:
        reads = family(name).slots
    except ConceptError:
        return ()
    return tuple(key for key in FAMILY_KEYS if key not in reads)


def family_sections() -> dict[str, str]:
    """Section name -> the family whose options it holds."""
    return sections()


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
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
        if not finite(number):  # (the rule of every number option: concept.options)
            raise ValueError(f"expected a finite number, got {value!r}")
        return number
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
class BuildResolution:
    """A validated config: every component resolved, the split in layer counts."""

    config: BuildConfig
    components: dict[str, ResolvedComponent]
    split: tuple[int, int, int]
    backbone_info: Any
    settings: Any = None  # the family's validated options (its section), if it has any

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def family_object(self):
        return family(self.config.family)

    def describe(self) -> dict:
        section = self.family_object.section
        extra = {section: self.settings.to_dict()} if section and self.settings is not None else {}
        split = {} if self.split is None else {
            "split": {"shallow": self.split[0], "middle": self.split[1], "deep": self.split[2]}}
        return {
            "family": self.config.family,
            **extra,
            "config": self.config.to_dict(),
            **split,
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


def resolve(config: BuildConfig, earlier: list[str] | tuple = ()) -> BuildResolution:
    """Validate the whole config; raise one ConfigError listing every problem (``earlier``: the caller's
    own, e.g. ``--set`` items that did not apply, listed first)."""
    problems: list[str] = list(earlier)
    environment_problem = False
    settings, fam = None, None
    try:
        fam = family(config.family)
    except UnknownComponentError as exc:
        problems.append(f"family: {exc}")
    except ConceptError as exc:  # a broken or conflicting installed family: the environment, not the input
        problems.append(f"family: {exc}")
        environment_problem = True
    unread = set(unread_keys(config.family)) if fam is not None else set()
    problems.extend(f"{key}: the {config.family} family does not read it (it reads "
                    f"{', '.join(fam.slots) or 'none of the streaming keys'}); drop it" for key in config.unread_set())
    components: dict[str, ResolvedComponent] = {}
    for slot in SLOTS:
        if slot in unread:
            continue
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
    elif not 0 <= config.seed <= SEED_MAX:
        problems.append(f"seed: must be in [0, {SEED_MAX}] (a 64-bit seed), got {config.seed}")
    if "concept_input" not in unread and config.concept_input not in CONCEPT_INPUTS:
        problems.append(_unknown_msg("concept_input", str(config.concept_input), list(CONCEPT_INPUTS)))
    if "max_ratio" not in unread and max_ratio_problem(config.max_ratio):
        problems.append(max_ratio_problem(config.max_ratio))
    sections = family_sections()
    for section, options in config.sections.items():
        if fam is not None and section == fam.section:
            continue
        owner = sections.get(section, "another")
        problems.append(f"{section}: {', '.join(sorted(options))} configure the {owner} family; this build is "
                        f"{config.family!r} (pass --family {owner}, or drop the {section} options)")
    if fam is not None:
        settings, errs = fam.settings(config.sections.get(fam.section, {}) if fam.section else {}, components)
        problems.extend(errs)

    split, info = None, None
    if "backbone" in components:
        bb = components["backbone"]
        try:
            info = bb.cls.describe(bb.config)
        except ConceptError as exc:
            problems.append(f"backbone: {exc}")
        if info is not None and "split" not in unread:
            split, errs = parse_split(config.split, info.num_layers)
            problems.extend(errs)

    # Cross-component compatibility: each component may veto a combination, with its reason.
    if not problems and fam.checks_components:  # (a family may use no length policy, attention, ...)
        for comp in components.values():
            problems.extend(f"{comp.slot} '{comp.name}': {p}" for p in comp.cls.check_compatible(comp.config, components))
    if problems:
        raise ConfigError(problems, exit_code=1 if environment_problem else 2)
    return BuildResolution(config=config, components=components, split=split, backbone_info=info, settings=settings)
