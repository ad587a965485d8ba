"""The quality / compute frontier: held-out bits per token against FLOPs, streaming vs baselines.

One set of runs, all trained with the same recipe and budget and evaluated on the same held-out
batches of several domains (code and prose by default):

* **streaming** models over splits x target ratios (``s4-22-4_r0.25``);
* for each streaming point the **FLOP-matched pruned baseline** (``concept train --baseline
  pruned``: the backbone minus the block of middle layers whose forward FLOPs match the
  streaming model's ideal at the target ratio and training length); points that remove the same
  block share one run (``pruned-L14-skip4-19``: 14 layers kept, layers 4..19 skipped);
* the **dense** baseline, once.

::

    spec = FrontierSpec(build=BuildConfig(), splits=["4,22,4", "10,10,10"], ratios=[0.5, 0.25],
                        train=TrainConfig(steps=30, seq_len=128, batch=4), domains=domains(["stdlib", "pydoc"]))
    planned = schedule(spec, "runs/frontier")       # validates everything first: one ConfigError
    result = run(spec, planned, "runs/frontier")    # trains what is missing, evaluates every run
    write(result, "runs/frontier")                  # frontier.json, frontier.md, frontier.png

Run folders live in ``OUT/NAME``; the built (untrained) models they start from in
``OUT/builds/SPLIT``. A run is **complete** when its ``train.json`` holds the scheduled recipe and its
checkpoint is at the scheduled step count: a rerun skips it (and reuses its cached evaluation,
``frontier-eval.json``, when the evaluation settings are the same), resumes a run interrupted after
a checkpoint, and refuses a run trained with another recipe (``force=True`` retrains it).

FLOP ratios to dense are ideal forward FLOPs (``concept.flops``) at the evaluation length: for a
streaming run at the ratio it realised on that domain (``ideal_ratio``); for a pruned run its kept
layers over all layers (``pruned_flops``); dense = 1. The **best** streaming point is the one with
the lowest mean bits/token over the domains among those at <= ``max_flops`` on every domain.

The modules: :mod:`.scheduling` (the specification and every run, validated up front), :mod:`.running`
(building, training and evaluating them) and :mod:`.reporting` (summary, tables, plots).
"""
from .reporting import (
    best_line,
    markdown_table,
    plot,
    plot_tasks,
    report_block,
    summarise,
    table_cells,
    task_metrics,
    write,
)
from .running import evaluate_run, evaluate_tasks, run
from .scheduling import (
    Domain,
    FrontierSpec,
    ScheduledRun,
    describe_kind,
    domains,
    parse_ratios,
    parse_splits,
    recipe,
    run_state,
    schedule,
    train_overrides,
)

__all__ = ["Domain", "FrontierSpec", "ScheduledRun", "best_line", "describe_kind", "domains",
           "evaluate_run", "evaluate_tasks", "markdown_table", "parse_ratios", "parse_splits", "plot", "plot_tasks",
           "recipe", "report_block", "run", "run_state", "schedule", "summarise", "table_cells", "task_metrics",
           "train_overrides", "write"]
