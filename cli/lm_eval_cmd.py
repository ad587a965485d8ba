"""``concept lm-eval ARGS...``: lm-evaluation-harness's own command line with the ``concept`` model
registered (lm-eval 0.4.13 has no plugin entry points) and the shipped offline tasks included."""
from __future__ import annotations

import sys

import click


@click.command(name="lm-eval", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_(args) -> None:
    """lm-eval's command line (`lm-eval ARGS`) with `--model concept` and the shipped tasks.

    \b
    concept lm-eval run --model concept --model_args run=runs/x --tasks concept_offline --limit 50
    concept lm-eval run --model concept --model_args run=runs/x,device=cuda,batch_size=16 --tasks hellaswag
    concept lm-eval ls tasks
    concept lm-eval --help                      # lm-eval's own help

    Without --include_path the shipped tasks' folder is included; with one, yours replaces it
    (`concept eval --tasks ... --include-path DIR` reads both). Needs the `eval` extra.
    """
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import ConceptError

    # lazy: lm-eval and the library load only when the command runs
    from .tasks_eval import harness

    tasks = harness().TASKS
    argv = list(args)
    legacy = bool(argv) and argv[0].startswith("--") and argv[0] != "--help"  # `lm-eval --model ...` (no `run`)
    if (argv[:1] in (["run"], ["ls"], ["validate"]) or legacy) and not any(a.startswith("--include_path") for a in argv):
        argv += ["--include_path", str(tasks)]
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except (ValueError, FileNotFoundError, KeyError) as exc:  # lm-eval's own way of refusing bad input
        raise ConceptError(f"lm-eval: {exc} (`concept lm-eval ls tasks` lists the tasks; `concept lm-eval run "
                           f"--help` the options)") from None
    finally:
        sys.argv = saved
