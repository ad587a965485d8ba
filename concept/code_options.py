"""The training options of a family whose concepts are codes of a learned vocabulary drawn by a sampler: the
Gumbel temperature schedule and the anti-collapse remedies (``concept.codes``). A family opts in by deriving
its training options (``Family.training``) from :class:`CodeTraining`: the streaming and planner-executor
families do; the core reads none of them (a family's objectives pass them on). Two families that derive from
it share one option each (``concept.train_config`` composes a field declared by both once). Standard library
only."""
from __future__ import annotations

from dataclasses import dataclass

from .options import FamilyOptions, option


@dataclass
class CodeTraining(FamilyOptions):
    """``--tau-start``, ``--tau-end``, ``--usage-weight``, ``--revive-after``, ``--kmeans-init``."""

    option_groups = {  # (their --help section, whichever family's they are: concept.options.group_of)
        "concept codes: temperature and anti-collapse": ("tau_start", "tau_end", "usage_weight", "revive_after",
                                                          "kmeans_init")}

    tau_start: float = option(1.0, above=0, help="Gumbel temperature at step 0.")
    tau_end: float = option(0.5, above=0, help="Gumbel temperature at the last step.")
    usage_weight: float = option(
        0.0, minimum=0, help="Anti-collapse: weight of KL(mean concept distribution || uniform) in the loss.")
    revive_after: int = option(
        0, minimum=0,
        help="Anti-collapse: every this many steps, point every learned code that no concept used for this many "
             "steps at a query of the step's concepts (dead-code revival, logged as `revived`; codebook and "
             "embedding vocabularies); 0: off.")
    kmeans_init: int = option(
        0, minimum=0,
        help="Anti-collapse: before the first step, start the learned codes at the k-means centroids of the queries "
             "of the concepts of this many training batches (codebook and embedding vocabularies); 0: off.")
