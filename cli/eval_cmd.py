"""``concept eval``: held-out NLL, realised ratio, concept usage and ΔNLL controls; or a comparison."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
import contextlib
from pathlib import Path

import click
from rich.markup import escape

from concept.config import COMPILE_CHOICES, COMPILE_HELP, DEFAULT_COMPILE, DEFAULT_INFERENCE_DTYPE

from .load_options import dtype_option, merge_lora_option
from .help_groups import GroupedHelp
from .output import html_report, print_concepts, print_json, quiet_progress_bars, status, stdout, table
from .recipes import command_values, config_option, dump, print_config_option
from .renamed import renamed

# (key, label, format) rows of the table, in order
ROWS = [("model", "model", "{}"), ("dtype", "dtype", "{}"), ("lora_merged", "LoRA layers merged into the base", "{}"),
        ("bits_per_token", "bits / token", "{:.4f}"),
        ("nll", "NLL (nats / token)", "{:.4f}"),
        ("perplexity", "perplexity", "{:.2f}"), ("ratio", "concepts / token", "{:.4f}"),
        ("nll_nothing", "NLL(y | empty plan): the floor", "{:.4f}"),
        ("nll_dense_given_u", "NLL(y | u), frozen backbone", "{:.4f}"), ("nll_dense", "NLL(y), frozen backbone", "{:.4f}"),
        ("plan_len", "plan length (concepts / example)", "{:.2f}"), ("plan_per_token", "plan length / |u|", "{:.4f}"),
        ("delta_nll_shuffle", "ΔNLL concepts shuffled", "{:+.4f}"), ("delta_nll_random", "ΔNLL random concepts", "{:+.4f}"),
        ("delta_nll_codes_shuffled", "ΔNLL codes shuffled (own state kept)", "{:+.4f}"),
        ("delta_nll_codes_zero", "ΔNLL codes removed (own state kept)", "{:+.4f}"),
        ("gate_norm", "identity start: gate RMS", "{:.4f}"),
        ("delta_nll_mask", "ΔNLL plan masked", "{:+.4f}"), ("delta_nll_dropout", "ΔNLL half the concepts dropped", "{:+.4f}"),
        ("nll_zstar", "NLL(y | z*), best of the E-step's beam", "{:.4f}"),
        ("estep_margin", "E-step margin S(z1) − S(z2) (nats)", "{:.3f}"),
        ("nll_concepts", "NLL at concept positions", "{:.4f}"),
        ("nll_concepts_keep_all", "  … every token a concept", "{:.4f}"),
        ("nll_concepts_skip_middle", "  … no concept (middle skipped)", "{:.4f}"),
        ("nll_tails", "NLL at tail positions", "{:.4f}"),
        ("nll_tails_keep_all", "  … every token a concept", "{:.4f}"),
        ("nll_tails_skip_middle", "  … no concept (middle skipped)", "{:.4f}"),
        ("usage_perplexity", "concept usage perplexity", "{:.1f}"), ("usage_fraction", "concept ids used / K", "{:.4f}"),
        ("head_entropy", "head entropy (nats)", "{:.3f}"), ("max_prob", "head mean max-prob", "{:.3f}"),
        ("cos_soft_hard", "cos(e_soft, e_hard)", "{:.3f}"), ("mtp_tau", "MTP confidence threshold τ", "{:.3f}"),
        ("mtp_accuracy", "MTP heads top-1 accuracy (t+1, t+2, ...)", "{}"), ("tokens", "tokens evaluated", "{:,}"),
        ("train_steps", "training steps", "{:,}"), ("train_tokens_per_s", "training tokens/s (median)", "{:.0f}"),
        ("train_speed_vs_dense", "training speed vs dense", "{:.2f}x")]


PER_TYPE = {"plan_len": "plan length", "entropy": "planner entropy (nats)", "max_prob": "planner mean max-prob",
            "usage_perplexity": "concept usage perplexity", "delta_nll_shuffle": "ΔNLL this type's block shuffled"}


def speed_vs_dense(results: dict) -> None:
    """With a dense baseline among the compared runs, add each run's training tokens/s relative to it
    (the runs were trained one after another, so this ratio carries the machine's noise)."""
    dense = [r["train_tokens_per_s"] for r in results.values() if r.get("model") == "dense" and r.get("train_tokens_per_s")]
    if not dense:
        return
    for r in results.values():
        if r.get("train_tokens_per_s"):
            r["train_speed_vs_dense"] = r["train_tokens_per_s"] / dense[0]


def run_label(run: Path, loaded_kind: str) -> str:
    """The kind a run was trained as (train.json: a pruned baseline stays ``pruned`` even when its FLOP-matched
    block is empty and it runs every layer), else what the loaded model says it is."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.builder import read_run, read_train, run_kind

    if not Path(run).is_dir():  # (a hub id)
        return loaded_kind
    return run_kind(read_run(run), read_train(run))


def training_throughput(run: Path) -> dict:
    """Steps and median training tokens/s from a trained run's metrics.jsonl (empty if untrained)."""
    import statistics

    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.run_files import read_metrics

    rows = read_metrics(run)  # validated: one error line naming a damaged line
    speeds = [r["tokens_per_s"] for r in rows[1:] if isinstance(r.get("tokens_per_s"), (int, float))]  # step 1: warm-up
    if not speeds:
        return {}
    return {"train_steps": rows[-1]["step"], "train_tokens_per_s": statistics.median(speeds)}


def evaluate_run(path: Path, data, seq_len, batches, batch, controls, encoding_errors, text_field, device, model=None,
                 log_every: int = 1, data_split: str | None = None, streaming: bool | None = None,
                 dtype: str = DEFAULT_INFERENCE_DTYPE, merge_lora: bool = False):
    """Evaluate the run at ``path`` (see :func:`concept.diagnostics.evaluate_folder`), with a status line and the
    batches' progress: a bar on a terminal, else a plain line every ``log_every`` batches (and at the last)."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.diagnostics import heldout_source

    source, split, seq_len_, _, _ = heldout_source(path, data, seq_len, encoding_errors, text_field)
    status("evaluating", f"{path} on {source or 'the standard library'} ({split}), {batches}x{batch}x{seq_len_} tokens ...")
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.diagnostics import evaluate_folder

    with batch_progress(str(path), log_every) as progress:
        return evaluate_folder(path, data, seq_len, batches, batch, controls, encoding_errors, text_field, device,
                               model, progress, data_split=data_split, streaming=streaming, dtype=dtype,
                               merge_lora=merge_lora)


@contextmanager
def batch_progress(name: str, log_every: int):
    """A ``progress(done, total)`` callback for the evaluated batches: a rich bar on a terminal stderr, else
    ``eval NAME batch D/N  S s`` every ``log_every`` batches and at the last."""
    start = time.monotonic()
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        def line(done: int, total: int) -> None:
            if done and (done % log_every == 0 or done == total):
                click.echo(f"eval {name} batch {done}/{total}  {time.monotonic() - start:.0f} s", err=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("eval", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# --help: the options it shares with `concept train` in train's sections (their declaration's groups), its own first
@click.command(name="eval", cls=GroupedHelp, like="concept.train_config:CoreTrainConfig")
@click.argument("runs", metavar="RUN_DIR...", nargs=-1, type=click.Path(path_type=Path))
@click.option("--data", multiple=True, metavar="SOURCE",
              help="Held-out text: a file, folder or JSONL, a Hugging Face datasets save_to_disk folder "
                   "(PATH:SPLIT picks a DatasetDict split; default train) or .parquet / .arrow files (read "
                   "whole), or a built-in corpus (stdlib/code, pydoc/prose: its held-out split); repeat for one "
                   "table per domain. Default: the held-out split of the run's data.")
@click.option("--seq-len", type=click.IntRange(min=2), default=None,
              help="Default: the run's training --seq-len (or 256).")
@renamed("--eval-batches", "batches", old=("--batches",), type=click.IntRange(min=1), default=8, show_default=True,
         help="Held-out batches per run and domain.")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True, help="Rows per batch.")
@click.option("--no-controls", is_flag=True, help="Skip the ΔNLL shuffled / random concept passes.")
@click.option("--show-map", "show_map", type=click.Choice(["text", "html"]), is_flag=False, flag_value="text",
              default=None, help="Print a held-out sample with the tokens that became concepts highlighted: styled "
                                 "on a terminal, between [[ ]] in a pipe or file; --show-map html: the whole report "
                                 "(tables and maps) as one self-contained HTML page on stdout.")
@click.option("--compare", is_flag=True, help="Side-by-side table of several runs (implied by several RUN_DIRs).")
@click.option("--text-field", default=None)
@click.option("--data-split", default=None,
              help="With a --data dataset id (hf:NAME): its split (default train; the run's own when --data is not given).")
@click.option("--streaming/--no-streaming", default=None,
              help="With a --data dataset id: stream its rows into the token shard instead of downloading it whole.")
@click.option("--encoding-errors", type=click.Choice(["strict", "replace"]), default=None,
              help="Default: the run's training setting (strict).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--log-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="With a stderr that is not a terminal (a batch job, 2>log): a plain progress line every this many "
                   "batches (a progress bar on a terminal).")
@click.option("--tasks", "tasks", multiple=True, metavar="NAMES",
              help="Downstream tasks through lm-evaluation-harness instead of held-out NLL: task, group or tag names, "
                   "comma-separated or repeated (the shipped offline tasks: concept_offline; `--tasks list` lists all). "
                   "Needs the `eval` extra (lm-eval).")
@click.option("--include-path", "include_path", multiple=True, metavar="DIR", type=click.Path(path_type=Path),
              help="With --tasks: a folder of your own lm-eval task YAMLs (repeatable).")
@renamed("--tasks-limit", "limit", old=("--limit",), type=click.IntRange(min=1), default=None,
              help="With --tasks: at most this many examples per task (default: all).")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None,
              help="With --tasks: few-shot examples per prompt (default: each task's own).")
@click.option("--compile", "compile_", type=click.Choice(COMPILE_CHOICES), default=DEFAULT_COMPILE,
              show_default=True, is_flag=False, flag_value="on", help=COMPILE_HELP)
@dtype_option()
@merge_lora_option()
@click.option("--json", "as_json", is_flag=True)
@config_option("eval", help="A recipe (YAML or JSON; its eval: section if it has one): its values are the defaults, "
                            "flags override them (docs/cli.md).")
@print_config_option()
@click.pass_context
def eval_(ctx, runs, data, seq_len, batches, batch, no_controls, show_map, compare, text_field, data_split, streaming,
          encoding_errors, device,
          log_every, tasks, include_path, limit, num_fewshot, compile_, dtype, merge_lora, as_json, config_file, print_config):
    """Evaluate trained (or built) runs on held-out text, or on downstream tasks (--tasks).

    \b
    concept eval runs/m1-train --json
    concept eval runs/m1-train --data held-out/ --show-map
    concept eval runs/m1-train runs/dense          # side by side
    concept eval runs/m1-train --data stdlib --data pydoc   # code and prose: one table per domain
    concept eval runs/m1-train runs/dense --tasks concept_offline --tasks-limit 100   # accuracy, lm-eval
    concept eval --tasks list                      # every task name, the shipped ones first
    concept eval --config recipes/demo.yaml        # a recipe file (its eval: section); flags override it
    """
    if print_config:
        click.echo(dump(command_values(ctx, ctx.params)), nl=False)
        return
    quiet_progress_bars()
    names = [n.strip() for t in tasks for n in t.split(",") if n.strip()]
    if tasks:
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from .tasks_eval import evaluate_on_tasks

        return evaluate_on_tasks(runs, names, include_path, limit, num_fewshot, batch, seq_len, device, as_json, dtype,
                                 merge_lora)
    if include_path or limit is not None or num_fewshot is not None:
        raise click.UsageError("--include-path, --tasks-limit and --num-fewshot go with --tasks")
    if not runs:
        raise click.UsageError("give at least one RUN_DIR")
    if show_map == "html" and as_json:
        raise click.UsageError("--show-map html and --json both write stdout; choose one")
    with html_report() if show_map == "html" else contextlib.nullcontext():  # --show-map html: one page
        domains = list(dict.fromkeys(data)) or [None]  # repeated --data: one evaluation per domain
        by_domain = {d: {} for d in domains}
        for run in runs:
            model, throughput = None, training_throughput(run)
            if compile_ != "off":
                # lazy: the library (torch) loads only when the command runs; --help stays instant
                from concept import load
                from concept.distributed import pick_device

                model = load(run, compile=compile_, dtype=dtype, merge_lora=merge_lora).to(pick_device(device))
            for d in domains:
                model, tokenizer, docs, result = evaluate_run(run, d, seq_len, batches, batch, not no_controls,
                                                              encoding_errors, text_field, device, model, log_every,
                                                              data_split, streaming, dtype, merge_lora)
                result.update(throughput)
                result["model"] = run_label(run, result["model"])
                by_domain[d][str(run)] = result
                if show_map and hasattr(model, "length_policy"):
                    # lazy: the library (torch) loads only when the command runs; --help stays instant
                    from concept.diagnostics import compression_map

                    stdout.print(f"[bold]compression map[/] of {escape(str(run))} ({escape(docs[0].name)}); highlighted "
                                 f"tokens emitted a concept:")
                    print_concepts(compression_map(model, tokenizer, docs[0].text, max_tokens=200))
        for results in by_domain.values():
            speed_vs_dense(results)
        several = compare or len(runs) > 1
        if as_json:
            pick = lambda results: results if several else results[str(runs[0])]  # noqa: E731
            # one domain: the single-domain format; several: {domain: that format}
            print_json(pick(by_domain[domains[0]]) if len(domains) == 1 else {d: pick(r) for d, r in by_domain.items()})
            return
        if len(domains) > 1:
            t = table("domain", *(f"{run}: {what}" for run in by_domain[domains[0]] for what in ("bits / token", "concepts / token")),
                      title="held-out bits / token and realised concepts / token by domain")
            for d, results in by_domain.items():
                t.add_row(d, *(fmt.format(r[key]) if key in r else "-" for r in results.values()
                               for key, fmt in (("bits_per_token", "{:.4f}"), ("ratio", "{:.4f}"))))
            stdout.print(t)
        for d, results in by_domain.items():
            print_tables(results, f": {d}" if len(domains) > 1 else "")


TASKS_GROUP = "downstream tasks (--tasks, lm-eval)"  # the --help section of the options that go with --tasks
for _param in eval_.params:
    if _param.name in ("tasks", "include_path", "limit", "num_fewshot"):
        _param.help_group = TASKS_GROUP


def print_tables(results: dict, suffix: str = "") -> None:
    """The metrics table and the NLL-by-position table of one domain (runs side by side)."""
    t = table("metric", *results.keys(), title=f"held-out evaluation{suffix}")
    for key, label, fmt in ROWS:
        if any(key in r for r in results.values()):
            t.add_row(label, *(fmt.format(r[key]) if key in r else "-" for r in results.values()))
    typed = dict.fromkeys(k for r in results.values() for k in r if k.split("/")[0] in PER_TYPE and "/" in k)
    for key in typed:  # the planner-executor's per-type rows: plan_len/topic, entropy/topic, ...
        what, name = key.split("/", 1)
        fmt = "{:+.4f}" if what.startswith("delta_") else "{:.3f}"
        t.add_row(f"{PER_TYPE[what]} ({name})", *(fmt.format(r[key]) if key in r else "-" for r in results.values()))
    stdout.print(t)
    buckets = next((r["nll_by_position"] for r in results.values() if r.get("nll_by_position")), None)
    if buckets:
        t = table("position", *results.keys(), title=f"NLL by position in the document (nats){suffix}")
        for b in buckets:
            t.add_row(b, *(f"{r['nll_by_position'].get(b, float('nan')):.3f}" for r in results.values()))
        stdout.print(t)
