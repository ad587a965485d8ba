"""Recipe files: ``--config FILE`` (YAML or JSON) for ``build``, ``train``, ``eval`` and ``frontier``, and
``--print-config``, which writes the resolved recipe and exits (docs/cli.md, "Recipes").

A recipe's keys are the command's options, named as their flags without dashes (``seq_len`` for
``--seq-len``, ``run_dir`` for the RUN_DIR argument); a nested option group is a section of its own, as in
the saved configs (``lora: {rank: 4}`` for ``--lora-rank 4``, as train.json holds it). A file may hold one
section per command (``build:``, ``train:``, ``eval:``, ``frontier:``): each command reads its own.
File values are defaults: a flag given on the command line overrides them (click's ``default_map``). An
unknown key is an error naming it and the nearest valid one.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import click

COMMANDS = ("build", "train", "eval", "frontier")  # a recipe file's per-command sections
# what a recipe never holds: how this invocation reports or treats existing folders, not what it runs
NOT_RECIPE = ("config_file", "print_config", "help", "as_json", "dry_run", "force", "resume", "accept_data_change")


def read_recipe(path: str | Path) -> dict:
    """The mapping in a YAML file, or a JSON one (``.json``: read as JSON), or a ConfigError naming the file and
    the problem."""
    # lazy: PyYAML and the library load only when a recipe is read
    import yaml
    from concept.errors import ConfigError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"--config {path}: cannot read it ({exc.strerror or exc})"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"--config {path}: not a text file ({exc.reason})"]) from exc
    is_json = Path(path).suffix.lower() == ".json"
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"--config {path}: not valid JSON ({exc})"]) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError([f"--config {path}: not valid YAML{at} ({getattr(exc, 'problem', None) or exc})"]) from None
    if data is None and not is_json:  # (an empty YAML file: no values)
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected {'a JSON object' if is_json else 'a mapping of option: value'}, "
                           f"got {type(data).__name__}"])
    return data


def section(data: dict, command: str, path: str | Path) -> dict:
    """The part of a recipe for ``command``: its section when the file has per-command sections, else all of it."""
    # lazy: the library loads only when a recipe is read
    from concept.errors import ConfigError

    if not any(key in COMMANDS for key in data):
        return data
    stray = [unknown(key, COMMANDS, f"--config {path}", "section") for key in data if key not in COMMANDS]
    if stray:
        raise ConfigError(stray)
    own = data.get(command) or {}
    if not isinstance(own, dict):
        raise ConfigError([f"--config {path}: the {command} section must be a mapping of option: value, got {own!r}"])
    return own


def unknown(key: str, valid, where: str, what: str = "key") -> str:
    """One line naming an unknown ``key`` and the nearest of ``valid`` (difflib)."""
    near = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"{where}: unknown {what} {key!r}." + (f" Did you mean {near[0]!r}?" if near else
                                                  f" Valid: {', '.join(sorted(valid))}.")


def key_of(param: click.Parameter) -> str:
    """A parameter's recipe key: its longest flag without dashes (``--eval-batches`` -> eval_batches), or an
    argument's metavar (RUN_DIR -> run_dir)."""
    if isinstance(param, click.Argument):
        return (param.metavar or param.name).rstrip(".").lower()
    flags = [o for o in param.opts if o.startswith("--") and o not in getattr(param, "old", ())]
    return max(flags, key=len)[2:].replace("-", "_") if flags else param.name


def recipe_params(ctx: click.Context) -> dict[str, click.Parameter]:
    """Recipe key -> the command's parameter it sets (those a recipe may hold)."""
    return {key_of(p): p for p in ctx.command.get_params(ctx) if p.name not in NOT_RECIPE}


def flatten(data: dict, nested: set[str], prefix: str = "") -> dict[str, tuple[str, Any]]:
    """``{"lora": {"rank": 4}}`` -> ``{"lora_rank": ("lora.rank", 4)}`` for a ``nested`` group's section (flat
    key -> (the key as written, value))."""
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name in nested:
            flat.update({k: (f"{key}.{written}", v) for k, (written, v) in flatten(value, nested, f"{name}_").items()})
        else:
            flat[name] = (str(key), value)
    return flat


def nested_groups(ctx: click.Context) -> set[str]:
    """The option groups a recipe writes as sections (``lora``): the prefixes of ``concept.options.nested``
    fields among the command's declared options (``recipe_declared`` on the command)."""
    declared = getattr(ctx.command, "recipe_declared", None)
    if declared is None:
        return set()
    # lazy: the library loads only when a recipe is read
    from concept.options import paths

    return {path.split(".")[0] for path in paths(declared(ctx)).values() if "." in path}


def to_default_map(ctx: click.Context, data: dict, path: str | Path, extra: tuple[str, ...] = ()) -> dict:
    """The click ``default_map`` of a recipe section (``extra``: keys another reader takes, e.g. a build
    config's); an unknown key is a ConfigError naming the nearest valid one."""
    # lazy: the library loads only when a recipe is read
    from concept.errors import ConfigError

    params = recipe_params(ctx)
    nested = nested_groups(ctx)
    defaults, problems = {}, []
    valid = [*params, *extra, *(f"{g}.{k[len(g) + 1:]}" for k in params for g in nested if k.startswith(g + "_"))]
    for key, (written, value) in flatten(data, nested).items():
        if key in extra:
            continue
        if key not in params:
            problems.append(unknown(written, valid, f"--config {path}"))
            continue
        param = params[key]
        if param.multiple or getattr(param, "nargs", 1) == -1:
            value = value if isinstance(value, list) else [value]
        defaults[param.name] = value
    if problems:
        raise ConfigError(problems)
    return defaults


def config_option(command: str, help: str, extra=None, dir_okay: bool = False, bare: bool = True):
    """The ``--config FILE`` option of ``command``: eager, it reads the file's section first and makes its
    values the defaults of the other options (``extra(ctx)``: keys another reader takes from the section;
    ``bare`` False: a file without per-command sections is not this command's, e.g. frontier's build config)."""

    def apply(ctx: click.Context, param: click.Parameter, value):
        if value is None or ctx.resilient_parsing or Path(value).is_dir():  # (a run folder: a build config)
            return value
        data = read_recipe(value)
        if isinstance(data.get("config"), dict):  # a run's concept.json (of any format): a build config
            return value
        if not bare and not any(key in COMMANDS for key in data):
            return value
        data = section(data, command, value)
        found = to_default_map(ctx, data, value, tuple(extra(ctx)) if extra else ())
        ctx.default_map = {**(ctx.default_map or {}), **found}
        return value

    return click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=dir_okay), metavar="FILE",
                        is_eager=True, callback=apply, help=help)


def print_config_option():
    return click.option("--print-config", is_flag=True,
                        help="Write the resolved recipe (YAML: every option's value, --config's and the flags') to "
                             "stdout and exit; `--config` reads it back.")


def dump(data: dict) -> str:
    """A recipe as YAML, keys in the given order (paths and tuples as plain strings and lists)."""
    # lazy: PyYAML loads only when a recipe is written
    import yaml

    def plain(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return yaml.safe_dump(plain(data), sort_keys=False, allow_unicode=True, default_flow_style=False)


def command_values(ctx: click.Context, values: dict, skip: tuple[str, ...] = ()) -> dict:
    """The recipe of a command's resolved ``values`` (param name -> value): every recipe key with a value (None
    left out), nested groups as sections."""
    nested = nested_groups(ctx)
    out: dict = {}
    for key, param in recipe_params(ctx).items():
        value = values.get(param.name)
        if param.name in skip or value is None or (param.multiple and not value):
            continue
        group = next((g for g in nested if key.startswith(g + "_")), None)
        if group is not None:
            out.setdefault(group, {})[key[len(group) + 1:]] = value
        else:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out
