"""``concept build``: resolve a config (all problems at once), then build and save a run folder."""
from __future__ import annotations

import time
from pathlib import Path

import click
from click.core import ParameterSource
from rich.markup import escape

from concept.config import BuildConfig
from concept.errors import ConfigError
from concept.options import click_options

from .deferred import CHOSEN, DeferredOptions
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
    """A saved build config: a run folder, a run's concept.json or a recipe file (YAML or JSON: a bare build
    config or its ``build:`` section), whose keys that are options rather than the config (e.g. the families'
    build options, ``output``) --config took as defaults already (``cli.recipes.config_option``). A recipe
    written flat (the streaming family's keys beside ``family``, as before format 3) is read as sectioned."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import BuildConfig
    from concept.builder import read_run
    from concept.migrate import sectioned

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
    return BuildConfig.from_dict(sectioned({k: v for k, v in section(data, "build", path).items() if k in keys}))


def build_config_keys(ctx=None) -> list[str]:
    """The keys of a build config (``BuildConfig.to_dict``): its own and the families' sections; and the keys of a
    recipe written flat (``concept.migrate.FLAT_KEYS``), which it reads into their section."""
    # lazy: kept beside its one use (concept.config is imported above already: no torch)
    from concept.config import CORE_KEYS, family_sections
    from concept.migrate import FLAT_KEYS

    return [*CORE_KEYS, *family_sections(), *FLAT_KEYS]


def make_config(config_file, values: dict, seed=None, overrides=(), family=None, problems=None):
    """Start from the defaults (or --config) and apply the flags; --set last. ``values``: the backbone's and the
    family build section's flags (name -> value; None: not given). ``--family NAME`` brings the family's own
    default components (e.g. the planner-executor's ``per-type`` positions) unless a flag names one; a family
    that reads no such section refuses its flags."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import BuildConfig, ComponentRef
    from concept.builder import absolute_backbone_path
    from concept.config import build_section_of
    from concept.streaming.operating_point import parse_max_ratio
    from concept.errors import UnknownComponentError
    from concept.families import family as family_named

    config = load_config_file(config_file) if config_file else BuildConfig()
    given = {k: v for k, v in values.items() if v is not None}
    if family is not None and family != config.family:
        kept = {n: s for n, s in config.sections.items() if isinstance(s, dict)}  # (resolve refuses another's)
        own = build_section_of(family)
        if own is not None and type(config.section) is own:  # (a section both families read)
            kept[own.name] = config.section
        config = BuildConfig(family=family, backbone=config.backbone, seed=config.seed, sections=kept)
        try:
            defaults = family_named(family).defaults
        except UnknownComponentError:  # a misspelt name: resolve() reports it with the rest
            defaults = {}  # (a family that fails to import or start: its one-line error, naming its package)
        for slot, name in defaults.items():
            if given.get(slot) is None and config.section is not None:
                setattr(config.section, slot, ComponentRef(name))
    backbone = given.pop("backbone", None)
    if backbone is not None and backbone != config.backbone.name:
        config.backbone = ComponentRef(backbone)  # another component: its options start fresh
    section = config.section
    if section is None and given:  # (reported with resolve()'s problems)
        unread = [f"--{key.replace('_', '-')}: the {config.family} family does not read it (it has no build section "
                  f"of components); drop it" for key in given]
        if problems is None:
            raise ConfigError(unread)
        problems.extend(unread)
        given = {}
    slots = section.slots() if section is not None else {}
    for key, value in given.items():
        if key in slots:
            if value != getattr(section, key).name:
                setattr(section, key, ComponentRef(value))  # another component: its options start fresh
        else:
            setattr(section, key, parse_max_ratio(value) if key == "max_ratio" else value)
    if seed is not None:
        config.seed = seed
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
        changed = differing_keys(old, new)
        raise RunFolderError(
            f"{folder} already holds a different model (differs in: {', '.join(changed)}); "
            f"choose another -o or pass --force to replace it"
        )


def differing_keys(old: dict, new: dict) -> list[str]:
    """The keys of two build configs whose values differ; inside a family's section, its own keys
    (``streaming.sampler``)."""
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and key not in ("backbone",):
            found += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        else:
            found.append(key)
    return found


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


def built_families(words: list[str], helping: bool) -> bool | str:
    """Which families' build options a ``concept build`` command line has (:func:`family_build_options`): with
    --family NAME (default: the streaming family), the library's own and NAME's, so that a build imports no
    other third-party family; with --config, every family's (its recipe may name any); with --help, the
    library's own."""
    if helping:
        return False
    named = [w.split("=", 1)[1] if "=" in w else words[i + 1] for i, w in enumerate(words)
             if w.split("=", 1)[0] == "--family" and ("=" in w or i + 1 < len(words))]
    if named:
        return named[-1]
    if any(w.split("=", 1)[0] == "--config" for w in words):
        return True
    # lazy: concept.config is imported by this module already (no torch)
    from concept.config import BuildConfig

    return BuildConfig.__dataclass_fields__["family"].default


def family_keys(key: bool | str) -> tuple[bool, str | None]:
    """(third_party, also) of ``concept.families.build_options`` for a :func:`built_families` key."""
    return (False, key) if isinstance(key, str) else (key, None)


def family_build_options(key: bool | str = True) -> list:
    """The families' own build options, family by family (``key``: :func:`built_families`; False, for --help:
    the library's own families'): their build sections' (``Family.build_section``: the streaming family's components, split, ...;
    unset unless given, so that a --config file's values stay) and the flags only they read
    (``Family.build_options``, e.g. the streaming family's calibration); two families may not declare the same
    flag."""
    # lazy: the library loads only when the command runs; --help stays instant
    from concept.families import build_options, build_sections
    from concept.options import click_params

    made, owner = [], {}
    sections = {cls: name for name, cls in reversed(build_sections(*family_keys(key)).items())}  # (one read by two: once)
    declared = [(name, cls, True) for cls, name in reversed(sections.items())]
    declared += [(name, cls, False) for name, cls in build_options(*family_keys(key)).items()]
    for name, cls, unset in declared:
        for param in click_params(cls, unset=unset):
            if param.name in owner:
                raise RuntimeError(f"families {owner[param.name]} and {name} both declare the build option "
                                   f"{param.opts[0]}; rename one of them")
            owner[param.name] = name
            made.append(param)
    return made


# BuildConfig's own options (the family, the backbone, the seed) come from its fields, unset (None) unless given,
# so that a --config file's values stay; then the families' build sections' and build options.
@click.command(cls=DeferredOptions, make_options=family_build_options, after="seed", choose=built_families)
@click_options(BuildConfig, "family", "backbone", "seed", unset=True)
@click.option("--set", "overrides", multiple=True, metavar="SLOT.KEY=VALUE",
              help="Set a component option, e.g. --set sampler.tau=0.7 (repeatable; values parsed as JSON).")
@config_option("build", extra=build_config_keys, dir_okay=True,
               help="Start from a recipe (YAML or JSON: a build config, with the families' build options and "
                    "output beside it; its build: section if it has one), a run's concept.json or a run folder; "
                    "flags override it (docs/cli.md).")
@print_config_option()
@click.argument("run_dir", required=False, type=click.Path(path_type=Path), metavar="[RUN_DIR]")
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="DIR",
              help="Run folder to write (required unless --dry-run; or give it as RUN_DIR).")
@click.option("--force", is_flag=True, help="Replace an output run folder that holds a different model (never a "
              "folder that is not a run).")
@click.option("--dry-run", is_flag=True, help="Resolve and print the plan with provenance; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
@click.pass_context
def build(ctx, family, backbone, seed, overrides, config_file, print_config, run_dir, output, force, dry_run, as_json,
          **options) -> None:
    """Build a concept model from a backbone and components (the streaming family unless --family), and save
    it to a run folder.

    \b
    concept build runs/m1                                  # the defaults (RUN_DIR, or -o runs/m1)
    concept build --length-policy null --rope per-type -o runs/m1
    concept build --backbone tiny-llama --split 2,4,2 --set sampler.tau=0.7 -o runs/tiny --json
    concept build --dry-run --json
    concept build --config recipes/demo.yaml --force      # a recipe file; flags override it
    concept build --backbone tiny-llama --print-config     # the resolved recipe (YAML)

    A streaming build calibrates the NULL bias of a policy with one (null, threshold, mtp) on a few rows of
    text, so that the untrained model already emits about --target-ratio concepts per token (--no-calibrate:
    off).
    """
    if run_dir is not None:  # (the run folder as the other commands take it: ``concept build runs/m1``)
        if ctx.get_parameter_source("output") == ParameterSource.COMMANDLINE \
                and output.resolve() != run_dir.resolve():
            raise click.UsageError(f"the run folder is given twice, as RUN_DIR {run_dir} and as -o {output}; "
                                   f"give it once")
        output = run_dir
    if output is None and not dry_run and not print_config:
        raise click.UsageError("missing the run folder: concept build RUN_DIR, or -o/--output DIR (or pass "
                               "--dry-run to only print the plan)")
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept import resolve
    from concept.families import build_options, build_sections, structure
    from concept.options import from_params, paths

    chosen = family_keys(ctx.meta[CHOSEN])  # (the families whose options this command line has)
    values = {"backbone": backbone}
    for cls in dict.fromkeys(build_sections(*chosen).values()):  # the build sections' flags (a section's name once)
        values.update({name: options.pop(name) for name in paths(cls) if name in options})
    problems = []
    config = make_config(config_file, values, seed, overrides, family, problems)
    given = {name for name in options if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    extras, mine = None, set()
    for name, cls in build_options(*chosen).items():  # the chosen family's own build options; another's are refused
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
