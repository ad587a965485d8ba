"""``concept build``: resolve a config (all problems at once), then build and save a run folder."""
from __future__ import annotations

import time
from pathlib import Path

import click
from click.core import ParameterSource
from rich.markup import escape

from concept.config import SLOTS, BuildConfig
from concept.errors import ConfigError
from concept.options import click_options

from .deferred import DeferredOptions
from .recipes import config_option, dump, print_config_option, read_recipe, section

from .output import (
    describe_backbone,
    param_counts,
    print_json,
    quiet_progress_bars,
    render_components,
    render_params,
    render_structure,
    status,
    stdout,
)


def load_config_file(path: str, command: str = "build"):
    """A saved build config: a run folder, a run's concept.json, or a recipe file (YAML or JSON: a bare build
    config or its ``build:`` section), whose keys that are options rather than the config (e.g. the families'
    build options, ``output``) --config took as defaults already (``cli.recipes.config_option``)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import BuildConfig
    from concept.builder import read_run

    p = Path(path)
    if p.is_dir():
        return BuildConfig.from_dict(read_run(p)["config"])
    data = read_recipe(p)
    if isinstance(data.get("config"), dict):  # a run folder's concept.json, of any format
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from concept.builder import localise_backbone_path
        from concept.migrate import RecordFormatError, migrate_run

        try:
            data = localise_backbone_path(migrate_run(data)["config"], p.parent)  # (an export's ./backbone)
        except RecordFormatError as exc:
            raise ConfigError([f"--config {path}: {exc.problem}" + (f"; {exc.fix}" if exc.fix else "")]) from None
        return BuildConfig.from_dict(data)
    keys = build_config_keys()
    return BuildConfig.from_dict({k: v for k, v in section(data, "build", path).items() if k in keys})


def build_config_keys(ctx=None) -> list[str]:
    """The keys of a build config (``BuildConfig.to_dict``): its fields and the families' sections."""
    # lazy: kept beside its one use (concept.config is imported above already: no torch)
    import dataclasses
    from concept.config import family_sections

    return [f.name for f in dataclasses.fields(BuildConfig) if f.name != "sections"] + list(family_sections())


def make_config(config_file, names: dict, split, seed, overrides, concept_input=None, family=None, problems=None):
    """Start from the defaults (or --config) and apply the flags; --set last. ``--family NAME`` brings the
    family's own default components (e.g. the planner-executor's ``per-type`` positions) unless a flag names one."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import BuildConfig, ComponentRef
    from concept.builder import absolute_backbone_path
    from concept.errors import UnknownComponentError
    from concept.families import family as family_named

    config = load_config_file(config_file) if config_file else BuildConfig()
    if family is not None and family != config.family:
        config.family = family
        try:
            defaults = family_named(family).defaults
        except UnknownComponentError:  # a misspelt name: resolve() reports it with the rest
            defaults = {}  # (a family that fails to import or start: its one-line error, naming its package)
        for slot, name in defaults.items():
            if names.get(slot) is None:
                setattr(config, slot, ComponentRef(name))
    for slot, name in names.items():
        if name is not None and name != getattr(config, slot).name:
            setattr(config, slot, ComponentRef(name))  # another component: its options start fresh
    if split is not None:
        config.split = split
    if seed is not None:
        config.seed = seed
    if concept_input is not None:
        config.concept_input = concept_input
    config = config.apply_overrides(list(overrides), problems)
    # a local hf folder is stored absolute (edits the backbone's params in place)
    absolute_backbone_path({"backbone": {"name": config.backbone.name, "params": config.backbone.params}})
    return config


def check_output(folder: Path, config, force: bool, inputs: dict | None = None) -> None:
    """Refuse (before the slow build) an output path no command can write (a symbolic link, the working folder,
    a name too long, ...), a folder holding the command's own ``inputs`` (name -> path) even with --force, a
    folder holding anything but a run even with --force, and a run holding something else without --force;
    or an output another process is writing now."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import fs
    from concept.builder import read_run
    from concept.errors import RunFolderError

    fs.check_output_path(folder, "-o")
    fs.check_inputs(folder, inputs or {}, "-o")
    problem = fs.replace_problem(folder, True, "-o")  # a file, a link, a folder that is not a run: never
    if problem:
        raise RunFolderError(problem)
    fs.Lock(folder).probe()
    if not folder.exists() or force or not any(folder.iterdir()):
        return
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.builder import BUILT_FILES

    extra = sorted(p.name for p in folder.iterdir() if p.name not in BUILT_FILES)
    if extra:
        raise RunFolderError(f"{folder} holds more than a build ({', '.join(extra)}: e.g. a training run); choose "
                             f"another -o, or pass --force to replace it")
    old = read_run(folder)["config"]  # (a damaged concept.json: its error says to rebuild with --force)
    new = config.to_dict()
    if old != new:
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise RunFolderError(
            f"{folder} already holds a different model (differs in: {', '.join(changed)}); "
            f"choose another -o or pass --force to replace it"
        )


def print_plan(plan, output: Path | None) -> None:
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.families import structure

    d = plan.describe()
    where = f" to {output}" if output else ""
    stdout.print(f"[bold]plan[/] (dry run: nothing written{escape(where)})")
    stdout.print(f"backbone: {escape(describe_backbone(d['backbone']))}")
    for drawn in render_structure(structure(plan.family_object, plan), d["backbone"]):
        stdout.print(drawn)
    stdout.print(render_components(d["components"]))


def family_build_options(third_party: bool = True) -> list:
    """The families' own build options (``Family.build_options``, e.g. the streaming family's calibration),
    family by family (without ``third_party``, for --help: the library's own families'); two families may not
    declare the same flag."""
    # lazy: the library loads only when the command runs; --help stays instant
    from concept.families import build_options
    from concept.options import click_params

    made, owner = [], {}
    for name, cls in build_options(third_party).items():
        for param in click_params(cls):
            if param.name in owner:
                raise RuntimeError(f"families {owner[param.name]} and {name} both declare the build option "
                                   f"{param.opts[0]}; rename one of them")
            owner[param.name] = name
            made.append(param)
    return made


# BuildConfig's options (the family, the component slots, split, concept input, seed) come from its fields,
# unset (None) unless given, so that a --config file's values stay; then the families' own build options.
@click.command(cls=DeferredOptions, make_options=family_build_options, after="seed")
@click_options(BuildConfig, "family", unset=True)
@click_options(BuildConfig, *SLOTS, "split", "concept_input", "seed", "max_ratio", unset=True)
@click.option("--set", "overrides", multiple=True, metavar="SLOT.KEY=VALUE",
              help="Set a component option, e.g. --set sampler.tau=0.7 (repeatable; values parsed as JSON).")
@config_option("build", extra=build_config_keys, dir_okay=True,
               help="Start from a recipe (YAML or JSON: a build config, with the families' build options and "
                    "output beside it; its build: section if it has one), a run's concept.json or a run folder; "
                    "flags override it (docs/cli.md).")
@print_config_option()
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="DIR",
              help="Run folder to write (required unless --dry-run).")
@click.option("--force", is_flag=True, help="Replace an output run folder that holds a different model (never a "
              "folder that is not a run).")
@click.option("--dry-run", is_flag=True, help="Resolve and print the plan with provenance; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
@click.pass_context
def build(ctx, family, split, concept_input, seed, max_ratio, overrides, config_file, print_config, output, force,
          dry_run, as_json, **options) -> None:
    """Build a concept model from a backbone and components (the streaming family unless --family), and save
    it to a run folder.

    \b
    concept build --length-policy null --rope per-type -o runs/m1
    concept build --backbone tiny-llama --split 2,4,2 --set sampler.tau=0.7 -o runs/tiny --json
    concept build --dry-run --json
    concept build --config recipes/demo.yaml --force      # a recipe file; flags override it
    concept build --backbone tiny-llama --print-config     # the resolved recipe (YAML)

    A streaming build calibrates the NULL bias of a policy with one (null, threshold, mtp) on a few rows of
    text, so that the untrained model already emits about --target-ratio concepts per token (--no-calibrate:
    off).
    """
    if output is None and not dry_run and not print_config:
        raise click.UsageError("missing -o/--output DIR (or pass --dry-run to only print the plan)")
    names = {slot: options.pop(slot) for slot in SLOTS}
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import resolve
    from concept.config import parse_max_ratio
    from concept.families import build_options, structure
    from concept.options import from_params, paths

    problems = []
    config = make_config(config_file, names, split, seed, overrides, concept_input, family, problems)
    if max_ratio is not None:
        config.max_ratio = parse_max_ratio(max_ratio)
    given = {name for name in options if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    extras, mine = None, set()
    for name, cls in build_options().items():  # the chosen family's own build options; another's are refused
        fields = set(paths(cls))
        if name == config.family:
            extras, mine = from_params(cls, options), given & fields
            problems += extras.validate()
        else:
            problems += [f"--{field.replace('_', '-')}: a {name} build option; the {config.family} family does "
                         f"not read it (leave it out)" for field in sorted(given & fields)]
    plan = resolve(config, problems)  # every problem at once: --set items, the family's options, the config
    if print_config:  # the resolved recipe: the build config, the family's build options, the output folder
        own = {k: getattr(extras, k) for k in paths(type(extras))} if extras is not None else {}
        click.echo(dump({**config.to_dict(), **own, **({"output": str(output)} if output else {})}), nl=False)
        return
    if output is not None:
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from concept.builder import backbone_folder
        from concept.data import local_path

        inputs = {what: local_path(spec) for what, spec in (extras.inputs() if extras else {}).items()}
        check_output(output, config, force,
                     {**inputs, "config": config_file, "backbone": backbone_folder(config.to_dict())})

    if dry_run:
        if as_json:
            print_json(plan.describe())
        else:
            print_plan(plan, output)
        return

    # lazy: the library (torch) loads only when the command runs; --help stays instant
    import concept

    quiet_progress_bars()
    bb = plan.components["backbone"]
    status("building", f"{bb.name} backbone, {plan.family} family ({plan.backbone_info.num_layers} layers) ...")
    start = time.perf_counter()
    model = concept.build(resolution=plan)
    finished = plan.family_object.finish_build(model, extras, mine, status) if extras is not None else {}
    status("saving", f"{output} ...")
    concept.save(model, output, force=force)
    status("built", f"{output} in {time.perf_counter() - start:.1f} s")

    counts = param_counts(model)
    shown = structure(plan.family_object, plan)  # what the family says its build wires (e.g. "stacks")
    if as_json:
        print_json({"path": str(output), "family": plan.family, "plan": plan.describe(), **shown, "params": counts,
                    **finished})
        return
    stdout.print(f"[bold]built[/] {escape(str(output))} ({plan.family})")
    stdout.print(f"backbone: {escape(describe_backbone(plan.describe()['backbone']))}")
    for drawn in render_structure(shown, plan.describe()["backbone"]):
        stdout.print(drawn)
    stdout.print(render_params(counts))
