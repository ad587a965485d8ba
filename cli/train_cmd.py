"""``concept train``: LoRA + new modules on text, with ratio control, checkpoints and exact resume."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from click.core import ParameterSource

from .deferred import CHOSEN, HELPING, DeferredOptions
from .output import print_json, quiet_progress_bars, quiet_rank, status, stdout, table
from .recipes import config_option, dump, print_config_option
from .renamed import renamed


def train_options(key: bool | str = True) -> list:
    """Every field of the training config of ``key`` as an option (``--lora-*`` for ``config.lora``), in
    declaration order: :func:`declared_for`."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.options import click_params

    return click_params(declared_for(key))


def declared_for(key: bool | str) -> type:
    """The training config class of ``key``: a family's name (``concept train RUN``: the core's options and
    that family's only), True (every installed family's) or False (the library's own families', --help)."""
    # lazy: the library loads only when the command runs; --help stays instant
    from concept.train_config import composed, for_family

    return for_family(key) if isinstance(key, str) else composed(key)


PATH_OPTIONS = ("-o", "--output", "--out", "--config", "--data", "--eval-data")  # their values are not RUN_DIR


def chosen_family(words: list[str], helping: bool) -> bool | str:
    """Which options a ``concept train`` command line has (:func:`declared_for`): the family of its run (the
    first word that names a run folder and is no option's path, else its --config recipe's ``run_dir``), read
    from the run's concept.json without importing any family; without one, every family's (with --help: the
    library's own)."""
    # lazy: the library loads only when the command runs; --help stays instant
    from concept.families import of_run

    run = named_run(words)
    name = of_run(run) if run is not None else None
    return name if name is not None else not helping


def named_run(words: list[str]) -> Path | None:
    for i, word in enumerate(words):
        if not word.startswith("-") and not (i and words[i - 1] in PATH_OPTIONS) and (Path(word) / "concept.json").is_file():
            return Path(word)
    recipe = next((w.split("=", 1)[1] if "=" in w else words[i + 1] for i, w in enumerate(words)
                   if w.split("=", 1)[0] == "--config" and ("=" in w or i + 1 < len(words))), None)
    if recipe is None or Path(recipe).is_dir():
        return None
    # lazy: a recipe file's reader, only for --config
    from .recipes import read_recipe, section

    try:
        run = section(read_recipe(recipe), "train", recipe).get("run_dir")
    except Exception:  # (a recipe that does not read: its --config callback reports it)  # noqa: BLE001
        return None
    return Path(run) if isinstance(run, str) and (Path(run) / "concept.json").is_file() else None


def foreign_flag(flag: str, key: bool | str) -> str | None:
    """Why ``flag``, which a run of the family ``key`` does not have, is refused: another of the library's
    families reads it (None: no family's; click says it has no such option)."""
    if not isinstance(key, str):
        return None
    # lazy: the library loads only when the command runs
    from concept.train_config import composed

    owners = composed(third_party=False).option_owners.get(flag.lstrip("-").replace("-", "_"))
    if not owners or key in owners:
        return None
    return (f"{flag}: only for {' or '.join(owners)} runs (`concept build --family {owners[0]}`); the run is a {key} "
            f"run, which does not read it")


@click.command(cls=DeferredOptions, make_options=train_options, after="force", choose=chosen_family,
               refuse=foreign_flag)
@click.argument("source", metavar="RUN_DIR", type=click.Path(path_type=Path))
@renamed("-o", "--output", "out", old=("--out",), type=click.Path(path_type=Path), metavar="DIR", help="Run folder to write (default: RUN_DIR-train, or "
              "RUN_DIR-dense / RUN_DIR-pruned with --baseline).")
@click.option("--resume", is_flag=True, help="Continue the training run in RUN_DIR exactly where it stopped "
              "(a larger --steps stretches the LR and temperature schedules from there on; --data continues on "
              "other data).")
@click.option("--force", is_flag=True, help="Replace an existing run folder at --output (never a folder that is not a "
              "run), once the new run has trained every step (until then, and after a failure or Ctrl-C, the old "
              "folder stays as it was).")
@click.option("--accept-data-change", is_flag=True, help="With --resume: continue on data whose documents changed "
              "since the checkpoint, as a note instead of a warning (the run then no longer reproduces an "
              "uninterrupted one).")
@click.option("--distributed", type=click.Choice(["auto", "ddp", "fsdp2", "none"]), default="auto", show_default=True,
              help="Under torchrun: ddp (auto's choice; gloo on CPU, nccl on GPU) or fsdp2 (parameters sharded). "
              "--batch is per process: the global batch is batch x processes x grad-accum. See docs/distributed.md.")
@click.option("--json", "as_json", is_flag=True, help="Print the final evaluation as JSON.")
@config_option("train", help="A recipe (YAML or JSON; its train: section if it has one): its values are the "
                             "defaults, flags override them (docs/cli.md).")
@print_config_option()
@click.pass_context
def train(ctx, source: Path, out, resume, force, accept_data_change, as_json, distributed, config_file, print_config,
          **options) -> None:
    """Train a built model (or the dense baseline) on text.

    \b
    concept train runs/m1 --steps 300 --seq-len 256 --batch 8 --target-ratio 0.125 -o runs/m1-train
    concept train runs/m1-train --resume --steps 600
    concept train runs/m1 --baseline -o runs/dense
    concept train runs/m1 --baseline pruned --distill 1 -o runs/pruned
    concept train runs/m1 --distill 1 --ratio-warmup 0.3 -o runs/m1-kd
    concept train runs/pe --task continue --context-len 192 -o runs/pe-cont
    concept train --config recipes/demo.yaml --force         # a recipe file; flags override it
    concept train runs/m1 --steps 50 --print-config > r.yaml   # the resolved recipe
    """
    if print_config:
        return print_recipe(ctx, source, out, options)
    if config_file is not None and resume:
        raise click.UsageError("--resume continues with the run's recorded options; drop --config (flags given "
                               "with --resume still change them)")
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.distributed import setup, teardown

    dist = setup(distributed, options["device"])
    if not dist.is_main:  # one voice: rank 0 reports, the other ranks only fail loudly
        quiet_rank()
    try:
        _train(ctx, source, out, resume, force, accept_data_change, as_json, dist, options)
    finally:
        teardown(dist)


def _train(ctx, source: Path, out, resume, force, accept_data_change, as_json, dist, options) -> None:
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.options import from_params, paths
    from concept.training import Trainer

    TrainConfig = declared_for(ctx.meta[CHOSEN])  # the core's options and the run's family's  # noqa: N806
    quiet_progress_bars()
    given = {k for k in options if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if resume and out is not None and Path(out).resolve() != source.resolve():
        raise click.UsageError("--resume continues RUN_DIR in place; drop --output (or start a new run without --resume)")
    if accept_data_change and not resume:
        raise click.UsageError("--accept-data-change is for --resume (a new run records the data it starts with)")
    if resume:
        fields = paths(TrainConfig)  # e.g. lora_rank -> lora.rank
        overrides = {fields[k]: options[k] for k in given if k in fields}
        if "baseline" in overrides and overrides["baseline"] is None:
            overrides.pop("baseline")
        Trainer.resumed_config(source, dist.world_size, overrides)  # a conflict is an error even with nothing to train
        done = already_done(source, overrides.get("steps"))
        if done is not None:  # nothing to train: say so and leave the run folder untouched
            step, steps = done
            more = step + max(10, step // 2)
            asked = (f"--steps {steps} is not beyond it" if "steps" in overrides
                     else f"the end of its --steps {steps}")
            message = (f"{source} is already at step {step} ({asked}); nothing to train. To train further, "
                       f"pass a larger --steps, e.g. `concept train {source} --resume --steps {more}`")
            status("nothing to do:", message)
            if as_json:
                print_json({"path": str(source), "step": step, "steps": steps, "trained": False, "message": message})
            return
        status("resuming", f"{source} ...")
        trainer = Trainer.resume(source, dist=dist, accept_data_change=accept_data_change, **overrides)
        out = source
    else:
        config = from_params(TrainConfig, options)
        named = source if source.name not in ("", ".", "..") else source.resolve()  # (`concept train .`)
        out = out or named.with_name(named.name + (f"-{config.baseline}" if config.baseline else "-train"))
        status("preparing", f"{f'{config.baseline} baseline' if config.baseline else 'concept model'} from {source} -> {out} ...")
        trainer = Trainer.start(source, out, config, force=force, dist=dist)
    cfg = trainer.config
    for note in trainer.notes:
        status("note:", note)
    noted = len(trainer.notes)
    status("training", f"{training_line(cfg, trainer.step, trainer.global_batch, trainer.train_data.num_tokens)}, "
                       f"device {trainer.device}"
                       f"{f', attention auto -> {trainer.attention}' if trainer.attention else ''}"
                       f"{f', {dist.describe()}, global batch {trainer.global_batch}' if dist.active else ''}")
    replacing = trainer.run.staging is not None
    try:
        final = run_with_progress(trainer) if dist.is_main else trainer.train()
    except KeyboardInterrupt:
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from concept.checkpoint import read_meta

        if replacing:
            status("interrupted", f"at step {trainer.step}; {out} is unchanged (--force replaces it only once "
                                  f"training finishes) and the new run was discarded")
            raise SystemExit(130)
        meta = read_meta(out)
        saved = f"last checkpoint: step {meta['step']}" if meta else "no checkpoint was written"
        status("interrupted", f"at step {trainer.step}; {saved}. Continue with: concept train {out} --resume")
        raise SystemExit(130)
    for note in trainer.notes[noted:]:  # e.g. a ratio target the policy could not reach
        status("note:", note)
    status("done", f"{out} (metrics.jsonl, curves.png, checkpoint/)")
    if as_json:
        print_json({"path": str(out), "step": trainer.step, "eval": final})
    elif not final:
        status("note:", f"no held-out evaluation; run `concept eval {out} --data HELD_OUT`")
    else:
        t = table("held-out", "value", title=f"{out} at step {trainer.step}")
        for k, v in final.items():
            if not isinstance(v, dict):
                t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
        stdout.print(t)


def print_recipe(ctx, source: Path, out, options: dict) -> None:
    """--print-config: the resolved training options (train.json's format: ``lora:`` a section) with the run
    folders, as YAML on stdout; checked first (all problems at once)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import ConfigError
    from concept.options import from_params

    config = from_params(declared_for(ctx.meta[CHOSEN]), options)
    problems = config.validate()
    if problems:
        raise ConfigError(problems)
    folders = {"run_dir": str(source), **({"output": str(out)} if out is not None else {})}
    click.echo(dump({**folders, **{k: v for k, v in config.to_dict().items() if v is not None}}), nl=False)


def training_line(cfg, step: int, global_batch: int, corpus_tokens: int) -> str:
    """What this run will train on: the steps, the tokens per step, the tokens the remaining steps read (rows of
    --curriculum's length step by step) and, apart, the size of the training corpus they are drawn from."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.train_config import curriculum_len

    accum = f"x{cfg.grad_accum}" if cfg.grad_accum > 1 else ""
    trained = global_batch * sum(curriculum_len(cfg, s) for s in range(step, cfg.steps))
    return (f"steps {step}->{cfg.steps}, {cfg.batch}{accum}x{cfg.seq_len} tokens/step, {trained:,} tokens to train on "
            f"(from a corpus of {corpus_tokens:,} tokens)")


def already_done(run: Path, steps: int | None) -> tuple[int, int] | None:
    """(step reached, steps asked for) when ``--resume`` has nothing to train: the last checkpoint is
    at or beyond ``steps`` (default: the saved run's). Reads only; anything else (no train.json, no
    checkpoint, an invalid --steps) is left to ``Trainer.resume`` and its errors."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.builder import read_train
    from concept.checkpoint import read_meta

    saved = read_train(run) if run.is_dir() else None
    meta = read_meta(run) if saved is not None else None
    if meta is None:
        return None
    steps = saved.get("steps") if steps is None else steps
    if not isinstance(steps, int) or steps < 1 or steps > meta["step"]:
        return None
    return meta["step"], steps


# the loss terms and statistics a step's progress shows when its row has them: (key, label, format)
STEP_TERMS = (("distill_kl", "kd", ".3f"), ("align", "align", ".3f"), ("mtp", "mtp", ".3f"),
              ("placement", "place", ".3f"), ("plan_len", "plan", ".1f"))


def progress_info(row: dict, cfg) -> str:
    """The metrics of one step's row, as the progress bar and the plain progress lines show them."""
    info = f"loss {row['loss']:.3f}"
    for key, label, spec in STEP_TERMS:
        if key in row:
            info += f"  {label} {row[key]:{spec}}"
    if "ratio" in row:
        info += f"  ratio {row['ratio']:.3f}"
        if row.get("target_ratio") is not None and row["target_ratio"] != getattr(cfg, "target_ratio", None):
            info += f" (target {row['target_ratio']:.3f})"
        if row.get("capped"):  # boundaries the static budget dropped (concept build --max-ratio)
            info += f" capped {row['capped']:.3f}"
    info += f"  {row['tokens_per_s']:.0f} tok/s"
    if row.get("eval"):
        info += f"  held-out {row['eval']['nll']:.3f}"
    return info


def run_with_progress(trainer) -> dict:
    """Train with a rich progress bar on stderr (step, loss, ratio, tokens/s, ETA); on a stderr that is not a
    terminal, one plain line every --log-every steps and at the last step instead."""
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return run_with_lines(trainer)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    cfg = trainer.config
    columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task("train", total=cfg.steps, completed=trainer.step, info="")

        def update(row: dict) -> None:
            progress.update(task, completed=row["step"], info=progress_info(row, cfg))

        return trainer.train(progress=update)


def run_with_lines(trainer) -> dict:
    """Train, printing ``train step S/N  loss ...  tok/s  elapsed, ETA`` every --log-every steps (and at the
    last one) on stderr: a log file or batch job's output shows the run as it goes."""
    cfg, start, first = trainer.config, time.monotonic(), trainer.step

    def line(row: dict) -> None:
        step = row["step"]
        if step % cfg.log_every and step != cfg.steps:
            return
        elapsed = time.monotonic() - start
        eta = elapsed / max(1, step - first) * (cfg.steps - step)
        click.echo(f"train step {step}/{cfg.steps}  {progress_info(row, cfg)}  {elapsed:.0f} s, ETA {eta:.0f} s",
                   err=True)

    return trainer.train(progress=line)


def _declared(ctx) -> type:
    return declared_for(ctx.meta.get(CHOSEN, not ctx.meta.get(HELPING, False)))


train.recipe_declared = _declared  # (a recipe's sections: cli.recipes.nested_groups)
