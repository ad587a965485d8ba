"""Build configuration: stdlib dataclasses, validated all at once, round-tripping to JSON.

A :class:`BuildConfig` holds the family, the backbone (a :class:`ComponentRef`: registry name + params), the
seed and the families' sections; the chosen family's build section (``Family.build_section``) holds its other
component slots and options. Each component class declares its own ``Config`` dataclass; :func:`resolve` looks
every slot up in the registry, builds those dataclasses from the params, runs their checks and
the cross-component checks, and raises a single :class:`ConfigError` listing every problem.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from .errors import ConceptError, ConfigError, UnknownComponentError
from .families import family, sections
from .options import SEED_MAX, finite, option
from .registry import Provider, registry

SLOTS = ("backbone",)  # the core's component slots; a family's build section holds its others (``Family.build_section``)
CORE_KEYS = ("family", "backbone", "seed")  # a build config's own keys; the rest are the families' sections

# --compile (concept.compiled): off until a GPU measurement says otherwise, then ``auto``; "on": the device's mode
COMPILE_CHOICES = ("off", "auto", "on", "layers", "model", "default", "reduce-overhead", "max-autotune", "aot-eager")
AUTO_CHOICE = "auto"  # decided per device and model (concept.compiled.auto_choice): `model` on CUDA, eager elsewhere
# every command's and the Python API's default (train, eval, bench, generate; concept.build / load): `auto` once a GPU
# lease shows the compiled paths exact and faster (docs/benchmarks.md, "What the lease says of the defaults")
DEFAULT_COMPILE = "off"
# --dtype (concept.precision): the compute precision of training (``TrainConfig.dtype``) and of a loaded model
# (``concept.load``'s ``dtype``, the inference commands' --dtype)
DTYPES = ("auto", "fp32", "bf16")
DEFAULT_DTYPE = "auto"  # ``concept train``'s and every command's that runs a loaded model: bf16 on CUDA, fp32 elsewhere
DEFAULT_INFERENCE_DTYPE = "fp32"  # ``concept.load``'s: a model as it was saved; the commands' ``--dtype`` is ``auto``
INFERENCE_DTYPE_HELP = ("Compute precision: with bf16, or auto on a CUDA device, the frozen base weights are stored "
                        "in bf16 and the model runs under bf16 autocast (LoRA and the new modules stay fp32, as in a "
                        "bf16 training run); fp32 otherwise.")
MERGE_LORA_HELP = ("Merge the run's LoRA adapters into the base weights when loading it (in fp32, before any bf16 "
                   "storage): the backbone's forward without adapter products or casts, the same values up to "
                   "rounding.")
# one graph per decoder layer, shared by a stack's layers (concept.compiled; `on` too: docs/architecture.md §8b)
REGIONAL_CHOICES = ("on", "layers")
WHOLE_CHOICE = "model"  # the whole forward (decisions, packing, plans, stacks, loss) one graph (concept.compiled)
COMPILE_HELP = ("Run the model compiled (torch.compile, fullgraph): `auto` compiles where it runs (`model` on a CUDA "
                "device with Triton, `on` where this torch compiles no layer regions; eager on other devices and "
                "for a model that cannot compile), decided at the model's first call; --compile alone is `on`, "
                "the same as `layers`: one decoder layer compiled and its graph shared by a stack's layers (CUDA "
                "graphs on CUDA, torch's default mode elsewhere); `model`: the whole forward, with its decisions, "
                "packing, attention plans and loss, one graph (no eager op between the stacks; on CUDA a training "
                "forward and its backward run as CUDA graphs); a torch mode by name compiles each stack whole. A "
                "streaming model needs a static budget (concept build --max-ratio). aot-eager: captured, not "
                "code-generated.")


def device_mode(choice: str, device_type: str) -> str:
    """The torch.compile mode of a ``compile`` choice (:data:`COMPILE_CHOICES`) on a device type."""
    if choice in REGIONAL_CHOICES or choice == WHOLE_CHOICE:  # (`on` among them; `model`'s stacks and decoding step)
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


@dataclass(init=False)
class BuildConfig:
    """A build: the family, the backbone, the seed, and the families' sections (section name -> the options of a
    family: an instance of its ``Family.build_section``, e.g. ``concept.streaming.section.StreamingSection``, or the
    JSON object its ``Family.settings`` reads, e.g. the planner-executor's ``planner``).

    Keyword arguments besides these are the chosen family's section by its name (``planner={...}``) or options of
    its build section, whose options also read and write as attributes:
    ``BuildConfig(split="2,2,2", attention="sdpa").split``."""

    options_title = "model"  # their --help sections (concept.options.group_of)

    # which model family the builder wires (a ``concept.families`` entry point: ``concept plugins list``)
    family: str = option("streaming", metavar="NAME",
                         help="Model family (`concept plugins list --kind family`): streaming (online concept "
                              "compression) or planner-executor (the LLM plans typed concepts, then writes text from "
                              "the plan alone; configure its types with --set planner.types='[{\"name\": ..., "
                              "\"size\": K, \"max_len\": N}, ...]'); or a baseline: dense, pruned (--set "
                              "pruned.layers=START:STOP).")
    backbone: ComponentRef = slot("smollm2", help="Backbone plugin; smollm2 is the offline SmolLM2-135M")
    seed: int = option(0, minimum=0, maximum=SEED_MAX, help="Seed for the new modules.")
    # the families' own options by section name (``--set SECTION.KEY=VALUE``; in JSON ``"SECTION": {...}``)
    sections: dict[str, Any] = field(default_factory=dict)

    def __init__(self, family: str = "streaming", backbone: ComponentRef | str | None = None, seed: int = 0,
                 sections: dict | None = None, **options):
        self.family, self.seed = family, seed
        backbone = ComponentRef(self.__dataclass_fields__["backbone"].default_factory().name) if backbone is None \
            else backbone
        self.backbone = ComponentRef(backbone) if isinstance(backbone, str) else backbone
        self.sections = copy.deepcopy(dict(sections or {}))  # (``dataclasses.replace`` passes the original's)
        named = getattr(family_or_none(family), "section", None) if options else None
        if named in options:  # its settings' section by name (``planner={"types": [...]}``)
            self.sections[named] = dict(options.pop(named))
        own = build_section_of(family)
        if own is not None:
            self.sections.setdefault(own.name, own())
        elif options:
            raise ConfigError([f"{key}: the {family} family does not read it (it has no build section of "
                               f"components); drop it" for key in options])
        unknown = [k for k in options if own is not None and k not in own.__dataclass_fields__]
        if unknown:
            raise ConfigError([_unknown_msg(f"{own.name} option", k, list(own.__dataclass_fields__)) for k in unknown])
        section = self.sections.get(own.name) if own is not None else None
        for key, value in options.items():
            setattr(section, key, value)
        if section is not None:
            section.__post_init__()  # (a component named by a string)

    @property
    def section(self):
        """The chosen family's build section (``Family.build_section``), or None."""
        own = build_section_of(self.family)
        return None if own is None else self.sections.setdefault(own.name, own())

    def __getattr__(self, name: str):  # (only for names that are not attributes: the family's section's options)
        if name.startswith("_") or name in ("family", "sections"):
            raise AttributeError(name)
        own = build_section_of(self.family)
        if own is not None and name in own.__dataclass_fields__:
            return getattr(self.section, name)
        raise AttributeError(f"BuildConfig of the {self.family} family has no option {name!r}")

    def __setattr__(self, name: str, value):
        if name not in self.__dataclass_fields__:
            own = build_section_of(self.family)
            if own is not None and name in own.__dataclass_fields__:
                setattr(self.section, name, value)
                return
        object.__setattr__(self, name, value)

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"family", "backbone", "seed", SECTION: {...}}``: each family section under its own name."""
        self.section  # noqa: B018 (the chosen family's, with its defaults)
        sections = {name: s.to_dict() if hasattr(s, "to_dict") else dict(s) for name, s in self.sections.items()}
        return {"family": self.family, "backbone": dataclasses.asdict(self.backbone), "seed": self.seed, **sections}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "BuildConfig":
        """From :meth:`to_dict` (a run's record passes through ``concept.migrate`` first: an older run's flat keys
        move into their section there); every problem at once, as one ``ConfigError``."""
        name = data.get("family", cls.__dataclass_fields__["family"].default)
        own = build_section_of(name) if isinstance(name, str) else None
        own_section = getattr(family_or_none(name), "section", None)
        problems: list[str] = []
        kwargs: dict[str, Any] = {"sections": {}}
        for key, value in data.items():
            if key == "backbone":
                kwargs[key], problem = component_ref(key, value)
                problems += [problem] if problem else []
            elif key in CORE_KEYS:
                kwargs[key] = value
            elif own is not None and key == own.name:
                section, errs = own.from_dict(value) if isinstance(value, dict) else (
                    None, [f"{key}: expected an object of the {name} family's build options, got {value!r}"])
                problems += errs
                kwargs["sections"][key] = section
            elif key == own_section or key in family_sections():
                if not isinstance(value, dict):
                    problems.append(f"{key}: expected an object of {family_sections().get(key, name)} options, "
                                    f"got {value!r}")
                else:
                    kwargs["sections"][key] = dict(value)
            elif own is not None and key in own.__dataclass_fields__:
                problems.append(f"{key}: an option of the {own.name} section; write it there ({own.name}: {{{key}: "
                                f"...}}; a run folder of an older version is brought to today's format when read)")
            else:
                allowed = [*CORE_KEYS, *([own.name] if own else []), *([own_section] if own_section else [])]
                problems.append(_unknown_msg("key in build config:", key, allowed))
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
            head, _, key = path.partition(".")
            section = self.section
            if path == "backbone":
                self.backbone = ComponentRef(str(value))
            elif head == "backbone" and key:
                self.backbone.params[key] = value
            elif path == "seed":
                self.seed = value
            elif path == "family":
                self.family = str(raw)
            elif section is not None and section.override(path, raw) is None:
                pass
            elif key and head in family_sections():  # (every family's: imports them, for this case only)
                self.sections.setdefault(head, {})[key] = value
            else:
                slots = ["backbone", *(section.slots() if section is not None else ())]
                others = [s for s in family_sections() if section is None or s != section.name]
                if key:
                    problems.append(_unknown_msg(f"--set {path}: slot", head, slots + others))
                else:
                    plain = [f.name for f in dataclasses.fields(section) if f.name not in slots] if section else []
                    problems.append(_unknown_msg("--set key", path, [
                        *CORE_KEYS, *slots[1:], *plain, *(f"{s}.KEY" for s in others)]))
        if problems and not collect:
            raise ConfigError(problems)
        return self


def component_ref(key: str, value) -> tuple[ComponentRef | None, str | None]:
    """A component slot's JSON (``{"name": ..., "params": {...}}``, or its name alone) as a :class:`ComponentRef`,
    or (None, the problem)."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, f"{key}: expected {{'name': ..., 'params': {{...}}}}, got {value!r}"
    if value.get("params") is not None and not isinstance(value["params"], dict):
        return None, f"{key}.params: expected an object, got {value['params']!r}"
    return ComponentRef(value["name"], dict(value.get("params") or {})), None


def family_or_none(name):
    """The family ``name``, or None where it cannot be looked up (``resolve`` says why)."""
    try:
        return family(name)
    except (ConceptError, TypeError):
        return None


def build_section_of(name) -> type | None:
    """The build-section dataclass of the family ``name`` (``Family.build_section``), or None."""
    return getattr(family_or_none(name), "build_section", None)








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




def _resolve_components(config: BuildConfig, section, slots: dict, problems: list[str]) -> tuple[dict, bool]:
    """Each slot's component (``slots``: slot -> kind) from the registry, with its validated config; the problems
    go into ``problems``. Returns (slot -> ``ResolvedComponent``, whether a problem was the environment's: a broken
    or conflicting installed plugin)."""
    components: dict[str, ResolvedComponent] = {}
    environment_problem = False
    for slot, kind in slots.items():
        ref: ComponentRef = config.backbone if slot == "backbone" else getattr(section, slot)
        reg = registry(kind)
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
    return components, environment_problem


def _foreign_sections(config: BuildConfig, fam) -> list[str]:
    """A problem per section of ``config`` that the build's family ``fam`` (None: unknown) does not read."""
    own = fam.build_section if fam is not None else None
    problems = []
    for name, options in config.sections.items():
        if fam is not None and name in (fam.section, own.name if own is not None else None):
            continue
        owner = family_sections().get(name, "another")  # (every family's: imports them, for this case only)
        keys = options.to_dict() if hasattr(options, "to_dict") else options
        problems.append(f"{name}: {', '.join(sorted(keys))} configure the {owner} family; this build is "
                        f"{config.family!r} (pass --family {owner}, or drop the {name} options)")
    return problems


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
    own = fam.build_section if fam is not None else None
    section = config.section if own is not None else None
    slots = {"backbone": "backbone", **(own.slots() if own is not None else {})}
    components, environment = _resolve_components(config, section, slots, problems)
    environment_problem = environment_problem or environment
    if not isinstance(config.seed, int) or isinstance(config.seed, bool):
        problems.append(f"seed: expected an integer, got {config.seed!r}")
    elif not 0 <= config.seed <= SEED_MAX:
        problems.append(f"seed: must be in [0, {SEED_MAX}] (a 64-bit seed), got {config.seed}")
    if section is not None:
        problems.extend(section.problems())
    problems.extend(_foreign_sections(config, fam))
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
        if info is not None and section is not None:
            split, errs = section.layers(info.num_layers)
            problems.extend(errs)

    # Cross-component compatibility: each component may veto a combination, with its reason.
    if not problems and fam.checks_components:  # (a family may use no length policy, attention, ...)
        for comp in components.values():
            problems.extend(f"{comp.slot} '{comp.name}': {p}" for p in comp.cls.check_compatible(comp.config, components))
    if problems:
        raise ConfigError(problems, exit_code=1 if environment_problem else 2)
    return BuildResolution(config=config, components=components, split=split, backbone_info=info, settings=settings)
