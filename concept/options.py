"""One definition per option: a dataclass field declares its default, its command-line flag, its help
and its simple checks; the CLI options, the checks and the mapping back are derived from it.

    @dataclass
    class Recipe:
        steps: int = option(300, minimum=1, help="Optimizer steps.")
        mode: str = option("fast", choices=("fast", "exact"), help="How to run.")
        lora: LoraSettings = nested(LoraSettings, prefix="lora")  # --lora-rank ... -> recipe.lora.rank

* :func:`check` lists every declared constraint an instance breaks (all at once); a number option is always
  finite (NaN and infinity are refused whatever its range);
  rules that relate several fields stay hand-written in the dataclass's own ``validate``.
* :class:`FamilyOptions` is the base of a model family's own training options (``Family.training``).
* :func:`click_params` / :func:`click_options` make the click options, in declaration order (a
  :func:`nested` dataclass's in its place); :func:`from_params` builds the dataclass back from the
  command's keyword arguments and :func:`paths` names the field each option sets.
* Each option belongs to a help group (:func:`group_of`): the title its class declares (``options_title``,
  e.g. "LoRA adapters"), or a finer one its class names it in (``option_groups``: title -> field names); a
  made click option carries it as ``help_group`` (``concept --help`` shows one section per group).

Standard library only; click is imported when click options are made.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import typing
from dataclasses import dataclass
from typing import Any

KEY = "concept.option"  # the field-metadata key
SEED_MAX = 2 ** 63 - 1  # the largest seed torch, numpy and Python's random all take
FLOAT32_MAX = 3.4028234663852886e38


def finite(value: float) -> bool:
    """A number the model's float32 tensors can hold (not NaN, not infinite, not beyond float32's range)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX
TYPES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class Spec:
    """What :func:`option` records in a field's metadata."""

    help: str
    flag: str | None = None  # default: --NAME, underscores as dashes
    choices: tuple | None = None
    minimum: float | None = None  # value >= minimum
    above: float | None = None  # value > above
    maximum: float | None = None  # value <= maximum
    below: float | None = None  # value < below
    metavar: str | None = None
    show_default: bool = True
    click: dict = dataclasses.field(default_factory=dict)  # other click.Option keywords, as they are
    prefix: str | None = None  # set by nested(): the field holds another option dataclass
    aliases: tuple[str, ...] = ()  # other flags for the same option (e.g. --rope for --position-scheme)

    def problem(self, value: Any, annotation: Any) -> str | None:
        """What is wrong with ``value`` for this option (None: nothing)."""
        if not _typed(value, annotation):
            return f"expected {TYPES.get(_plain(annotation)[0], 'a value')}, got {value!r}"
        if value is None:  # (allowed: the field is optional)
            return None
        if isinstance(value, float) and not finite(value):  # every number option is finite
            return f"must be a finite number, got {value}"
        if self.choices is not None and value not in self.choices:
            return f"{_either(self.choices)}, got {value!r}"
        bounds = ((self.minimum, operator.ge), (self.above, operator.gt), (self.maximum, operator.le),
                  (self.below, operator.lt))
        if any(bound is not None and not op(value, bound) for bound, op in bounds):  # (NaN fails too)
            return f"must be {self.range()}, got {value}"
        return None

    def range(self) -> str:
        """``>= 1``, ``> 0``, ``in (0, 1]``, ..."""
        low = ("[", self.minimum) if self.minimum is not None else ("(", self.above) if self.above is not None else None
        high = ("]", self.maximum) if self.maximum is not None else (")", self.below) if self.below is not None else None
        if low and high:
            return f"in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {_number(low[1])}"
        return f"{'<=' if high[0] == ']' else '<'} {_number(high[1])}"


def option(default: Any, *, help: str, flag: str | None = None, choices=None, minimum: float | None = None,
           above: float | None = None, maximum: float | None = None, below: float | None = None,
           metavar: str | None = None, show_default: bool = True, aliases: tuple[str, ...] = (),
           default_factory=None, **click_kwargs) -> Any:
    """A dataclass field that is also a command-line option. ``minimum`` / ``maximum`` are inclusive bounds,
    ``above`` / ``below`` exclusive ones; ``choices`` the allowed values (None passes where the default is
    None); ``aliases`` more flags for it. ``default_factory`` instead of ``default`` for a mutable default
    (such an option is only made with ``unset``, and its help names the default). ``click_kwargs`` go to
    ``click.Option`` as they are (e.g. ``is_flag=False, flag_value="dense"``: an option whose value may be
    left out)."""
    spec = Spec(help, flag, None if choices is None else tuple(choices), minimum, above, maximum, below, metavar,
                show_default, dict(click_kwargs), aliases=tuple(aliases))
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={KEY: spec})
    return dataclasses.field(default=default, metadata={KEY: spec})


def nested(cls: type, *, prefix: str) -> Any:
    """A field holding another option dataclass (default ``cls()``), whose options are ``--PREFIX-NAME``."""
    return dataclasses.field(default_factory=cls, metadata={KEY: Spec("", prefix=prefix)})


@dataclass(frozen=True)
class Entry:
    """One command-line option of a dataclass: its click parameter name, flag and field."""

    name: str  # e.g. lora_rank (the keyword argument the command receives)
    path: str  # the field it sets, e.g. lora.rank
    flag: str  # e.g. --lora-rank
    field: dataclasses.Field
    spec: Spec
    type: Any  # int, float, str or bool (None stripped)
    group: str = "options"  # the --help section it is listed in (group_of)


def entries(cls: type, prefix: str = "", path: str = "") -> list[Entry]:
    """The options of ``cls`` in declaration order, a nested dataclass's in its place."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(KEY)
        if spec is None:
            continue
        if spec.prefix is not None:
            found += entries(hints[f.name], f"{prefix}{spec.prefix}_", f"{path}{f.name}.")
            continue
        name = prefix + f.name
        found.append(Entry(name, path + f.name, spec.flag or "--" + name.replace("_", "-"), f, spec,
                           _plain(hints[f.name])[0], group_of(cls, f.name)))
    return found


def group_of(cls: type, name: str) -> str:
    """The help group of the option ``name`` of ``cls``: the title ``cls.option_groups`` lists it under, else
    ``cls.options_title`` (else "options")."""
    for title, names in getattr(cls, "option_groups", {}).items():
        if name in names:
            return title
    return getattr(cls, "options_title", "options")


def check(obj: Any, prefix: str = "") -> list[str]:
    """Every declared constraint ``obj`` breaks, one line each, e.g. ``seq-len: must be >= 2, got 1``
    (the option's flag without its dashes; ``prefix`` before it). A nested dataclass is checked by its own
    ``validate``."""
    hints = typing.get_type_hints(type(obj))
    problems = []
    for f in dataclasses.fields(obj):
        spec = f.metadata.get(KEY)
        if spec is None or spec.prefix is not None:
            continue
        problem = spec.problem(getattr(obj, f.name), hints[f.name])
        if problem:
            problems.append(f"{prefix}{(spec.flag or f.name.replace('_', '-')).lstrip('-')}: {problem}")
    return problems


def mistyped(obj: Any) -> list[str]:
    """The fields of ``obj`` whose value is not of the declared type (checks that compare fields skip them)."""
    hints = typing.get_type_hints(type(obj))
    return [f.name for f in dataclasses.fields(obj) if KEY in f.metadata and f.metadata[KEY].prefix is None
            and not _typed(getattr(obj, f.name), hints[f.name])]


def paths(cls: type) -> dict[str, str]:
    """Click parameter name -> the field it sets: ``{"steps": "steps", "lora_rank": "lora.rank", ...}``."""
    return {e.name: e.path for e in entries(cls)}


def from_params(cls: type, values: dict, prefix: str = "") -> Any:
    """``cls`` from a command's keyword arguments (named as :func:`click_params` names them; other keys are
    ignored, and a missing one keeps its default)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(KEY)
        if spec is not None and spec.prefix is not None:
            kwargs[f.name] = from_params(hints[f.name], values, f"{prefix}{spec.prefix}_")
        elif spec is not None and prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def click_params(cls: type, *names: str, unset: bool = False) -> list:
    """``click.Option`` objects for the options of ``cls`` (all, or those named), in declaration order.
    ``unset``: every default is None, so that an option not given leaves the caller's value (e.g. a config
    file's) alone; the help still shows the field's default."""
    import click

    made = []
    for decls, attrs, group in _click_args(cls, names, unset):
        made.append(click.Option(decls, **attrs))
        made[-1].help_group = group
    return made


def click_options(cls: type, *names: str, unset: bool = False):
    """:func:`click_params` as one decorator: the options appear where it stands."""
    import click

    def apply(f):
        for decls, attrs, group in reversed(_click_args(cls, names, unset)):
            f = click.option(*decls, **attrs)(f)
            f.__click_params__[-1].help_group = group
        return f

    return apply


def _click_args(cls: type, names: tuple, unset: bool) -> list[tuple[list[str], dict, str]]:
    import click

    chosen = [e for e in entries(cls) if not names or e.name in names]
    unknown = set(names) - {e.name for e in chosen}
    if unknown:
        raise ValueError(f"{cls.__name__} has no option named {', '.join(sorted(unknown))}")
    made = []
    for e in chosen:
        default, s = e.field.default, e.spec
        if default is dataclasses.MISSING:  # a default_factory's (a mutable value): its help names it
            if not unset:
                raise ValueError(f"{cls.__name__}.{e.path} has a default_factory: make its option with unset=True")
            default = None
        attrs = {"default": default, "help": s.help, "metavar": s.metavar, "show_default": s.show_default}
        if unset:  # the default shown as click shows one
            shown = s.show_default and default is not None and not (e.type is bool and not default)
            attrs.update(default=None, show_default=False, help=f"{s.help}  [default: {default}]" if shown else s.help)
        if s.choices is not None:
            attrs["type"] = click.Choice(list(s.choices))
        elif e.type is bool:
            attrs["is_flag"] = True
        elif e.type in (int, float, str):
            attrs["type"] = e.type
        made.append(([e.flag, *s.aliases, e.name], {**attrs, **s.click}, e.group))
    return made


def _typed(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is of the declared type (an int is a float; a bool is neither)."""
    tp, optional = _plain(annotation)
    if tp not in TYPES:
        return True
    if value is None:
        return optional
    if isinstance(value, bool):
        return tp is bool
    return isinstance(value, (int, float) if tp is float else tp)


def _plain(annotation: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed): ``int | None`` -> (int, True)."""
    args = typing.get_args(annotation)
    if type(None) not in args:
        return annotation, False
    rest = [a for a in args if a is not type(None)]
    return (rest[0] if len(rest) == 1 else Any), True


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _either(choices: tuple) -> str:
    names = [str(c) for c in choices]
    return " or ".join(names) if len(names) == 2 else f"one of {', '.join(names)}"


class FamilyOptions:
    """The base of a family's training options (``Family.training``): an option dataclass whose fields join
    ``concept.train_config.TrainConfig``. ``teaches``: its options that give a training signal besides the
    cross entropy (so ``--ce-weight 0`` has something to train on); :meth:`problems`: its checks across
    options."""

    teaches: tuple[str, ...] = ()

    @staticmethod
    def problems(config) -> list[str]:
        """What is wrong across this family's options and the shared ones, on the full ``TrainConfig``."""
        return []
