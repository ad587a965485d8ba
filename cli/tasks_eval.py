"""``concept eval RUN... --tasks NAMES``: downstream tasks through lm-evaluation-harness, runs side by side."""
from __future__ import annotations

import click

from concept.config import DEFAULT_INFERENCE_DTYPE

from .output import print_json, status, stdout, table


def harness():
    """``concept.recipes.harness`` (registers the ``concept`` lm-eval model), or a clear error without lm-eval."""
    try:
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from concept.recipes import harness as module
    except ImportError as exc:
        if "lm_eval" not in str(exc):
            raise
        # lazy: the library (torch) loads only when the command runs; --help stays instant
        from concept.errors import ConceptError

        raise ConceptError("--tasks needs lm-evaluation-harness: pip install 'concept[eval]' (lm-eval>=0.4.8,<0.5)") from exc
    return module


def evaluate_on_tasks(runs, names: list[str], include_path, limit, num_fewshot, batch: int, max_length, device: str,
                      as_json: bool, dtype: str = DEFAULT_INFERENCE_DTYPE,
                      merge_lora: bool = False) -> None:
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.builder import read_run
    from concept.errors import ConceptError, ConfigError

    h = harness()
    problems = h.check_include_path(include_path)
    if names == ["list"]:
        if problems:
            raise ConfigError(problems)
        for name in h.task_names(include_path):
            click.echo(name)
        return
    if "list" in names:
        raise click.UsageError("--tasks list lists the task names; it does not combine with task names")
    if not names:
        raise click.UsageError("--tasks: give at least one task name (`concept eval --tasks list` lists them)")
    if not runs:
        raise click.UsageError("give at least one RUN_DIR to evaluate on --tasks")
    for run in runs:  # every run checked before minutes of evaluation
        try:
            read_run(run)
        except ConceptError as exc:  # not a run, or a corrupt one: its message names the problem and the fix
            problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    status("indexing", f"tasks {', '.join(names)} ...")
    manager = h.resolve_tasks(names, include_path)
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.scoring import Scorer

    results = {}
    for run in runs:
        status("evaluating", f"{run} on {', '.join(names)} (lm-eval{f', at most {limit} per task' if limit else ''}) ...")
        scorer = Scorer.from_run(run, device, batch, max_length, dtype, merge_lora)
        results[str(run)] = {"model": scorer.model.family,
                             "tasks": h.evaluate_tasks(scorer, names, manager, limit, num_fewshot)}
        del scorer
    if as_json:
        print_json(results)
        return
    print_table(results)


def print_table(results: dict) -> None:
    """One row per task and metric, one column per run: value ± standard error."""
    t = table("task", "metric", *results.keys(), title="downstream tasks (lm-evaluation-harness)")
    t.add_row("", "model", *(r["model"] for r in results.values()))
    rows = dict.fromkeys((task, metric) for r in results.values() for task, metrics in r["tasks"].items()
                         for metric in metrics if metric != "samples")
    for task, metric in rows:
        cells = []
        for r in results.values():
            m = r["tasks"].get(task, {}).get(metric)
            cells.append("-" if m is None else f"{m['value']:.4f}" + (f" ± {m['stderr']:.4f}" if m["stderr"] is not None else ""))
        t.add_row(task, metric, *cells)
    for task in dict.fromkeys(task for r in results.values() for task in r["tasks"]):
        t.add_row(task, "examples", *(str(r["tasks"].get(task, {}).get("samples", "-")) for r in results.values()))
    stdout.print(t)
