"""``concept frontier``: train and evaluate streaming models over splits x ratios, their FLOP-matched
pruned baselines and the dense baseline; plot held-out bits/token against FLOP ratio to dense."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import click
from click.core import ParameterSource
from rich.markup import escape

from concept.config import BuildConfig
from concept.errors import ConceptError
from concept.streaming.section import StreamingSection
from concept.options import click_options

from .output import print_json, quiet_progress_bars, status, stdout, table
from .deferred import DeferredOptions
from .recipes import command_values, config_option, dump, print_config_option
from .renamed import renamed

DEFAULT_SPLITS = "4,22,4;6,18,6;8,14,8;10,10,10"
# the common training options, made from TrainConfig (`concept train`'s; any other: --train-set); not given:
# TrainConfig's default
TRAIN = ("data", "steps", "seq_len", "batch", "grad_accum", "lr", "lr_new", "warmup", "distill", "distill_temperature",
         "align", "lora_rank", "seed", "device", "align_at", "ratio_start", "ratio_warmup", "placement")


def train_options(third_party: bool = True) -> list:
    """The core's and the streaming family's (the frontier trains streaming runs and their baselines)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.options import click_params
    from concept.train_config import for_family

    return click_params(for_family("streaming"), *TRAIN, unset=True)


def command_line(ctx: click.Context) -> str:
    """``concept frontier`` with the options given on the command line (canonical spelling; the output-only
    --json / --dry-run / --force left out)."""
    words = ["concept", "frontier"]
    for param in ctx.command.params:
        if param.name in ("as_json", "dry_run", "force"):
            continue
        if ctx.get_parameter_source(param.name) != ParameterSource.COMMANDLINE:
            continue
        name = max((o for o in param.opts if o.startswith("--")), key=len, default=param.opts[0])
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            if value:
                words.append(name)
            continue
        for v in (value if param.multiple else [value]):
            words += [name, str(v)]
    return shlex.join(words)


def make_spec(opts: dict):
    """The frontier from the command's options (raises ConfigError on bad input)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import ConfigError
    from concept.options import from_params
    from concept.recipes.frontier import (
        FrontierSpec,
        domains,
        parse_ratios,
        parse_splits,
        train_overrides,
    )
    from concept.train_config import TrainConfig

    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from .build_cmd import make_config

    problems = []
    splits, p = parse_splits(opts["splits"])
    problems += p
    ratios, p = parse_ratios(opts["ratios"])
    problems += p
    doms, p = domains(list(opts["eval_data"]))
    problems += p
    values = {key: opts[key] for key in ("backbone", "length_policy", "attention", "tail_fusion", "concept_input")}
    try:
        build = make_config(opts["config_file"], values, None, opts["build_set"])
    except ConfigError as exc:
        problems += exc.problems
        build = None
    train = from_params(TrainConfig, {k: opts[k] for k in TRAIN if opts[k] is not None})
    try:
        train = train_overrides(train, list(opts["train_set"]))
    except ConfigError as exc:
        problems += exc.problems
    baselines = tuple(dict.fromkeys(b.strip() for b in opts["baselines"].split(",") if b.strip() not in ("", "none")))
    problems += [f"--baselines: {b!r} is not a baseline; choose from pruned, dense (or none)"
                 for b in baselines if b not in ("pruned", "dense")]
    tasks = tuple(n.strip() for n in (opts["tasks"] or "").split(",") if n.strip())
    if not tasks and (opts["tasks_limit"] is not None or opts["include_path"]):
        problems.append("--tasks-limit and --include-path go with --tasks")
    if tasks:
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from .tasks_eval import harness

        problems += harness().check_include_path(opts["include_path"])
    if problems:
        raise ConfigError(problems)
    if tasks:  # unknown tasks and missing task data fail now, not after the training
        harness().resolve_tasks(list(tasks), opts["include_path"])
    return FrontierSpec(build=build, splits=splits, ratios=ratios, train=train, domains=doms,
                        eval_batches=opts["eval_batches"], eval_batch=opts["eval_batch"],
                        eval_seq_len=opts["eval_seq_len"], controls=not opts["no_controls"], max_flops=opts["max_flops"],
                        baselines=baselines, tasks=tasks, tasks_limit=opts["tasks_limit"],
                        include_path=tuple(opts["include_path"]))


def render_table(result: dict, out: Path):
    """The frontier for a terminal: frontier.md's table minus the split / target (in the run's name)
    and the ΔNLL columns (in frontier.md and --json); run names never cut."""
    from rich.table import Table

    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.recipes import frontier as fr

    head, rows = fr.table_cells(result)
    keep = [i for i, h in enumerate(head) if h not in ("split", "target ratio") and not h.startswith("ΔNLL")]
    t = Table(title=f"frontier ({out}); the full table: {out / 'frontier.md'}", title_justify="left",
              title_style="bold", header_style="bold")
    for i in keep:
        t.add_column(head[i].replace("FLOP ratio", "FLOPs"), no_wrap=i == 0, overflow="fold")
    for cells in rows:
        t.add_row(*(escape(cells[i]) for i in keep))
    return t


def print_plan(planned, out: Path, spec) -> None:
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.recipes.frontier import describe_kind, run_state

    t = table("run", "kind", "split", "target ratio", "planned FLOP ratio", "starts from", "state",
              title=f"frontier plan (dry run: nothing written) -> {out}")
    for r in planned:
        s = run_state(out / r.name, r)
        state = {"complete": f"complete (step {s.get('step')}): skip", "resume": f"resume from step {s.get('step')}",
                 "restart": "restart (no checkpoint)", "new": "train", "differs": "other recipe: --force retrains",
                 "foreign": "not a run: --force replaces", "damaged": "damaged: --force retrains"}[s["status"]]
        what = r.kind + (f" ({describe_kind(r)})" if r.kind == "pruned" else "")
        t.add_row(escape(r.name), escape(what), r.split and ",".join(map(str, r.split)) or "-",
                  "-" if r.target_ratio is None else f"{r.target_ratio:g}", f"{r.planned_flop_ratio:.3f}",
                  escape(f"builds/{r.build_name}"), escape(state))
    stdout.print(t)
    builds = {r.build_name: r.build for r in planned}
    for name, cfg in builds.items():
        stdout.print(f"[bold]builds/{escape(name)}[/]: {escape(json.dumps(cfg.to_dict(), sort_keys=True))}")
    stdout.print(f"[bold]recipe[/] (every run): {escape(json.dumps(spec.train.to_dict(), sort_keys=True))}")
    stdout.print("[bold]held-out[/]: " + escape(", ".join(f"{d.label} = {d.source}" for d in spec.domains))
                 + f"; {spec.eval_batches} x {spec.eval_batch} x {spec.seq_len} tokens per domain")
    for r in planned:
        for note in r.notes:
            stdout.print(f"note: {escape(r.name)}: {escape(note)}")


@click.command(cls=DeferredOptions, make_options=train_options, after="build_set")
@click.option("--splits", default=DEFAULT_SPLITS, show_default=True, metavar="S;S;...",
              help="Streaming splits, separated by ';' (counts '4,22,4', fractions or 'auto').")
@click.option("--ratios", default="0.5,0.25", show_default=True, metavar="R,R,...",
              help="Target ratios (concepts per token, each in (0, 1)); every split is trained at each.")
@click.option("--baselines", default="pruned,dense", show_default=True, metavar="LIST",
              help="Baselines trained alongside: pruned (FLOP-matched to each streaming point), dense; or none.")
@click.option("--backbone", metavar="NAME", help="Backbone plugin of the streaming builds (default: smollm2).")
@config_option("frontier", bare=False, dir_okay=True,
               help="A recipe (YAML or JSON) with a frontier: section (these options) and a build: section (the "
                    "config the builds start from); or a bare build config, a run's concept.json or a run folder. "
                    "Flags override it (docs/cli.md).")
@print_config_option()
@click.option("--length-policy", metavar="NAME", help="Length policy plugin of the builds.")
@click.option("--attention", metavar="NAME", help="Deep-stack attention backend of the builds.")
@click.option("--tail-fusion", metavar="NAME", help="Tail fusion of the builds: none, update, bridge.")
@click_options(StreamingSection, "concept_input", unset=True)
@click.option("--build-set", multiple=True, metavar="SLOT.KEY=VALUE",
              help="A build option, as `concept build --set` (repeatable), e.g. --build-set length_policy.max_run=16.")
@click.option("--train-set", multiple=True, metavar="KEY=VALUE",
              help="Any other `concept train` option, by TrainConfig field name (repeatable), e.g. "
                   "--train-set ratio_control=pi --train-set lora.alpha=32.")
@click.option("--eval-data", multiple=True, default=("stdlib", "pydoc"), show_default=True, metavar="[LABEL=]SOURCE",
              help="Held-out domain (repeatable): a built-in corpus (its held-out split; stdlib = code, pydoc = "
                   "prose) or a file / folder (read whole).")
@click.option("--eval-batches", type=int, default=8, show_default=True)
@click.option("--eval-batch", type=int, default=4, show_default=True)
@click.option("--eval-seq-len", type=int, default=None, help="Default: the training --seq-len.")
@click.option("--no-controls", is_flag=True, help="Skip the ΔNLL shuffled / random concept passes.")
@click.option("--tasks", metavar="NAMES", default=None,
              help="Also evaluate every run on these lm-eval tasks (comma-separated, e.g. concept_offline; needs the "
                   "`eval` extra): accuracy columns and OUT/frontier-tasks.png.")
@click.option("--tasks-limit", type=click.IntRange(min=1), default=None, help="With --tasks: at most this many examples per task.")
@click.option("--include-path", multiple=True, metavar="DIR", help="With --tasks: a folder of your own task YAMLs.")
@click.option("--max-flops", type=float, default=0.6, show_default=True,
              help="Name the best streaming point at or below this FLOP ratio to dense.")
@renamed("-o", "--output", "out", old=("--out",), type=click.Path(path_type=Path), default=Path("runs/frontier"), show_default=True,
              help="Folder of the runs (one subfolder each) and of frontier.json / .md / .png.")
@click.option("--update-doc", type=click.Path(path_type=Path), metavar="FILE", hidden=True,
              help="Removed: the library rewrites no documents (benchmarks/frontier_doc.py does).")
@click.option("--force", is_flag=True, help="Retrain runs in --output that were trained with another recipe.")
@click.option("--dry-run", is_flag=True, help="Print the planned runs and their FLOP ratios; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the frontier (or the plan) as JSON on stdout.")
@click.pass_context
def frontier(ctx, out: Path, update_doc, force, dry_run, as_json, print_config, **opts) -> None:
    """Train and evaluate the quality / compute frontier: streaming models over --splits x --ratios,
    a FLOP-matched pruned baseline for each, and the dense baseline, all with the same recipe.

    Writes OUT/frontier.png (held-out bits/token against FLOP ratio to dense, one panel per
    domain), OUT/frontier.json and OUT/frontier.md, and names the best streaming point at
    <= --max-flops. A rerun skips complete runs and resumes interrupted ones. The training options
    are `concept train`'s, with its defaults (any other: --train-set); a baseline trains without
    the ones it has no use for (--placement, --align at deep-input).

    \b
    concept frontier --steps 30 --seq-len 128 --batch 4 --lr 1e-3 --lr-new 3e-3 -o runs/frontier
    concept frontier --splits "6,18,6;10,10,10" --ratios 0.25 --distill 1 --ratio-warmup 0.3 --dry-run
    python -m benchmarks.frontier_doc runs/frontier docs/results.md   # (a checkout) the table into a doc
    concept frontier --config recipes/frontier.yaml --dry-run     # a recipe file; flags override it
    """
    if update_doc is not None:  # refused before anything runs, so nothing is trained for nothing
        raise ConceptError(f"--update-doc was removed: the library rewrites no documents; run the frontier, then "
                           f"`python -m benchmarks.frontier_doc {out} {update_doc}` from a checkout of the repository")
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.recipes import frontier as fr

    quiet_progress_bars()
    spec = make_spec(opts)
    if print_config:  # the resolved recipe: these options, and the build config the builds start from
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from .build_cmd import load_config_file

        base = load_config_file(opts["config_file"]) if opts["config_file"] is not None else BuildConfig()
        values = {**ctx.params, "out": out}
        click.echo(dump({"frontier": command_values(ctx, values), "build": base.to_dict()}), nl=False)
        return
    status("planning", f"{len(spec.splits)} split(s) x {len(spec.ratios)} ratio(s), baselines: "
                       f"{', '.join(spec.baselines) or 'none'} ...")
    planned = fr.schedule(spec, out, force=force)
    if dry_run:
        if as_json:
            states = {r.name: fr.run_state(out / r.name, r) for r in planned}
            print_json({"out": str(out), "runs": [{**r.describe(), "state": states[r.name], "build_config": r.build.to_dict()}
                                                  for r in planned],
                        "recipe": spec.train.to_dict(), "domains": [d.__dict__ for d in spec.domains]})
        else:
            print_plan(planned, out, spec)
        return
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from .train_cmd import run_with_progress

    try:
        result = fr.run(spec, planned, out, force=force, train=run_with_progress, log=status)
    except KeyboardInterrupt:
        status("interrupted", f"checkpoints are saved; rerun the same command to continue ({out})")
        raise SystemExit(130)
    result["command"] = command_line(ctx)
    paths = fr.write(result, out)
    result["files"] = {k: str(v) for k, v in paths.items()}
    status("done", ", ".join(str(p) for p in paths.values()))
    if as_json:
        print_json(result)
        return
    stdout.print(render_table(result, out))
    stdout.print(escape(fr.best_line(result).replace("**", "")))


def _declared(ctx) -> type:
    # lazy: the library loads only when the command runs; --help stays instant
    from concept.train_config import composed
    from .deferred import HELPING

    return composed(not ctx.meta.get(HELPING, False))


frontier.recipe_declared = _declared  # (a recipe's sections, e.g. lora:: cli.recipes.nested_groups)
