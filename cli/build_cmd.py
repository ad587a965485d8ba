"""``concept build``: resolve a config (all problems at once), then build and save a run folder."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click
from click.core import ParameterSource
from rich.markup import escape

from concept.config import DEFAULT_TARGET_RATIO, BuildConfig
from concept.options import click_options

from .output import (
    describe_backbone,
    param_counts,
    print_json,
    quiet_progress_bars,
    render_components,
    render_params,
    render_structure,
    stack_layers,
    status,
    stdout,
)


def load_config_file(path: str):
    """A saved config: a JSON file (a bare config or a run's concept.json) or a run folder."""
    from concept import BuildConfig
    from concept.builder import read_run
    from concept.errors import ConfigError

    p = Path(path)
    if p.is_dir():
        return BuildConfig.from_dict(read_run(p)["config"])
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ConfigError([f"--config {path}: cannot read it ({exc.strerror or exc})"]) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"--config {path}: not valid JSON ({exc})"]) from exc
    if isinstance(data, dict) and "format" in data and isinstance(data.get("config"), dict):
        from concept.builder import localise_backbone_path

        data = localise_backbone_path(data["config"], p.parent)  # a run folder's concept.json (an export's ./backbone)
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a JSON object, got {type(data).__name__}"])
    return BuildConfig.from_dict(data)


def make_config(config_file, names: dict, split, seed, overrides, concept_input=None, family=None, problems=None):
    """Start from the defaults (or --config) and apply the flags; --set last. ``--family NAME`` brings the
    family's own default components (e.g. the planner-executor's ``per-type`` positions) unless a flag names one."""
    from concept import BuildConfig, ComponentRef
    from concept.errors import ConceptError
    from concept.families import family as family_named

    config = load_config_file(config_file) if config_file else BuildConfig()
    if family is not None and family != config.family:
        config.family = family
        try:
            defaults = family_named(family).defaults
        except ConceptError:  # an unknown family: resolve() reports it with the rest
            defaults = {}
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
    return config.apply_overrides(list(overrides), problems)


def check_output(folder: Path, config, force: bool, inputs: dict | None = None) -> None:
    """Refuse (before the slow build) to overwrite a folder holding something else, unless --force, or one
    holding the command's own ``inputs`` (name -> path), even with --force."""
    from concept import fs
    from concept.builder import read_run
    from concept.errors import RunFolderError

    fs.check_target(folder, True, inputs or {}, flag="-o")
    if not folder.exists() or force or not any(folder.iterdir()):
        return
    from concept.builder import BUILT_FILES

    extra = sorted(p.name for p in folder.iterdir() if p.name not in BUILT_FILES)
    if extra and (folder / "concept.json").is_file():
        raise RunFolderError(f"{folder} holds more than a build ({', '.join(extra)}: e.g. a training run); choose "
                             f"another -o, or pass --force to replace it")
    try:
        old = read_run(folder)["config"]
    except RunFolderError:
        raise RunFolderError(
            f"{folder} is not empty and holds no concept run; choose another -o or pass --force to replace it"
        ) from None
    new = config.to_dict()
    if old != new:
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise RunFolderError(
            f"{folder} already holds a different model (differs in: {', '.join(changed)}); "
            f"choose another -o or pass --force to replace it"
        )


def calibrate(model, target_ratio: float, data, batches: int, given: set) -> dict | None:
    """Set the NULL bias of a fresh model for ``target_ratio`` (``concept.streaming.calibration``); status on stderr.
    A policy without such a bias is left alone; unreadable default data only skips the calibration."""
    from concept.errors import ConceptError
    from concept.streaming.calibration import (
        DEFAULT_BATCH,
        DEFAULT_SEQ_LEN,
        calibratable,
    )
    from concept.streaming.calibration import calibrate as calibrate_model

    if not calibratable(model):
        if given:
            status("note:", f"length policy {model.plan.config.length_policy.name} sets its ratio by its own "
                            f"parameters; {', '.join('--' + k.replace('_', '-') for k in sorted(given))} does nothing")
        return None
    status("calibrating", f"NULL bias for {target_ratio:g} concepts per token on {batches} x {DEFAULT_BATCH} x "
                          f"{DEFAULT_SEQ_LEN} tokens of {data or 'the Python standard library'} ...")
    try:
        result = calibrate_model(model, target_ratio, data, batches)
    except ConceptError as exc:
        if "calibration_data" in given:
            raise
        status("note:", f"not calibrated ({exc}); the NULL bias stays 0 (pass --calibration-data, or --no-calibrate)")
        return None
    status("calibrated", f"NULL bias {result['null_bias']:+.4f}: {result['ratio']:.4f} concepts per token on "
                         f"{result['tokens']:,} tokens (target {target_ratio:g})")
    if abs(result["ratio"] - target_ratio) > 0.05 * target_ratio:
        status("note:", f"the length policy cannot reach {target_ratio:g} concepts per token with these settings "
                        f"(it reached {result['ratio']:.4f})")
    return result


def print_plan(plan, output: Path | None) -> None:
    d = plan.describe()
    where = f" to {output}" if output else ""
    stdout.print(f"[bold]plan[/] (dry run: nothing written{escape(where)})")
    stdout.print(f"backbone: {escape(describe_backbone(d['backbone']))}")
    stdout.print(render_structure(plan))
    stdout.print(render_components(d["components"]))


# BuildConfig's own options (not the component slots) come from its fields; unset (None) unless given,
# so that a --config file's values stay.
@click.command()
@click_options(BuildConfig, "family", unset=True)
@click.option("--backbone", metavar="NAME", help="Backbone plugin (default: smollm2, the offline SmolLM2-135M).")
@click_options(BuildConfig, "split", unset=True)
@click.option("--length-policy", metavar="NAME", help="Length policy plugin (default: null).")
@click.option("--sampler", metavar="NAME", help="Training sampler plugin (default: gumbel-st).")
@click.option("--eval-sampler", metavar="NAME", help="Inference sampler plugin (default: argmax).")
@click.option("--rope", "--position-scheme", "position_scheme", metavar="NAME",
              help="Position scheme plugin (default: time).")
@click.option("--vocabulary", metavar="NAME", help="Concept vocabulary plugin (default: embedding).")
@click.option("--attention", metavar="NAME", help="Deep-stack attention backend (default: chunked).")
@click.option("--tail-fusion", metavar="NAME",
              help="What tail tokens take from their latest concept: none, update, bridge (default: none).")
@click_options(BuildConfig, "concept_input", "seed", unset=True)
@click.option("--target-ratio", type=float, default=DEFAULT_TARGET_RATIO, show_default=True,
              help="Concepts per token the untrained model is calibrated to: its NULL bias is set so that it "
                   "emits this many on a few rows of --calibration-data (recorded in concept.json).")
@click.option("--calibration-data", metavar="DATA", default=None,
              help="Text to calibrate on: a built-in corpus, file or folder, as `concept train --data` "
                   "(default: the Python standard library, training split).")
@click.option("--calibration-batches", type=int, default=4, show_default=True,
              help="Calibrate on this many batches of 4 rows x 128 tokens.")
@click.option("--no-calibrate", is_flag=True,
              help="Keep the NULL bias at 0 (an untrained `null` head then emits a concept at almost every token).")
@click.option("--set", "overrides", multiple=True, metavar="SLOT.KEY=VALUE",
              help="Set a component option, e.g. --set sampler.tau=0.7 (repeatable; values parsed as JSON).")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=True), metavar="FILE",
              help="Start from a saved config (JSON, a run's concept.json or a run folder); flags override it.")
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="DIR",
              help="Run folder to write (required unless --dry-run).")
@click.option("--force", is_flag=True, help="Replace an output folder that holds a different model.")
@click.option("--dry-run", is_flag=True, help="Resolve and print the plan with provenance; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON to stdout.")
@click.pass_context
def build(ctx, family, backbone, split, length_policy, sampler, eval_sampler, position_scheme, vocabulary, attention,
          tail_fusion, concept_input, seed, target_ratio, calibration_data, calibration_batches, no_calibrate,
          overrides, config_file, output, force, dry_run, as_json) -> None:
    """Build a streaming concept model from a backbone and components, and save it to a run folder.

    \b
    concept build --length-policy null --rope per-type -o runs/m1
    concept build --backbone tiny-llama --split 2,4,2 --set sampler.tau=0.7 -o runs/tiny --json
    concept build --dry-run --json

    The NULL bias of a policy with one (null, threshold, mtp) is calibrated on a few rows of text so
    that the untrained model already emits about --target-ratio concepts per token (--no-calibrate: off).
    """
    if output is None and not dry_run:
        raise click.UsageError("missing -o/--output DIR (or pass --dry-run to only print the plan)")
    names = dict(backbone=backbone, length_policy=length_policy, sampler=sampler, eval_sampler=eval_sampler,
                 position_scheme=position_scheme, vocabulary=vocabulary, attention=attention, tail_fusion=tail_fusion)
    from concept import resolve
    from concept.streaming.calibration import DEFAULT_BATCH, DEFAULT_SEQ_LEN, check

    problems = [] if no_calibrate else check(target_ratio, calibration_batches, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    config = make_config(config_file, names, split, seed, overrides, concept_input, family, problems)
    plan = resolve(config, problems)  # every problem at once: --set items, calibration options, the config
    if output is not None:
        from concept.data import local_path

        check_output(output, config, force, {"calibration data": None if no_calibrate else local_path(calibration_data),
                                             "config": config_file})

    if dry_run:
        if as_json:
            print_json(plan.describe())
        else:
            print_plan(plan, output)
        return

    import concept

    quiet_progress_bars()
    bb = plan.components["backbone"]
    stacks = plan.family_object.stacks  # a split into stacks and a concept ratio (the streaming family)
    shape = f"split {'/'.join(map(str, plan.split))}" if stacks else f"{plan.family} family"
    status("building", f"{bb.name} backbone, {shape} ({plan.backbone_info.num_layers} layers) ...")
    start = time.perf_counter()
    model = concept.build(plan=plan)
    calibration = None
    if not no_calibrate and stacks:
        given = {k for k in ("target_ratio", "calibration_data", "calibration_batches")
                 if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
        calibration = calibrate(model, target_ratio, calibration_data, calibration_batches, given)
    status("saving", f"{output} ...")
    concept.save(model, output, force=force)
    status("built", f"{output} in {time.perf_counter() - start:.1f} s")

    counts = param_counts(model)
    if as_json:
        print_json({"path": str(output), "family": plan.family, "plan": plan.describe(),
                    "stacks": stack_layers(plan.split) if stacks else None,
                    "params": counts, "calibration": calibration})
        return
    stdout.print(f"[bold]built[/] {escape(str(output))} ({plan.family})")
    stdout.print(f"backbone: {escape(describe_backbone(plan.describe()['backbone']))}")
    stdout.print(render_structure(plan))
    stdout.print(render_params(counts))
