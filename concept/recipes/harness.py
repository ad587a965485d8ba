"""EleutherAI's lm-evaluation-harness (``lm-eval``) for ``concept`` runs: the ``concept`` model backend,
the shipped offline tasks, and the evaluator that ``concept eval --tasks`` runs in-process.

lm-eval 0.4.13 (the pinned version, extra ``eval``) finds models in its own registry only: importing
this module registers ``concept`` there (``lm_eval.api.registry.register_model``). So:

    concept eval runs/x runs/dense --tasks concept_offline --tasks-limit 100     # side by side
    concept lm-eval run --model concept --model_args run=runs/x --tasks concept_cloze   # lm-eval's own CLI
    python -c "import concept.recipes.harness, lm_eval; lm_eval.simple_evaluate(model='concept', ...)"

Model arguments: ``run`` (a run folder: streaming, planner-executor, dense or pruned), ``device``
(auto, cpu, cuda), ``dtype`` (auto: bf16 on CUDA, fp32 elsewhere; fp32, bf16 or ``bfloat16``:
``concept.precision``), ``merge_lora`` (true: the adapters merged into the base weights, ``concept.load``'s),
``batch_size`` (requests per forward; ``auto`` = 8), ``max_length`` (tokens per
scored row; default the backbone's context, at most 2048). Scoring is ``concept.scoring.Scorer``.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import math
import sys
import warnings
from pathlib import Path

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..config import DEFAULT_DTYPE
from ..errors import ConceptError, ConfigError
from ..scoring import Scorer

TASKS = Path(__file__).resolve().parent.parent / "tasks"  # the shipped offline tasks (concept/tasks/*.yaml)
SHIPPED_GROUP = "concept_offline"  # the tag of all of them


@register_model("concept")
class ConceptLM(LM):
    """A ``concept`` run as an lm-eval model (``--model concept --model_args run=PATH``)."""

    def __init__(self, run=None, device: str | None = "auto", batch_size: int | str | None = 8,
                 max_length: int | None = None, scorer: Scorer | None = None, dtype: str | None = DEFAULT_DTYPE,
                 merge_lora: bool = False, **unused):
        super().__init__()
        unused.pop("max_batch_size", None)  # lm-eval passes it to every backend; there is no batch-size search here
        if unused:
            raise ConceptError(f"--model concept does not take {', '.join(sorted(unused))}; its arguments: run, "
                               f"device, dtype, merge_lora, batch_size, max_length")
        if scorer is None:
            if not run:
                raise ConceptError("--model concept needs the run folder: --model_args run=PATH")
            batch = 8 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
            scorer = Scorer.from_run(str(run), device or "auto", batch, int(max_length) if max_length else None,
                                     dtype or DEFAULT_DTYPE, merge_lora)
        self.scorer = scorer
        self.run = str(run) if run is not None else None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ConceptLM:
        """``run=PATH,device=...``; what the evaluator adds (its --batch_size, --device) yields to the model
        arguments (lm-eval's own backends would be given both and fail)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> ConceptLM:
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        device = str(extra.get("device", ""))
        if device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's --device defaults to cuda:0 for every backend; without CUDA that default means "here"
            warnings.warn(f"--device {device}: no CUDA device here; evaluating on the CPU (pass device= in "
                          f"--model_args to insist)", stacklevel=2)
            extra["device"] = "auto"
        return cls(**arg_dict, **extra)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.scorer.tokenizer, "name_or_path", type(self.scorer.tokenizer).__name__))

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([tuple(r.args[:2]) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

    def generate_until(self, requests) -> list[str]:
        return self.scorer.generate_until([(r.args[0], r.args[1]) for r in requests])


# -- tasks -----------------------------------------------------------------------------------------
def task_manager(include_path=(), defaults: bool = True):
    """lm-eval's TaskManager over the shipped tasks, ``include_path`` folders and (``defaults``) lm-eval's own."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS), *(str(p) for p in include_path)]
    return TaskManager(include_path=paths, include_defaults=defaults)


def check_include_path(include_path) -> list[str]:
    problems = []
    for p in include_path:
        path = Path(p)
        if not path.is_dir():
            problems.append(f"--include-path {p}: {'not a folder' if path.exists() else 'no such folder'} (a folder "
                            f"of lm-eval task YAML files)")
    return problems


def task_names(include_path=()) -> list[str]:
    """Every task, group and tag name: the shipped ones first, then those of ``include_path``, then lm-eval's."""
    own = task_manager(include_path, defaults=False).all_tasks
    shipped = set(task_manager((), defaults=False).all_tasks)
    everything = task_manager(include_path).all_tasks
    first = sorted(n for n in own if n in shipped) + sorted(n for n in own if n not in shipped)
    return first + sorted(n for n in everything if n not in set(first))


def resolve_tasks(names: list[str], include_path=()):
    """A TaskManager that knows every name (lm-eval's own tasks are indexed only when a name is not
    shipped or in ``include_path``: that takes ~10 s); an unknown name is a ConfigError with suggestions."""
    manager = task_manager(include_path, defaults=False)
    if not all(n in manager.all_tasks for n in names):
        manager = task_manager(include_path)
    known = set(manager.all_tasks)
    problems = []
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, sorted(known), n=3, cutoff=0.6)
            problems.append(f"--tasks {n}: no such task" + (f"; did you mean {', '.join(close)}?" if close else "")
                            + " (`concept eval --tasks list` lists them)")
    if problems:
        raise ConfigError(problems)
    try:  # build the tasks once now: their data must load before any run is loaded
        manager.load(list(names))
    except Exception as exc:
        why = (f"--tasks {', '.join(names)}: a task's data could not be loaded: {type(exc).__name__}: {exc} (a local "
               f"task: check its data files; a hub task: its data must be in the local `datasets` cache)")
        raise ConfigError([why]) from exc
    return manager


# -- evaluating --------------------------------------------------------------------------------------
def evaluate_tasks(scorer: Scorer, names: list[str], manager, limit: int | None = None, num_fewshot: int | None = None,
                   bootstrap_iters: int = 1000, seed: int = 0) -> dict:
    """lm-eval's evaluator on one loaded run: ``{task: {metric: {"value", "stderr"}, "samples": n}}``
    for every task and group it reports (stderr None where lm-eval gives none)."""
    import lm_eval

    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError([f"--tasks-limit: at least 1 example per task, got {limit!r}"])
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress on stdout; stdout is for data (--json)
            out = lm_eval.simple_evaluate(model=ConceptLM(scorer=scorer), tasks=list(names), task_manager=manager,
                                          limit=limit, num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters,
                                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed, log_samples=False, verbosity="ERROR")
    except ValueError as exc:  # random.sample of the few-shot pool: "Sample larger than population"
        if num_fewshot is None or "larger than population" not in str(exc):
            raise
        raise ConfigError([f"--num-fewshot {num_fewshot}: more examples than a task of {', '.join(names)} has to draw "
                           f"its few-shot examples from; pass a smaller --num-fewshot"]) from None
    samples = out.get("n-samples", {})
    table = {}
    for task, metrics in out["results"].items():
        row = {}
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            row[metric if filt == "none" else f"{metric} ({filt})"] = {
                "value": float(value),
                "stderr": float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None}
        if task in samples:
            row["samples"] = samples[task].get("effective", samples[task].get("original"))
        table[task] = row
    return table
