"""The options of ``concept train``, declared once (``concept.options``), and the pure rules they feed.

A training config is made of the core's options (:class:`CoreTrainConfig`: data, schedule, shared objectives,
baselines, LoRA, checkpoints, device) followed by a family's own (``Family.training``, an option dataclass such
as ``concept.streaming.options.StreamingTraining``), so that the trainer and the CLI see one flat set:
``--task continue`` on the command line, ``"task": "continue"`` in train.json, ``TrainConfig(task="continue")``
in Python. :func:`for_family` composes the core's and one family's (``concept train RUN``: only the run's
family is imported), :func:`composed` the core's and every family's (``TrainConfig``, the Python API), or the
library's own families' (``concept train --help``). A family option set on a run of another kind is refused by
the trainer (:func:`foreign_options`). ``--baseline`` / ``--prune-layers`` / ``--mtp-heads`` ask for a baseline's
build derived from the source run's (``concept.baselines.derive``); train.json leaves them out.

Standard library only (no torch): ``concept train --help`` builds its options from this module.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from . import options
from .config import COMPILE_CHOICES, COMPILE_HELP, DEFAULT_COMPILE, DEFAULT_DTYPE, DTYPES, BuildConfig
from .families import family, working
from .options import SEED_MAX, check, nested, option

BASELINES = ("dense", "pruned")  # the families `--baseline` derives a run of (concept.baselines)
# the training options that only ask for a baseline's build (``--baseline``, ``--prune-layers``, ``--mtp-heads``):
# the build records their effect (its section), train.json does not
REQUEST = ("baseline", "prune_layers", "mtp_heads")
TRAIN_ONLY = ("all", "new")
ALIGN_LOSSES = ("cosine", "mse")
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# how an adapted projection computes (``concept.lora``): eight matmuls a step, three Triton kernels, or the kernels
# where they run and the matmuls elsewhere (``concept.lora_triton.chosen``)
LORA_KERNELS = ("matmuls", "triton", "auto")


@dataclass
class LoraSettings:
    """The adapters' options (``concept.options``): ``--lora-rank`` ... in ``concept train``."""

    options_title = "LoRA adapters"  # (their --help section: concept.options.group_of)

    rank: int = option(8, minimum=1, help="Rank r of the LoRA adapters.")
    alpha: float = option(16.0, help="LoRA scaling: an adapter's update is multiplied by alpha / rank.")
    dropout: float = option(0.0, minimum=0, below=1,
                            help="Dropout on the LoRA adapters' input while training, in [0, 1).")
    targets: str = option(DEFAULT_TARGETS, help="Comma-separated names of the linear layers (attention and MLP) "
                                                "that get LoRA adapters.")
    kernel: str = option("matmuls", choices=LORA_KERNELS,
                         help="How an adapted projection computes: `matmuls` (its base and adapter products one "
                              "matmul each, 3 forward and 5 backward) or `triton` (one Triton kernel forward, two "
                              "backward; CUDA only; the same values up to the order of fp32 sums) or `auto` (the "
                              "Triton kernels where they run, a CUDA device with Triton, and the matmuls elsewhere).")

    def validate(self) -> list[str]:
        problems = check(self, prefix="lora-")
        if isinstance(self.targets, str) and not [t for t in self.targets.split(",") if t.strip()]:
            problems.append("lora-targets: name at least one linear layer, e.g. q_proj,v_proj")
        return problems

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class CoreTrainConfig:
    """Every ``concept train`` option the core reads, declared once (``concept.options``): the field's
    default, its flag (``--seq-len`` for ``seq_len``; ``--lora-*`` for ``lora``), help and simple checks. The
    CLI options are made from these fields, in this order (then the families'); ``validate`` adds the checks
    across fields."""

    options_title = "training"  # their --help sections (concept.options.group_of): these, the rest "training"
    option_families = ()  # the families' option classes composed in (``_compose``)
    option_owners = {}  # a family's option -> (the families that read it) (``_compose``)
    option_groups = {
        "baselines": ("baseline", "prune_layers", "mtp_heads"),
        "data": ("data", "data_split", "streaming", "eval_data", "text_field", "encoding_errors", "seq_len",
                 "curriculum"),
        "objectives": ("ce_weight", "distill", "distill_temperature", "mtp", "mtp_ce", "align", "align_loss"),
        "evaluation, checkpoints and logs": ("eval_every", "eval_batches", "checkpoint_every", "log_every"),
        "device and precision": ("device", "compile", "dtype", "grad_checkpointing"),
    }

    baseline: str | None = option(
        None, choices=BASELINES, is_flag=False, flag_value="dense",
        help="Train a baseline derived from RUN's build instead of RUN's model (a run of the `dense` or `pruned` "
             "family, same backbone and seed): `dense` (the default of a bare --baseline: backbone + LoRA, no "
             "compression) or `pruned` (the backbone minus a contiguous block of middle layers, FLOP-matched to "
             "RUN's model at --seq-len, e.g. the streaming model at --target-ratio).")
    prune_layers: str | None = option(
        None, metavar="START:STOP",
        help="With --baseline pruned: skip layers START..STOP-1 (0-based) instead of the FLOP-matched block (the "
             "derived build's pruned.layers).")
    data: str | None = option(
        None, help="Text file, folder, or JSONL; or Hugging Face datasets: a save_to_disk folder (DatasetDict: its "
                   "train split, or PATH:SPLIT), .parquet / .arrow files (default: the Python standard library).")
    data_split: str | None = option(
        None, help="With a --data dataset id (or hf:PATH) that `datasets.load_dataset` loads: its split "
                   "(default: train).")
    streaming: bool = option(
        False, help="With a --data dataset id: stream its rows (`load_dataset(streaming=True)`) into the token "
                    "shard cache instead of downloading it whole first.")
    eval_data: str | None = option(
        None, help="Data for the periodic held-out evaluation instead of the held-out split of --data (all of it; "
                   "a built-in corpus: its held-out split); `concept eval` then defaults to it too.")
    text_field: str = option("text", help="JSONL field holding the text.")
    encoding_errors: str = option(
        "strict", choices=("strict", "replace"),
        help="Text that is not valid UTF-8: strict (an error naming the file) or replace (U+FFFD for each bad byte).")
    steps: int = option(300, minimum=1, help="Optimizer steps (the learning-rate and temperature schedules span them).")
    seq_len: int = option(256, minimum=2, help="Tokens per training row.")
    batch: int = option(8, minimum=1, help="Rows per micro-batch (per process under torchrun).")
    grad_accum: int = option(1, minimum=1, help="Micro-batches accumulated into each optimizer step.")
    lr: float = option(2e-4, above=0, help="Learning rate of the LoRA adapters.")
    lr_new: float = option(1e-3, above=0, help="Learning rate of the new modules.")
    weight_decay: float = option(0.0, minimum=0, help="AdamW weight decay (decoupled), for every trained group.")
    warmup: int = option(10, minimum=0, help="Steps of linear learning-rate warmup before the cosine decay.")
    min_lr: float = option(
        0.1, minimum=0, maximum=1,
        help="After the warmup the cosine schedule decays to this fraction of each peak learning rate (0..1).")
    clip: float = option(1.0, above=0, help="Clip the gradient norm to this value.")
    ce_weight: float = option(
        1.0, minimum=0, help="Weight of the next-token cross entropy (0 with --distill: KL-only distillation).")
    distill: float = option(
        0.0, minimum=0,
        help="Weight of KL(teacher || student) on the next-token distributions; the teacher is the frozen backbone "
             "(adapters disabled), one extra no-grad forward per step.")
    distill_temperature: float = option(
        1.0, above=0, help="Softmax temperature T of the distillation (the KL is scaled by T^2).")
    mtp: float = option(
        1.0, minimum=0,
        help="Weight of the MTP heads' self-distillation (KL to the frozen backbone at t+1..t+k, plus CE); only for "
             "a model with MTP heads (--length-policy mtp). One extra no-grad forward per step.")
    mtp_heads: int = option(
        0, minimum=0,
        help="With --baseline: K MTP heads on the dense / pruned model's last hidden state, for multi-token decoding "
             "(the derived build's mtp_heads; the streaming model's come with --length-policy mtp).")
    mtp_ce: float = option(
        0.5, minimum=0, help="Weight of the CE on the real tokens inside the MTP objective, relative to its KL.")
    curriculum: str | None = option(
        None, metavar="START:FRACTION",
        help="Short-to-long: rows grow linearly from START tokens to --seq-len over FRACTION of the steps "
             "(--context-len grows in proportion), e.g. 64:0.5.")
    align: float = option(
        0.0, minimum=0,
        help="Weight of the hidden-state alignment to the frozen backbone (see --align-at, --align-loss).")
    align_loss: str = option(
        "cosine", choices=ALIGN_LOSSES,
        help="cosine: 1 - cos per token; mse: squared error / the teacher states' mean square (dominated by a few "
             "tokens with massive activations on SmolLM2; docs/training.md).")
    train_only: str = option(
        "all", choices=TRAIN_ONLY,
        help="new: train only the new modules (the LoRA adapters stay frozen), e.g. a first stage that fits a tail "
             "bridge with --align.")
    lora: LoraSettings = nested(LoraSettings, prefix="lora")  # noqa: RUF009 (a default_factory field)
    seed: int = option(0, minimum=0, maximum=SEED_MAX, help="Seed of the adapters' initialisation, the data order and each micro-batch's "
                               "randomness (Gumbel noise, dropout).")
    eval_every: int = option(50, minimum=1, help="Evaluate on held-out data every this many steps (and at the end).")
    eval_batches: int = option(4, help="Held-out batches per evaluation.")
    checkpoint_every: int = option(50, minimum=1, help="Save a checkpoint every this many steps (and at the end).")
    log_every: int = option(10, minimum=1, help="Add gradient norms and concept diagnostics to metrics.jsonl every "
                                                "this many steps; with a stderr that is not a terminal (a batch job, "
                                                "2>log), also print a plain progress line every this many steps.")
    report_to: str = option(
        "none", metavar="NAMES",
        help="Also send the metrics to experiment trackers, comma-separated: tensorboard (event files in "
             "RUN/tensorboard), wandb, mlflow, csv (RUN/metrics.csv beside metrics.jsonl), or none. Each but csv "
             "needs its extra, e.g. pip install 'concept[tensorboard]'.")
    grad_checkpointing: bool = option(
        False, help="Recompute activations in the backward pass: less memory, more compute.")
    device: str = option("auto", help="auto, cpu or cuda.")
    compile: str = option(DEFAULT_COMPILE, choices=COMPILE_CHOICES, help=COMPILE_HELP, is_flag=False, flag_value="on")
    dtype: str = option(
        DEFAULT_DTYPE, choices=DTYPES,
        help="Compute precision: with bf16, or auto on CUDA, the frozen base weights are stored in bf16 and the "
             "step runs under bf16 autocast (LoRA, new modules and optimizer state stay fp32); fp32 otherwise.")

    def __post_init__(self):
        if isinstance(self.baseline, bool):  # the Python API's shorthand: baseline=True is the dense baseline
            self.baseline = "dense" if self.baseline else None

    def validate(self, max_positions: int = 0, num_layers: int = 0) -> list[str]:
        """Every problem at once: the declared checks of each option (the families' too), then those across
        options."""
        p = options.check(self) + self.lora.validate()
        if options.mistyped(self) or options.mistyped(self.lora):  # the checks below compare values
            return p
        if isinstance(self.data, str) and not self.data.strip():  # ("" would read the working folder)
            p.append(f"data: {self.data!r} is an empty path; pass a file or folder, or leave --data out to use the "
                     f"default corpus")
        if max_positions and self.seq_len > max_positions:
            p.append(f"seq-len: {self.seq_len} is above the backbone's maximum of {max_positions} positions")
        return p + self._validate_recipe(num_layers)

    def _validate_recipe(self, num_layers: int = 0) -> list[str]:
        """Baselines, objectives, the ratio curriculum and what trains."""
        p = []
        if self.mtp_heads > 0 and not self.baseline:
            p.append("mtp-heads: only for --baseline dense / pruned (a dense or pruned build has them in its section: "
                     "--set dense.mtp_heads=K); the streaming model's MTP heads come with its length policy "
                     "(`concept build --length-policy mtp --set length_policy.heads=K`)")
        if self.curriculum is not None:
            try:
                parse_curriculum(self.curriculum, self.seq_len)
            except ValueError as exc:
                p.append(f"curriculum {self.curriculum}: {exc}")
        teachers = ("distill", "align", *(n for declared in self.option_families for n in declared.teaches))
        if self.ce_weight == 0 and not any(getattr(self, n) for n in teachers):
            flags = [f"--{n.replace('_', '-')}" for n in teachers]
            p.append(f"ce-weight 0 with neither {', '.join(flags[:-1])} nor {flags[-1]}: nothing to train on")
        for declared in self.option_families:  # each family's checks across its options (and the shared ones)
            p += declared.problems(self)
        if self.baseline:
            if self.train_only == "new" and not self.mtp_heads:
                p.append(f"train-only new: a {self.baseline} baseline has no new modules (only LoRA adapters) unless "
                         f"it has MTP heads (--mtp-heads K); drop --train-only or add heads")
        if self.prune_layers is not None:
            if self.baseline != "pruned":
                p.append(f"prune-layers {self.prune_layers}: only for --baseline pruned")
            else:
                try:
                    parse_prune_layers(self.prune_layers, num_layers)
                except ValueError as exc:
                    p.append(f"prune-layers {self.prune_layers}: {exc}")
        return p

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CoreTrainConfig:
        """From ``to_dict`` (a saved train.json, read through ``concept.run_files``, which brings an older
        version's record to today's format: ``concept.migrate``); fields it lacks take their defaults."""
        d = dict(d)
        d["lora"] = LoraSettings(**d.get("lora", {}))
        return cls(**d)


def parse_curriculum(text: str, seq_len: int) -> tuple[int, float]:
    """``"START:FRACTION"`` -> (START, FRACTION): rows start at START tokens and grow linearly to ``seq_len``
    over FRACTION of the steps."""
    try:
        start, fraction = str(text).split(":")
        start, fraction = int(start), float(fraction)
    except ValueError:
        raise ValueError("expected START:FRACTION, e.g. 64:0.5 (rows grow from 64 tokens to --seq-len over the "
                         "first half of the steps)") from None
    if start < 2:
        raise ValueError(f"rows need at least 2 tokens, the curriculum starts at {start}")
    if start > seq_len:
        raise ValueError(f"the curriculum would end shorter than it starts: it starts at {start} tokens and ends at "
                         f"--seq-len {seq_len}; pass a START <= {seq_len}")
    if not 0 < fraction <= 1:
        raise ValueError(f"FRACTION is the share of the steps over which rows grow, in (0, 1], got {fraction}")
    return start, fraction


def curriculum_len(config, step: int) -> int:
    """The row length of (0-based) ``step`` under ``config.curriculum`` (``seq_len`` without one): a pure
    function of the step, so resume is exact."""
    if not config.curriculum:
        return config.seq_len
    start, fraction = parse_curriculum(config.curriculum, config.seq_len)
    progress = min(1.0, step / max(1.0, fraction * config.steps))
    return int(round(start + (config.seq_len - start) * progress))



def parse_prune_layers(text, num_layers: int = 0) -> tuple[int, int]:
    """``"A:B"`` (or ``[A, B]``) -> (A, B): skip layers A..B-1 (0-based, like a Python slice); at least one layer
    stays. A ValueError says what is wrong and the fix."""
    if isinstance(text, (list, tuple)) and len(text) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                   for i in text):
        a, b = text
    else:
        try:
            a, b = (int(x) for x in str(text).split(":"))
        except ValueError:
            raise ValueError("write it as START:STOP (0-based, STOP excluded), e.g. 8:20") from None
    if not 0 <= a < b:
        raise ValueError("need 0 <= START < STOP")
    if num_layers and b > num_layers:
        raise ValueError(f"the backbone has {num_layers} layers (0..{num_layers - 1}); STOP must be <= {num_layers}")
    if num_layers and b - a >= num_layers:
        raise ValueError(f"that removes all {num_layers} layers; keep at least one")
    return a, b


def family_options(third_party: bool = True) -> list[tuple[str, type]]:
    """(name, training options) of each registered family that has some (``Family.training``): the default
    family's first, then the others in registry order (without ``third_party``: only the library's own)."""
    default = BuildConfig.__dataclass_fields__["family"].default
    loaded = working(third_party)  # (a family plugin that does not import adds no options)
    return [(name, loaded[name].training) for name in sorted(loaded, key=lambda n: n != default)
            if loaded[name].training is not None]


def foreign_options(config, own=None) -> list[tuple[str, object, str]]:
    """(flag, value, owners) of each option of ``config`` that only families other than ``own`` read (all
    of them for a baseline, ``own`` None), set away from its default; ``owners``: those families, e.g.
    ``streaming or planner-executor``. Imports no family."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return [(name.replace("_", "-"), getattr(config, name), " or ".join(owners))
            for name, owners in type(config).option_owners.items()
            if (own is None or own.name not in owners) and getattr(config, name) != defaults[name]]


def recorded(config, own) -> dict:
    """What train.json records of ``config`` for a run of the family ``own``: the core's options and
    ``own``'s (the others are at their defaults, :func:`foreign_options` refuses them otherwise), less the
    request of a baseline's build (``concept.baselines.REQUEST``: its build records what they made)."""
    return {name: value for name, value in config.to_dict().items()
            if own.name in type(config).option_owners.get(name, (own.name,)) and name not in REQUEST}


def missing_options(config, own) -> list[str]:
    """The options of the family ``own`` that ``config`` lacks (composed for another family)."""
    return [f.name for f in dataclasses.fields(own.training or CoreTrainConfig)
            if f.name not in type(config).__dataclass_fields__]


def _compose(families: list[tuple[str, type]]) -> type:
    """A training config class: :class:`CoreTrainConfig`'s fields, then each family's (``(name, options
    class)``). A field two families inherit from one base (``concept.code_options``) is one option; a name
    declared twice otherwise is an error naming both owners."""
    owner = {f.name: "the core" for f in dataclasses.fields(CoreTrainConfig)}
    declared, owners, extra, classes = {}, {}, [], []
    groups = dict(CoreTrainConfig.option_groups)  # each family's options: its own --help section(s)
    for name, options_cls in families:
        hints = typing.get_type_hints(options_cls)
        classes += [options_cls] if options_cls not in classes else []
        for f in dataclasses.fields(options_cls):
            if declared.get(f.name) is f:  # (shared: one option, read by both)
                owners[f.name] += (name,) if name not in owners[f.name] else ()
                continue
            if f.name in owner:
                raise TypeError(f"training option {f.name!r} of {options_cls.__qualname__} is declared by "
                                f"{owner[f.name]} already; rename it")
            owner[f.name], declared[f.name], owners[f.name] = options_cls.__qualname__, f, (name,)
            extra.append((f.name, hints[f.name], f))
            title = options.group_of(options_cls, f.name)
            title = options_cls.__name__ if title == "options" else title
            groups[title] = (*groups.get(title, ()), f.name)
    made = dataclasses.make_dataclass("TrainConfig", extra, bases=(CoreTrainConfig,))
    made.__module__, made.__doc__ = __name__, CoreTrainConfig.__doc__  # (pickle and help() find it here)
    made.option_groups, made.option_owners, made.option_families = groups, owners, tuple(classes)
    return made


_COMPOSED: dict = {}  # (third_party,) or a family's name -> its composed class


def composed(third_party: bool = True) -> type:
    """``TrainConfig`` (every installed family's options), or without ``third_party`` the one of the core and
    the library's own families, which imports no other family (``concept train --help``: a third-party family
    that imports torch or fails to import costs it nothing)."""
    if third_party:
        return globals().get("TrainConfig") or __getattr__("TrainConfig")
    if (False,) not in _COMPOSED:
        _COMPOSED[(False,)] = _compose(family_options(third_party=False))
    return _COMPOSED[(False,)]


def for_family(name: str) -> type:
    """The training config of a run of the family ``name``: the core's options and that family's only
    (``concept train RUN``). Imports that family alone: a broken one is its ``PluginImportError``."""
    if name not in _COMPOSED:
        own = family(name)
        _COMPOSED[name] = _compose([(name, own.training)] if own.training is not None else [])
    return _COMPOSED[name]


def __getattr__(name: str):
    """``TrainConfig``, composed the first time it is asked for: importing this module imports no family."""
    if name == "TrainConfig":
        made = globals()["TrainConfig"] = _compose(family_options())
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
