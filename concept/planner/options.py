"""The planner-executor's training options (``Family.training``): they join ``concept.train_config.TrainConfig``
as ``--task``, ``--commitment``, ... (and the Gumbel temperature and anti-collapse options it shares with the
streaming family, ``concept.code_options``); a run of another kind refuses them. Standard library only."""
from __future__ import annotations

from dataclasses import dataclass

from ..code_options import CodeTraining
from ..options import option

TASKS = ("reconstruct", "continue")  # what the executor writes: the row from the plan, or the row's continuation
PLAN_TRAINING = ("gumbel", "hard-em")


@dataclass
class PlannerTraining(CodeTraining):
    """Options only a planner-executor run reads, after those it shares (:class:`concept.code_options.CodeTraining`)."""

    options_title = "planner-executor family"  # (their --help section: concept.options.group_of)

    task: str | None = option(
        None, choices=TASKS,
        help="Planner-executor runs: reconstruct (default: the executor rebuilds the row u from the plan alone) or "
             "continue (u = the first --context-len tokens, the executor writes the rest from the plan).")
    context_len: int = option(0, help="Planner-executor, --task continue: tokens of each row the planner reads (u).")
    commitment: float = option(
        0.1, minimum=0,
        help="Planner-executor: weight of the commitment term (the soft and hard concept samples agree).")
    eos_weight: float = option(
        0.1, minimum=0, help="Planner-executor: weight of the <EOS> loss where a type reached its max_len.")
    quota_weight: float = option(
        0.1, minimum=0, help="Planner-executor: weight of the quota loss (expected plan length against the budget).")
    plan_training: str = option(
        "gumbel", choices=PLAN_TRAINING,
        help="Planner-executor: gumbel (a plan sampled with Gumbel-ST in every step) or hard-em (the best of a beam of "
             "plans per example, cached and refreshed every --estep-every steps; docs/planner_executor.md).")
    estep_every: int = option(
        50, minimum=1, help="Hard-EM: search an example's plan again once its cached plan is this many steps old.")
    beam: int = option(4, minimum=1, help="Hard-EM: the E-step's beam width k.")
    estep_prior: float = option(
        1.0, minimum=0,
        help="Hard-EM: β in the E-step's score S(z) = log p(y|z) + β log p(z|u) (1: the posterior mode; 0: the beam's "
             "plan that best explains y).")
    plan_ce: float = option(1.0, minimum=0, help="Hard-EM: weight of the planner's cross-entropy on the best plan z*.")
    plan_mtp: float = option(
        1.0, minimum=0,
        help="Planner-executor built with MTP concepts (--set planner.mtp=K): weight of the MTP heads' CE.")

    @staticmethod
    def problems(config) -> list[str]:
        if config.task == "continue" and not 0 < config.context_len < config.seq_len:
            return [f"context-len: task continue reads the first --context-len tokens of each row and predicts the "
                    f"rest, so it must be in [1, seq-len - 1] = [1, {config.seq_len - 1}]; got {config.context_len}"]
        if config.context_len and config.task != "continue":
            return [f"context-len: only for --task continue (task {config.task or 'reconstruct'} reads the whole "
                    f"row)"]
        return []
