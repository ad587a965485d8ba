"""The streaming family's own options. Training (``Family.training``): they join the core's
(``concept.train_config``) as ``--target-ratio``, ``--ratio-control``, ``--align-at``, ``--placement``, ... (and
the Gumbel temperature and anti-collapse options it shares with the planner-executor,
``concept.code_options``); a run of another kind refuses them (a baseline notes that they do nothing, but
``--target-ratio``, which a pruned baseline is FLOP-matched at, and ``--align-at``). Building (``Family.build_options``): the build-time
calibration of the NULL bias, ``concept build --target-ratio`` ... (``concept.streaming.calibration``); a
build of another family refuses them. Standard library only."""
from __future__ import annotations

from dataclasses import dataclass

from ..code_options import CodeTraining
from ..options import check, option
from .operating_point import DEFAULT_TARGET_RATIO

RATIO_CONTROLS = ("both", "pi", "loss", "none")
ALIGN_AT = ("deep-input", "final")  # where --align compares hidden states (concept.objectives.AlignObjective)


@dataclass
class StreamingTraining(CodeTraining):
    """Options only a streaming run reads (and a baseline trained from one: ``--target-ratio``, ``--align-at``):
    the target ratio, its control and curriculum, where --align compares, learned placement, the final
    calibration; after those it shares (:class:`concept.code_options.CodeTraining`)."""

    options_title = "streaming family"  # (their --help section: concept.options.group_of)

    teaches = ("placement",)  # a router-only stage trains on it with --ce-weight 0

    target_ratio: float = option(DEFAULT_TARGET_RATIO, above=0, below=1, help="Concepts per token to aim for.")
    align_at: str = option(
        "deep-input", choices=ALIGN_AT,
        help="deep-input: the deep stack's input at tail tokens vs the backbone's input of that layer; final: the last "
             "layer's output (before the final norm) at every token.")
    ratio_control: str = option(
        "both", choices=RATIO_CONTROLS,
        help="Streaming: what holds the concepts-per-token ratio at its target: pi (a controller on the NULL bias), "
             "loss (the ratio loss), both, or none.")
    ratio_loss_weight: float = option(0.1, help="Streaming: weight of the ratio loss (--ratio-control loss / both).")
    pi_ki: float = option(
        0.05, minimum=0,
        help="Streaming: integral gain of the ratio controller (--ratio-control pi / both): the NULL bias moves by "
             "this times the keep log-odds spread per unit of summed ratio error (0: no integral term).")
    ratio_start: float = option(
        1.0, above=0, maximum=1,
        help="Streaming, ratio curriculum: the target ratio at step 0 (1 = every token a concept).")
    ratio_warmup: float = option(
        0.0, minimum=0, maximum=1,
        help="Streaming: anneal the target from --ratio-start to --target-ratio over this fraction of the steps "
             "(linearly in tokens per concept), then hold it; 0 = off.")
    placement: float = option(
        0.0, minimum=0,
        help="Streaming, learned placement: weight of a BCE that trains the `null` policy's keep score to emit "
             "concepts where skipping the middle stack costs most (KL of the frozen backbone to this model without "
             "its middle stack); one teacher forward and one shallow+deep forward per step, no gradient.")
    calibration_batches: int = option(
        16, help="Streaming: at the end, re-estimate the NULL bias for the target ratio on this many training "
                 "batches (0: off).")

    @staticmethod
    def problems(config) -> list[str]:
        found = []
        if 0 < config.target_ratio < 1 and 0 < config.ratio_start <= 1 and config.ratio_start < config.target_ratio:
            found.append(f"ratio-start: the curriculum anneals down to --target-ratio {config.target_ratio}; a start of "
                         f"{config.ratio_start} is below it")
        if config.baseline and config.align and config.align_at == "deep-input":
            found.append(f"align-at deep-input: a {config.baseline} baseline has no deep stack whose input could be "
                         f"aligned; use --align-at final, or drop --align")
        return found


CALIBRATION_BATCH, CALIBRATION_SEQ_LEN = 4, 128  # the rows of one calibration batch (concept.streaming.calibration)


@dataclass
class StreamingBuild:
    """``concept build`` options only a streaming build reads: the calibration of a fresh model's NULL bias,
    so that it already emits about ``target_ratio`` concepts per token before any training."""

    options_title = "streaming family: calibration"  # (their --help section: concept.options.group_of)

    target_ratio: float = option(
        DEFAULT_TARGET_RATIO, above=0, below=1,
        help="Streaming: concepts per token the untrained model is calibrated to: its NULL bias is set so that it emits this "
             "many on a few rows of --calibration-data (recorded in concept.json).")
    calibration_data: str | None = option(
        None, metavar="DATA", show_default=False,
        help="Streaming: text to calibrate on: a built-in corpus, file or folder, as `concept train --data` (default: the "
             "Python standard library, training split).")
    calibration_batches: int = option(
        4, minimum=1, help=f"Streaming: calibrate on this many batches of {CALIBRATION_BATCH} rows x {CALIBRATION_SEQ_LEN} tokens.")
    no_calibrate: bool = option(
        False, help="Streaming: keep the NULL bias at 0 (an untrained `null` head then emits a concept at almost every token).")

    def validate(self) -> list[str]:
        return check(self)

    def inputs(self) -> dict:
        """What the build reads besides its config (an output folder must not hold it): name -> data spec."""
        return {"calibration data": None if self.no_calibrate else self.calibration_data}
