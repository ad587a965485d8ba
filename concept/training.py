"""Training: LoRA + new modules on text, ratio control, exact resume.

    trainer = Trainer.start("runs/m1", "runs/m1-train", TrainConfig(steps=300, target_ratio=0.125))
    trainer.train()                                   # writes checkpoints, metrics.jsonl, curves.png
    Trainer.resume("runs/m1-train", steps=600).train()   # continues exactly where it stopped

Raising ``steps`` on resume is allowed but stretches the cosine schedule and the Gumbel
annealing (they span ``steps``): from then on the curve is that of the longer run.

The base weights stay frozen. Trainable: LoRA adapters (peft) on the attention and MLP
linear layers, and the concept model's new modules (ConceptHead, ConceptEmbedding, type
embeddings, ...), each group with its own learning rate (``train_only="new"``: the new modules
only). The loss is ``ce_weight * CE`` plus the configured objectives (``concept.objectives``:
ratio loss, usage KL, distillation from the frozen backbone, hidden-state alignment), each
logged by name; the distillation teacher is ``concept.teacher``. The target ratio can follow a
curriculum (``ratio_start`` -> ``target_ratio`` over ``ratio_warmup`` of the steps). Baselines:
``baseline="dense"`` (the backbone + LoRA) or ``"pruned"`` (minus a FLOP-matched block of
layers, ``concept.flops.matched_prune``). AdamW, linear warmup then cosine
decay, gradient clipping and accumulation, bf16 autocast on GPU, optional gradient
checkpointing. The data position is a pure function of the step and each micro-batch's
randomness is seeded from (seed, step, micro-batch), so a resumed run reproduces the
uninterrupted loss curve exactly. Under ``torchrun`` the same loop runs with DDP or FSDP2
(``concept.distributed``): the global batch is ``batch x world_size x grad_accum`` and the loss
curve is that of one process running the same global batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from . import checkpoint, data, fs
from . import objectives as objectives_
from .backbone import decoder
from .builder import RUN_FILE, TRAIN_FILE, build, build_backbone, read_run, read_train
from .config import DEFAULT_TARGET_RATIO, BuildConfig, resolve
from .dense import DenseModel
from .distributed import Dist, full_tensor
from .errors import ConceptError, ConfigError, RunFolderError
from .lora import LoraSettings, add_lora, lora_state_dict
from .objectives import ALIGN_AT, ALIGN_LOSSES
from .ratio import PIController, scheduled_ratio

METRICS = "metrics.jsonl"
RATIO_CONTROLS = ("both", "pi", "loss", "none")
BASELINES = ("dense", "pruned")
TRAIN_ONLY = ("all", "new")
DTYPES = ("auto", "fp32", "bf16")
# train.json keys that record what a run resolved to, beside the TrainConfig fields
DERIVED = ("source", "attention_resolved", "pruned", "distributed")
DATA_FIELDS = {"data", "text_field", "encoding_errors"}  # --resume may point at other data (with a note)


class TrainingError(ConceptError):
    exit_code = 1


@dataclass
class TrainConfig:
    steps: int = 300
    seq_len: int = 256
    batch: int = 8
    grad_accum: int = 1
    lr: float = 2e-4  # LoRA adapters
    lr_new: float = 1e-3  # new modules (concept head, embeddings, ...)
    weight_decay: float = 0.0
    warmup: int = 10
    min_lr: float = 0.1  # cosine decays to this fraction of the peak
    clip: float = 1.0
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    target_ratio: float = DEFAULT_TARGET_RATIO
    ratio_control: str = "both"  # pi | loss | both | none
    ratio_loss_weight: float = 0.1
    usage_weight: float = 0.0  # anti-collapse: weight of KL(mean concept distribution || uniform)
    pi_ki: float = 0.05  # integral gain of the ratio controller (see concept.ratio)
    calibration_batches: int = 16  # final NULL-bias calibration on this many training batches (0: off)
    tau_start: float = 1.0  # gumbel temperature, annealed linearly
    tau_end: float = 0.5
    data: str | None = None  # None: the Python standard library (train split)
    text_field: str = "text"
    encoding_errors: str = "strict"
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    log_every: int = 10
    grad_checkpointing: bool = False
    baseline: str | None = None  # None: the streaming model; "dense": backbone + LoRA; "pruned": minus a layer block
    prune_layers: str | None = None  # "A:B": the pruned baseline skips layers A..B-1 (default: FLOP-matched)
    ce_weight: float = 1.0  # weight of the next-token CE
    distill: float = 0.0  # weight of KL(teacher || student), the teacher being the backbone without adapters
    distill_temperature: float = 1.0
    align: float = 0.0  # weight of the hidden-state alignment to the teacher
    mtp: float = 1.0  # weight of the MTP heads' self-distillation (a model with MTP heads only: the `mtp` policy)
    mtp_ce: float = 0.5  # ... and of the CE on the real tokens inside it, relative to the KL
    mtp_heads: int = 0  # baselines: K MTP heads on the dense / pruned model (streaming: --length-policy mtp)
    placement: float = 0.0  # weight of the learned-placement term (concept.objectives.PlacementObjective)
    task: str | None = None  # planner-executor: reconstruct (y = u, the default) | continue (y = the text after u)
    context_len: int = 0  # planner-executor, task continue: u = the first context_len tokens of each row
    commitment: float = 0.1  # planner-executor: weight of the commitment term (soft and hard samples agree)
    eos_weight: float = 0.1  # planner-executor: weight of the <EOS> loss where max_len cut a type
    quota_weight: float = 0.1  # planner-executor: weight of the quota loss (plan length against the budget)
    plan_training: str = "gumbel"  # planner-executor: gumbel (online Gumbel-ST plans) | hard-em (concept.hard_em)
    estep_every: int = 50  # hard-em: a cached plan is searched again once it is this many steps old
    beam: int = 4  # hard-em: the E-step's beam width
    plan_ce: float = 1.0  # hard-em: weight of the planner's CE on the best plan z*
    estep_prior: float = 1.0  # hard-em: β in the E-step's score S(z) = log p(y | z) + β log p(z | u)
    plan_mtp: float = 1.0  # planner-executor with MTP concepts (planner.mtp > 1): weight of the MTP heads' CE
    curriculum: str | None = None  # "START:FRACTION": rows grow from START tokens to --seq-len over FRACTION of the steps
    align_at: str = "deep-input"  # deep-input | final
    align_loss: str = "cosine"  # cosine | mse (mse is dominated by massive-activation tokens: docs/training.md)
    train_only: str = "all"  # all | new (LoRA adapters frozen, only the new modules train)
    ratio_start: float = 1.0  # ratio curriculum: target ratio at step 0 ...
    ratio_warmup: float = 0.0  # ... annealed (linearly in 1/ratio) to target_ratio over this fraction of the steps
    device: str = "auto"
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 elsewhere) | fp32 | bf16 (autocast on any device)

    def __post_init__(self):
        if isinstance(self.baseline, bool):  # the older API: baseline=True was the dense baseline
            self.baseline = "dense" if self.baseline else None

    def validate(self, max_positions: int = 0, num_layers: int = 0) -> list[str]:
        p = []
        for name in ("steps", "seq_len", "batch", "grad_accum", "eval_every", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                p.append(f"{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            p.append(f"seq-len: must be >= 2, got {self.seq_len}")
        if max_positions and self.seq_len > max_positions:
            p.append(f"seq-len: {self.seq_len} is above the backbone's maximum of {max_positions} positions")
        if not 0 < self.target_ratio < 1:
            p.append(f"target-ratio: must be in (0, 1), got {self.target_ratio}")
        if self.ratio_control not in RATIO_CONTROLS:
            p.append(f"ratio-control: one of {', '.join(RATIO_CONTROLS)}, got {self.ratio_control!r}")
        for name in ("lr", "lr_new", "tau_start", "tau_end"):
            if not getattr(self, name) > 0:
                p.append(f"{name.replace('_', '-')}: must be > 0, got {getattr(self, name)}")
        if self.usage_weight < 0:
            p.append(f"usage-weight: must be >= 0, got {self.usage_weight}")
        if not self.pi_ki >= 0:  # (NaN fails too)
            p.append(f"pi-ki: must be >= 0, got {self.pi_ki}")
        if self.clip <= 0 or self.weight_decay < 0 or not 0 <= self.min_lr <= 1 or self.warmup < 0:
            p.append("clip > 0, weight-decay >= 0, min-lr in [0, 1] and warmup >= 0 are required")
        if self.encoding_errors not in ("strict", "replace"):
            p.append(f"encoding-errors: strict or replace, got {self.encoding_errors!r}")
        if self.dtype not in DTYPES:
            p.append(f"dtype: one of {', '.join(DTYPES)}, got {self.dtype!r}")
        return p + self._validate_recipe(num_layers) + self.lora.validate()

    def _validate_recipe(self, num_layers: int = 0) -> list[str]:
        """Baselines, objectives, the ratio curriculum and what trains."""
        p = []
        if self.baseline not in (None, *BASELINES):
            p.append(f"baseline: dense or pruned, got {self.baseline!r}")
        if self.mtp_heads < 0:
            p.append(f"mtp-heads: must be >= 0, got {self.mtp_heads}")
        elif self.mtp_heads and not self.baseline:
            p.append("mtp-heads: only for --baseline dense / pruned; the streaming model's MTP heads come with its "
                     "length policy (`concept build --length-policy mtp --set length_policy.heads=K`)")
        from .planner_executor import TASKS

        if self.task is not None and self.task not in TASKS:
            p.append(f"task: one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "continue" and not 0 < self.context_len < self.seq_len:
            p.append(f"context-len: task continue reads the first --context-len tokens of each row and predicts the "
                     f"rest, so it must be in [1, seq-len - 1] = [1, {self.seq_len - 1}]; got {self.context_len}")
        elif self.context_len and self.task != "continue":
            p.append(f"context-len: only for --task continue (task {self.task or 'reconstruct'} reads the whole row)")
        if self.plan_training not in PLAN_TRAINING:
            p.append(f"plan-training: one of {', '.join(PLAN_TRAINING)}, got {self.plan_training!r}")
        if self.estep_every < 1:
            p.append(f"estep-every: the E-step refreshes a cached plan every M >= 1 steps, got {self.estep_every}")
        if self.beam < 1:
            p.append(f"beam: the E-step's beam keeps k >= 1 plans, got {self.beam}")
        if self.curriculum is not None:
            try:
                parse_curriculum(self.curriculum, self.seq_len)
            except ValueError as exc:
                p.append(f"curriculum {self.curriculum}: {exc}")
        for name in ("ce_weight", "distill", "align", "mtp", "mtp_ce", "placement", "commitment", "eos_weight",
                     "quota_weight", "plan_ce", "plan_mtp", "estep_prior"):
            if not getattr(self, name) >= 0:  # (NaN fails too)
                p.append(f"{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")
        if not self.distill_temperature > 0:
            p.append(f"distill-temperature: must be > 0, got {self.distill_temperature}")
        if self.ce_weight == 0 and not self.distill and not self.align and not self.placement:
            p.append("ce-weight 0 with neither --distill, --align nor --placement: nothing to train on")
        if self.align_at not in ALIGN_AT:
            p.append(f"align-at: one of {', '.join(ALIGN_AT)}, got {self.align_at!r}")
        if self.align_loss not in ALIGN_LOSSES:
            p.append(f"align-loss: one of {', '.join(ALIGN_LOSSES)}, got {self.align_loss!r}")
        if self.train_only not in TRAIN_ONLY:
            p.append(f"train-only: one of {', '.join(TRAIN_ONLY)}, got {self.train_only!r}")
        if not 0 <= self.ratio_warmup <= 1:
            p.append(f"ratio-warmup: a fraction of the steps in [0, 1], got {self.ratio_warmup}")
        if not 0 < self.ratio_start <= 1:
            p.append(f"ratio-start: must be in (0, 1], got {self.ratio_start}")
        elif 0 < self.target_ratio < 1 and self.ratio_start < self.target_ratio:
            p.append(f"ratio-start: the curriculum anneals down to --target-ratio {self.target_ratio}; "
                     f"a start of {self.ratio_start} is below it")
        if self.baseline:
            if self.align and self.align_at == "deep-input":
                p.append(f"align-at deep-input: a {self.baseline} baseline has no deep stack whose input could be "
                         f"aligned; use --align-at final, or drop --align")
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
    def from_dict(cls, d: dict) -> "TrainConfig":
        """From ``to_dict`` (a saved train.json); older files lack the newer fields (defaults) and
        stored ``baseline`` as a bool (true: the dense baseline)."""
        d = dict(d)
        d["lora"] = LoraSettings(**d.get("lora", {}))
        return cls(**d)  # (__post_init__ reads a bool baseline)


PLAN_TRAINING = ("gumbel", "hard-em")


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


def parse_prune_layers(text: str, num_layers: int = 0) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): skip layers A..B-1 (0-based, like a Python slice); at least one layer stays."""
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


def prune_plan(config: TrainConfig, plan, hf_config):
    """The pruned baseline's layer block (``concept.flops.matched_prune``): FLOP-matched to the
    streaming model of this build plan at ``config.target_ratio`` and ``config.seq_len``."""
    from .flops import Shape, matched_prune

    vocabulary = plan.components["vocabulary"]
    policy = plan.components["length_policy"]
    classes = int(getattr(vocabulary.config, "size", 0)) + int(getattr(policy.cls, "uses_null_class", True))
    emit = int(getattr(policy.config, "emit", 1) or 1)
    removed = parse_prune_layers(config.prune_layers, plan.backbone_info.num_layers) if config.prune_layers else None
    return matched_prune(Shape.from_hf_config(hf_config), tuple(plan.split), classes, config.target_ratio,
                         config.seq_len, emit, removed)


def describe_prune(prune, split, by_hand: bool = False) -> str:
    """One line for the user (and train.json's reader): what was removed and which FLOPs that gives."""
    a, b = prune.removed
    text = (f"pruned baseline: layers {a}..{b - 1} removed ({b - a} of {prune.num_layers}, {prune.kept} kept"
            f"{', set by --prune-layers' if by_hand else ''}), forward FLOPs {prune.flop_ratio:.3f}x dense at T={prune.T}; "
            f"the streaming model's ideal at target ratio {prune.target_ratio} (split {','.join(map(str, split))}) "
            f"is {prune.target_flop_ratio:.3f}x")
    if not prune.met and not by_hand:
        text += (f". Whole layers cannot reach that target (one layer is {prune.layer_share:.3f}x dense, the "
                 f"embedding and LM head cost the rest): it used the closest, {prune.kept} kept "
                 f"layer{'s' * (prune.kept != 1)}")
    return text


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _finite(value):
    """Strict JSON: NaN / inf (e.g. a diagnostic with no concept in the batch) become null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def lr_lambda(config: TrainConfig):
    def f(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / (config.warmup + 1)
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return config.min_lr + (1 - config.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def resolved_attention(model, device) -> str | None:
    """For an attention backend that chooses per device (``auto``): the backend it uses here."""
    choice = getattr(getattr(model, "attention", None), "choice", None)
    return choice(device) if callable(choice) else None


def ratio_controllable(policy) -> bool:
    """The policy has a bias the ratio controller can move (``null_bias`` + ``keep_logit``)."""
    return hasattr(policy, "null_bias") and hasattr(policy, "keep_logit")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConceptError(f"--device {name}: not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConceptError(f"--device {name}: no CUDA device is available on this machine; use --device cpu (or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConceptError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                           f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


def micro_seed(seed: int, step: int, micro: int) -> int:
    """The seed of micro-batch ``micro`` of (0-based) ``step``: its Gumbel noise and dropout do not
    depend on which process computes it, nor on what ran before (exact resume)."""
    return (seed * 1_000_003 + step * 65_537 + micro) % 2 ** 63


class StepModule(nn.Module):
    """One training forward: the frozen teacher (when an objective reads it), the model and every
    loss term. One module, so that DDP / FSDP2 see every parameter the loss touches inside its
    forward (the MTP heads and the objectives read the model outside the model's own forward)."""

    def __init__(self, model: nn.Module, objectives: list, ce_weight: float, autocast, sync):
        super().__init__()
        self.model = model
        self.objectives, self.ce_weight, self.autocast, self.sync = objectives, ce_weight, autocast, sync
        self.teacher_needs = frozenset().union(*(o.teacher_needs for o in objectives))

    def forward(self, b: dict):
        """Returns (model output, total loss, {objective name: term}, seconds spent in the teacher)."""
        teacher, teacher_s = None, 0.0
        if self.teacher_needs:  # before the student: its graph never sees the adapters switched off
            from .teacher import teacher_forward

            self.sync()
            t0 = time.perf_counter()
            with self.autocast():
                teacher = teacher_forward(self.model, b["input_ids"], b["attention_mask"], b["document_ids"],
                                          self.teacher_needs)
            self.sync()
            teacher_s = time.perf_counter() - t0
        extra = {k: v for k, v in b.items() if k not in ("input_ids", "attention_mask", "document_ids")}
        with self.autocast():  # (extra: what an objective's `prepare` adds, e.g. Hard-EM's plan)
            out = self.model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["input_ids"],
                             document_ids=b["document_ids"], **extra)
        loss, terms = self.ce_weight * out.loss, {}
        for objective in self.objectives:
            terms[objective.name] = objective(self.model, b, out, teacher)
            loss = loss + terms[objective.name]
        return out, loss, terms, teacher_s


class Trainer:
    """One training run in a run folder (``out``)."""

    def __init__(self, out: Path, config: TrainConfig, build_config: BuildConfig, resume: bool,
                 dist: Dist | None = None):
        self.out, self.config, self.build_config = Path(out), config, build_config
        self.name = self.out.name  # the run's name (``out`` may still be its staging folder)
        self.staging: fs.Staging | None = None  # set while the run replaces an existing folder (``start(force=True)``)
        self.dist = dist or Dist()
        self.notes: list[str] = []  # warnings for the user (the CLI prints them)
        plan, self.device = self.check(config, build_config, self.dist)
        torch.manual_seed(config.seed)
        self.prune = None
        if config.baseline:
            loaded = build_backbone(plan)
            if config.baseline == "pruned":
                self.prune = prune_plan(config, plan, loaded.model.config)
                self.notes.append(describe_prune(self.prune, plan.split, by_hand=config.prune_layers is not None))
            removed = self.prune.removed if self.prune and self.prune.kept < self.prune.num_layers else None
            self.model = DenseModel(loaded.model, plan=plan, tokenizer=loaded.tokenizer, removed=removed,
                                    mtp_heads=config.mtp_heads)
        else:
            self.model = build(plan=plan)
            if plan.family == "planner-executor":  # what the executor is trained to write
                self.model.task, self.model.context_len = config.task or "reconstruct", config.context_len
            if not resume and (self.out / "modules.safetensors").is_file():  # the source run's weights
                from safetensors.torch import load_file

                from .builder import load_new_modules

                load_new_modules(self.model, load_file(self.out / "modules.safetensors"))  # (resume: _restore loads)
        if (self.out / "backbone.safetensors").is_file():  # randomly initialised backbones travel with the run
            from safetensors.torch import load_file

            self.model.backbone.load_state_dict(load_file(self.out / "backbone.safetensors"))
        add_lora(self.model.backbone, config.lora)
        if (self.out / "adapter.safetensors").is_file():  # the source run was trained: start from its adapters
            from safetensors.torch import load_file

            from .lora import load_lora_state_dict

            load_lora_state_dict(self.model.backbone, load_file(self.out / "adapter.safetensors"))
        if config.train_only == "new":  # the adapters stay injected (and saved) but frozen
            for p in self.model.backbone.parameters():
                p.requires_grad_(False)
        if getattr(self.model, "removed", None):  # the skipped layers' adapters never see a gradient
            start, stop = self.model.removed
            for layer in list(decoder(self.model.backbone).layers)[start:stop]:
                for p in layer.parameters():
                    p.requires_grad_(False)
        self.model.to(self.device)
        self.model.gradient_checkpointing = config.grad_checkpointing
        if resume:  # weights before any sharding; the optimizer state once the optimizer exists
            self._restore_weights()

        tokenizer = data.tokenizer_for(self.model)
        with self.dist.main_first():  # rank 0 fills the tokenisation cache, the others read it
            self.train_data = data.PackedSequences(
                data.read_documents(config.data, "train", config.text_field, encoding_errors=config.encoding_errors),
                tokenizer, config.seq_len, seed=config.seed)
            try:
                heldout = data.read_documents(config.data, "heldout", config.text_field,
                                              encoding_errors=config.encoding_errors)
                self.eval_data = data.PackedSequences(heldout, tokenizer, config.seq_len, seed=config.seed)
            except ConceptError as exc:  # small data: train anyway, evaluate later with `concept eval --data`
                self.eval_data = None
                self.notes.append(f"no held-out evaluation during training: {exc}")

        controls = config.ratio_control
        planned = plan.family == "planner-executor" and not config.baseline
        streaming = not config.baseline and not planned
        if planned:
            controls = "none"  # the plan length has its own controller (concept.plan_objectives)
        policy = getattr(self.model, "length_policy", None)
        if streaming and controls != "none" and not ratio_controllable(policy):
            self.notes.append(f"length policy {type(policy).__name__} sets its ratio by its own parameters; "
                              f"--ratio-control {controls} does nothing for it")
            controls = "none"
        if streaming and controls in ("loss", "both") and not hasattr(policy, "boundary_prob"):
            controls = "pi"
        # the controller always calibrates the NULL bias at step 0 (unless --ratio-control none); it tracks with pi/both
        self.pi = PIController(config.target_ratio, ki=config.pi_ki) if streaming and controls != "none" else None
        self.tracking = controls in ("pi", "both")
        if config.baseline == "dense" and config.distill:
            self.notes.append("--distill with the dense baseline: the teacher is this model without its adapters, so the "
                              "KL starts at 0 and only keeps the adapters close to the backbone (a regulariser)")
        if config.baseline and (config.ratio_warmup or config.usage_weight or config.placement):
            self.notes.append(f"a {config.baseline} baseline has no concepts: --ratio-warmup / --usage-weight / "
                              f"--placement do nothing")
        # the loss terms beyond the CE, each named in metrics.jsonl (concept.objectives)
        self.objectives = objectives_.from_config(config, streaming, controls in ("loss", "both"), self.target_ratio,
                                                  has_mtp=getattr(self.model, "mtp_heads", None) is not None,
                                                  planned=self.model if planned else None)
        self.step_module = StepModule(self.model, self.objectives, config.ce_weight, self.autocast, self._sync)
        self.teacher_needs = self.step_module.teacher_needs
        self.train_forward = self._wrap(self.step_module)  # DDP / FSDP2 under torchrun, else the module itself

        lora = [p for p in self.model.backbone.parameters() if p.requires_grad]
        groups = [{"params": lora, "lr": config.lr, "name": "lora"}] if lora else []
        for name, module in self.model.new_modules().items():
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": getattr(module, "learning_rate", None) or config.lr_new,
                               "name": name})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.step = 0
        self.last_row: dict = {}
        if resume:
            self._restore_state()
        self._stop = False
        self.attention = resolved_attention(self.model, self.device)
        derived = {}
        if self.attention:  # `auto`: record what it resolved to on this device
            derived["attention_resolved"] = self.attention
        if self.prune is not None:  # which layers the pruned baseline skips (concept.load reads it)
            derived["pruned"] = {**self.prune.to_dict(), "note": describe_prune(self.prune, plan.split,
                                                                             config.prune_layers is not None)}
        derived["distributed"] = {"mode": self.dist.mode, "world_size": self.dist.world_size,
                                  "global_batch": self.global_batch}
        self.derived = derived  # written to train.json by start / resume once everything is checked

    def _record(self, source: str | None) -> None:
        """train.json: the config, the source run and what training derived (resolved attention, pruned
        block, distribution); replaced atomically (a reader never sees it half-written)."""
        fs.write_atomic(self.out / TRAIN_FILE,
                        json.dumps({**self.config.to_dict(), "source": source, **self.derived}, indent=2))

    @property
    def micro_batches(self) -> int:
        """Micro-batches of ``batch`` rows per optimizer step, over all processes."""
        return self.config.grad_accum * self.dist.world_size

    @property
    def global_batch(self) -> int:
        return self.config.batch * self.micro_batches

    def _wrap(self, module: nn.Module):
        """The training forward under torchrun: DDP (gradients all-reduced in backward) or FSDP2
        (each decoder layer and the rest sharded over the ranks, gathered for its forward)."""
        if self.dist.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=False)
        if self.dist.mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in decoder(self.model.backbone).layers:
                fully_shard(layer)
            fully_shard(module)
            # FSDP2 initialises lazily in the root's first forward; calibration and evaluation call the layers
            # outside it, so initialise now (else each layer would take itself for a root)
            module._get_fsdp_state()._lazy_init()
        return module

    @contextmanager
    def gathered(self):
        """FSDP2: the root's parameters (embeddings, head, new modules) gathered whole, for a forward
        outside the training step (calibration, evaluation); the decoder layers gather their own."""
        if self.dist.mode != "fsdp2":
            yield
            return
        self.step_module.unshard()
        try:
            yield
        finally:
            self.step_module.reshard()

    @staticmethod
    def check(config: TrainConfig, build_config: BuildConfig, dist: Dist | None = None):
        """Validate a training config against the build (all problems at once, ``ConfigError``) before
        anything is loaded or written. Returns the resolved build plan and the device."""
        device = pick_device(config.device)
        if device.type == "cuda" and dist is not None and dist.active:
            device = torch.device("cuda", dist.local_rank)
        plan = resolve(build_config)
        problems = config.validate(plan.backbone_info.max_positions, plan.backbone_info.num_layers)
        attention = plan.components["attention"]
        check = getattr(attention.cls, "check_trainable", None)  # e.g. `flex` has no backward on CPU
        reason = check(device) if callable(check) and not config.baseline and plan.family == "streaming" else ""
        if reason:
            problems.append(f"attention '{attention.name}' cannot train on {device}: {reason}")
        policy = plan.components["length_policy"]
        planned = plan.family == "planner-executor"
        if planned and config.baseline == "pruned" and config.prune_layers is None:
            problems.append("baseline pruned: its default block is FLOP-matched to a streaming model's split and "
                            "concept ratio, which a planner-executor run does not have; choose the block with "
                            "--prune-layers START:STOP, or use --baseline dense")
        if planned and not config.baseline:
            problems += [f"{flag}: the planner-executor family has no {what}; drop it" for flag, given, what in (
                ("placement", config.placement, "keep decisions to place"),
                ("align", config.align, "deep stack to align"),
                ("distill", config.distill, "teacher distillation yet"),
                ("ratio-warmup", config.ratio_warmup, "concepts-per-token ratio (its plan length is set by the "
                                                      "planner's budget, `--set planner.budget=N` at build)"),
                ("train-only", config.train_only == "new", "frozen-adapter stage")) if given]
            if dist is not None and dist.mode == "fsdp2":
                problems.append("distributed fsdp2: the planner-executor's planner and E-step run as many forwards as "
                                "each rank's plans need, but FSDP2 gathers every layer's weights in a collective that "
                                "all ranks must enter together; use --distributed ddp")
        elif config.plan_training != "gumbel":
            problems.append(f"plan-training {config.plan_training}: only for planner-executor runs (`concept build "
                            f"--family planner-executor`); {'a baseline' if config.baseline else 'a streaming model'} "
                            f"has no planner to train")
        if (config.task is not None or config.context_len) and not (planned and not config.baseline):
            problems.append(f"task: --task / --context-len are for planner-executor runs (`concept build --family "
                            f"planner-executor`); {'a baseline' if config.baseline else 'this streaming model'} "
                            f"trains on next-token prediction of every row")
        if config.placement and not config.baseline and not planned and not getattr(policy.cls, "learned_placement", False):
            problems.append(f"placement: length policy '{policy.name}' has no per-token keep score that --placement "
                            f"could train (it decides by its own rule); build with --length-policy null, or drop "
                            f"--placement")
        if problems:
            raise ConfigError(problems)
        return plan, device

    def target_ratio(self, step: int | None = None) -> float:
        """The ratio curriculum's target at ``step`` (default: the step about to be trained)."""
        cfg = self.config
        return scheduled_ratio(self.step if step is None else step, cfg.steps, cfg.target_ratio, cfg.ratio_start,
                               cfg.ratio_warmup)

    def set_target(self, target: float) -> None:
        """Point the ratio controller (and a policy that tracks a target itself) at ``target``."""
        if self.pi is not None:
            self.pi.target = target
        policy = getattr(self.model, "length_policy", None)
        if hasattr(policy, "target_ratio"):
            if isinstance(policy.target_ratio, torch.Tensor):
                with torch.no_grad():
                    policy.target_ratio.fill_(target)
            else:
                policy.target_ratio = target

    # -- starting and resuming -----------------------------------------------------------------
    @classmethod
    def start(cls, source: str | Path, out: str | Path, config: TrainConfig, force: bool = False,
              dist: Dist | None = None) -> "Trainer":
        """A new run in ``out`` from a built (or trained) run folder ``source`` (under torchrun: every
        rank calls it; rank 0 writes). Everything is checked and the run is set up in a staging folder
        beside ``out`` (``concept.fs``): a new ``out`` appears once the run is set up, while an existing
        one (``force``) is replaced only when :meth:`train` has trained every step."""
        source, out, dist = Path(source), Path(out), dist or Dist()
        record = read_run(source)
        build_config = BuildConfig.from_dict(record["config"])
        config = dataclasses.replace(config, data=data.stored_source(config.data))  # resumable from any folder
        cls.check(config, build_config, dist)  # bad options fail before anything is written
        if out.exists() and out.resolve() == source.resolve() and read_train(out) is not None:
            raise RunFolderError(f"{out} is already a training run; use --resume, or pass another --out")
        fs.check_target(out, force, {"source run": source, "training data": data.local_path(config.data)})
        replace = out.exists() and any(out.iterdir())
        staging = fs.Staging(out)
        dist.on_main(staging.open)
        try:
            dist.on_main(cls._prepare, source, staging.path)
            trainer = cls(staging.path, config, build_config, resume=False, dist=dist)
            dist.on_main(trainer._record, str(source.resolve()))
            trainer.name = out.name
            if staging.swept:
                trainer.notes.append(f"removed {staging.path}, left by an earlier run into {out} that was killed")
            if replace:  # the old folder stays until training has finished (Trainer.train publishes)
                trainer.staging = staging
            else:
                dist.on_main(staging.publish)
                trainer.out = out
        except BaseException:
            if dist.is_main:  # nothing half-set-up is left behind, and `out` was never touched
                staging.discard()
            raise
        return trainer

    @staticmethod
    def _prepare(source: Path, out: Path) -> None:
        """Fill the empty staging folder ``out``: the source's record, weights, modules and adapters."""
        for name in ("modules.safetensors", "backbone.safetensors"):
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
        record = {k: v for k, v in read_run(source).items() if k != "export"}  # an export's ./backbone made absolute
        (out / RUN_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
        from safetensors.torch import save_file

        for stem in ("modules", "adapter"):  # continue from a trained model's modules and adapters
            state = checkpoint.read_tensors(source, stem)
            if state is None and stem == "adapter":  # an export: its adapters as a peft folder
                from .builder import PEFT_ADAPTER_DIR
                from .lora import peft_adapter_state

                state = peft_adapter_state(source / PEFT_ADAPTER_DIR)
            if state:
                save_file(state, out / f"{stem}.safetensors")
        (out / METRICS).write_text("")

    @classmethod
    def resume(cls, out: str | Path, dist: Dist | None = None, **overrides) -> "Trainer":
        """Continue the run in ``out``; only ``steps`` (and logging cadence) may differ from the saved config,
        ``batch`` / ``grad_accum`` as long as the global batch stays (a different number of processes), and
        the data (``data``, ``text_field``, ``encoding_errors``: a note says the data changed). Nothing is
        written until the checkpoint, the data and the device have been read and checked. A run killed
        before its first checkpoint starts again from step 0."""
        out, dist = Path(out), dist or Dist()
        record, config, source, changed = cls.resumed_config(out, dist.world_size, overrides)
        checkpoint.check_intact(out, f"start a new run from {source or 'its source'} instead of --resume")
        found = checkpoint.folder(out)
        trainer = cls(out, config, BuildConfig.from_dict(record["config"]), resume=found is not None, dist=dist)
        if found is None:
            trainer.notes.append(f"{out} has no checkpoint yet (stopped before its first one): training starts "
                                 f"again from step 0")
        if changed:
            trainer.notes.append(f"the data changed ({'; '.join(changed)}): training continues at step "
                                 f"{trainer.step} on the new data, so it no longer reproduces an uninterrupted run")
        dist.on_main(trainer._commit_resume, source)
        return trainer

    @classmethod
    def resumed_config(cls, out: Path, world_size: int, overrides: dict) -> tuple[dict, TrainConfig, str | None, list]:
        """What ``resume`` would continue, read and checked without loading anything: (the run record, the
        config with ``overrides`` applied, the source run, the data options that changed). Raises the
        errors ``resume`` raises for a folder that is not a run or options that conflict with it."""
        out = Path(out)
        record = read_run(out)
        saved = read_train(out)
        if saved is None:
            raise RunFolderError(f"{out} is not a training run (no {TRAIN_FILE}); start one with `concept train SOURCE --out DIR`")
        if record.get("export"):
            raise RunFolderError(f"{out} is an export (a published model), not a training run to continue; train on from "
                                 f"it in a new run: `concept train {out} --out DIR`")
        source = saved.pop("source", None)
        before = (saved.get("distributed") or {}).get("world_size", 1)
        for key in DERIVED[1:]:  # not config fields
            saved.pop(key, None)
        config = TrainConfig.from_dict(saved)
        overrides = dict(overrides)
        if "data" in overrides:
            overrides["data"] = data.stored_source(overrides["data"])
        changeable = {"steps", "eval_every", "checkpoint_every", "log_every", "device", "batch", "grad_accum"}

        def saved_value(key):
            return getattr(config.lora, key[5:]) if key.startswith("lora.") else getattr(config, key)

        def same(key, value):
            if key == "data":  # a relative path saved by an older run, or spelled differently
                return data.stored_source(saved_value(key)) == value
            return value == saved_value(key)

        conflicts = [f"{k}: the run was trained with {saved_value(k)!r}, you passed {v!r}"
                     for k, v in overrides.items() if k not in changeable | DATA_FIELDS and not same(k, v)]
        if conflicts:
            raise ConfigError(["--resume continues the saved configuration; these differ:", *conflicts])
        changed = [f"{k} {saved_value(k)!r} -> {v!r}" for k, v in overrides.items() if k in DATA_FIELDS and not same(k, v)]
        global_batch = config.batch * config.grad_accum * before
        for k, v in overrides.items():
            if k.startswith("lora."):
                setattr(config.lora, k[5:], v)
            else:
                setattr(config, k, v)
        if config.batch * config.grad_accum * world_size != global_batch:
            cls._fit_global_batch(config, global_batch, before, world_size, set(overrides))
        return record, config, source, changed

    def _commit_resume(self, source: str | None) -> None:
        self._record(source)
        self._truncate_metrics()

    @staticmethod
    def _fit_global_batch(config: TrainConfig, global_batch: int, before: int, world: int, given: set) -> None:
        """Resuming on another number of processes: keep the global batch, by the accumulation when the
        user did not choose --batch / --grad-accum; anything else is an error that says what to pass."""
        was = f"the run's global batch is {global_batch} rows per step ({before} process{'es' if before > 1 else ''})"
        if not given & {"batch", "grad_accum"} and global_batch % (config.batch * world) == 0:
            config.grad_accum = global_batch // (config.batch * world)
            return
        if global_batch % world:
            raise ConfigError([f"{world} processes do not divide the global batch: {was}; resume on a number of "
                               f"processes that divides {global_batch}"])
        per_rank = global_batch // world
        raise ConfigError([f"resuming with a different global batch: {was}, but --batch {config.batch} x "
                           f"{world} process{'es' if world > 1 else ''} x --grad-accum {config.grad_accum} = "
                           f"{config.batch * world * config.grad_accum}; pass --batch and --grad-accum whose "
                           f"product is {per_rank}"])

    def _restore_weights(self) -> None:
        from .builder import load_new_modules
        from .lora import load_lora_state_dict

        load_lora_state_dict(self.model.backbone, checkpoint.read_tensors(self.out, "adapter") or {})
        modules = checkpoint.read_tensors(self.out, "modules")
        if modules:
            load_new_modules(self.model, modules)

    def _restore_state(self) -> None:
        meta = checkpoint.read_meta(self.out)
        objects = checkpoint.read_objects(self.out)
        if objects.get("optimizer_format") == "fqn":  # keyed by parameter name: any number of processes
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, objects["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:  # older checkpoints: keyed by position
            self.optimizer.load_state_dict(objects["optimizer"])
        self.scheduler.load_state_dict(objects["scheduler"])
        if self.pi is not None and meta.get("pi"):
            self.pi.load_state_dict(meta["pi"])
        checkpoint.set_rng_state(objects["rng"])
        self.step = meta["step"]
        self._restore_objective_states(meta)

    def _restore_objective_states(self, meta: dict) -> None:
        """Objective states (e.g. the plan cache) from the checkpoint, checked against the SHA-256 in its
        state.json: a missing, corrupted or unfitting one is dropped with a warning and rebuilt."""
        for objective in self.objectives:
            if not hasattr(objective, "load_state_dict"):
                continue
            name = f"{objective.name}.json"
            data = checkpoint.read_file(self.out, name)
            expected = meta.get("files", {}).get(name)
            problem = ("it is missing" if data is None or expected is None else
                       "its checksum does not match the one saved with it" if hashlib.sha256(data).hexdigest() != expected
                       else None)
            if problem is None:
                try:
                    objective.load_state_dict(json.loads(data), self.model)
                    continue
                except (ValueError, TypeError, KeyError) as exc:
                    problem = f"it does not fit this run ({exc})"
            self.notes.append(f"warning: the checkpoint's {objective.name} state ({name}) is not used: {problem}; "
                              f"it is rebuilt from scratch (Hard-EM: every example's plan is searched again)")

    def _truncate_metrics(self) -> None:
        """Drop metrics logged after the checkpoint: the resumed run logs those steps again."""
        lines = (self.out / METRICS).read_text().splitlines() if (self.out / METRICS).is_file() else []
        kept = [line for line in lines if _parse(line) and _parse(line).get("step", 0) <= self.step]  # a torn last line is dropped
        fs.write_atomic(self.out / METRICS, "".join(line + "\n" for line in kept))

    def save_checkpoint(self) -> None:
        """Every rank gathers (FSDP2: a collective), rank 0 writes; an error on rank 0 stops every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model = self.model
        tensors = {"adapter": lora_state_dict(model.backbone),
                   "modules": {k: full_tensor(v) for k, v in model.new_state_dict().items()}}
        optimizer = get_optimizer_state_dict(model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        objects = {"optimizer": optimizer, "optimizer_format": "fqn", "scheduler": self.scheduler.state_dict(),
                   "rng": checkpoint.rng_state()}
        meta = {"step": self.step, "pi": self.pi.state_dict() if self.pi else None,
                "world_size": self.dist.world_size, "global_batch": self.global_batch}
        files = {f"{name}.json": json.dumps(state).encode() for name, state in self.objective_states().items()}
        meta["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        self.dist.on_main(self._write_checkpoint, tensors, objects, meta, files)

    def _write_checkpoint(self, tensors, objects, meta, files=None) -> None:
        try:
            checkpoint.write(self.out, tensors, objects, meta, files)
            # the adapters also as a standard peft folder (RUN/adapter/), loadable onto the plain HF backbone;
            # concept.load reads the checkpoint's copy first, so a torn peft folder never wins
            from .builder import PEFT_ADAPTER_DIR
            from .lora import save_peft_adapter

            save_peft_adapter(self.model.backbone, self.out / PEFT_ADAPTER_DIR, state=tensors["adapter"],
                              base_model_name_or_path=self.model.plan.backbone_info.name,
                              removed=getattr(self.model, "removed", None))
        except (OSError, RuntimeError, SafetensorError) as exc:  # e.g. a full disk (torch.save raises RuntimeError)
            prev = checkpoint.read_meta(self.out)
            where = f"the previous checkpoint (step {prev['step']}) is intact" if prev else "no earlier checkpoint exists"
            reason = getattr(exc, "strerror", None) or exc
            raise TrainingError(f"could not write the checkpoint at step {self.step} ({reason}); {where}") from exc

    # -- the loop ----------------------------------------------------------------------------------
    def batch(self, index: int) -> dict[str, torch.Tensor]:
        b = self.train_data.batch(index, self.config.batch)
        return {k: v.to(self.device) for k, v in b.items()}

    def autocast(self):
        """bf16 autocast (weights and optimizer state stay fp32) where ``--dtype`` asks for it: ``bf16`` on
        any device, ``auto`` on CUDA only."""
        bf16 = self.config.dtype == "bf16" or (self.config.dtype == "auto" and self.device.type == "cuda")
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    def forward(self, b):
        """The model alone on a batch (no objectives, no teacher), e.g. to calibrate the NULL bias."""
        with self.autocast():
            return self.model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["input_ids"],
                              document_ids=b["document_ids"])

    def _sync(self) -> None:
        if self.device.type == "cuda":  # honest timings of asynchronous kernels
            torch.cuda.synchronize(self.device)

    def train_step(self) -> dict:
        """One optimizer step over the global batch: this rank's ``grad_accum`` micro-batches (DDP /
        FSDP2 average the gradients over the ranks in backward), then every logged value reduced. Rows
        are ``curriculum_len`` tokens long (``--curriculum``; the context of ``--task continue`` in proportion)."""
        cfg, model = self.config, self.model
        length = curriculum_len(cfg, self.step)
        if cfg.task == "continue":  # the model reads it in split_example
            model.context_len = min(length - 1, max(1, round(cfg.context_len * length / cfg.seq_len)))
        try:
            return self._train_step(length)
        finally:
            if cfg.task == "continue":  # evaluation and the saved model read the full context
                model.context_len = cfg.context_len

    def _train_step(self, length: int) -> dict:
        cfg, model, dist = self.config, self.model, self.dist
        model.train()
        sampler = getattr(model, "sampler", None)
        if sampler is not None and hasattr(sampler, "tau"):
            sampler.tau = cfg.tau_start + (cfg.tau_end - cfg.tau_start) * self.step / max(1, cfg.steps - 1)
        streaming = not cfg.baseline
        target = self.target_ratio()
        if streaming:
            self.set_target(target)
        if self.pi is not None and self.pi.base is None:  # first step: calibrate the NULL bias on this batch
            with torch.no_grad(), self.gathered():
                b = self.batch(0)  # the same rows on every rank: the same bias
                out = self.forward(b)
            self.pi.calibrate(model.length_policy, out.head_logits, b["attention_mask"].bool(), out.shallow)
        start = time.perf_counter()
        names = [o.name for o in self.objectives]
        # summed over this rank's micro-batches, then over the ranks
        base = ["loss", "total_loss", "kept", "tokens", "teacher_s", "bad", "quantile", "spread"]
        sums = dict.fromkeys([*base, *names], 0.0)
        micros = self.micro_batches
        for m in range(cfg.grad_accum):
            j = dist.rank * cfg.grad_accum + m  # this micro-batch's place in the global batch
            b = {k: v[:, :length] for k, v in self.batch(self.step * micros + j).items()}
            for objective in self.objectives:  # e.g. Hard-EM's E-step puts the batch's plans in it
                if hasattr(objective, "prepare"):
                    with self.gathered():  # (FSDP2: the search runs outside the wrapped forward)
                        b = objective.prepare(model, b, self.step)
            torch.manual_seed(micro_seed(cfg.seed, self.step, j))
            last = m == cfg.grad_accum - 1
            no_sync = getattr(self.train_forward, "no_sync", None) if not last else None
            with no_sync() if no_sync else nullcontext():  # DDP: all-reduce once, in the last backward
                out, loss, terms, teacher_s = self.train_forward(b)
                (loss / cfg.grad_accum).backward()
            for name, term in terms.items():
                sums[name] += float(term.detach())
            for objective in self.objectives:  # statistics an objective acts on after the step (e.g. the quota)
                if hasattr(objective, "stats"):
                    for key, value in objective.stats(model, out).items():
                        sums[key] = sums.get(key, 0.0) + value
            sums["bad"] += 0.0 if torch.isfinite(loss) else 1.0
            sums["loss"] += out.loss.item()
            sums["total_loss"] += loss.item()
            sums["teacher_s"] += teacher_s
            valid = b["attention_mask"].bool()
            sums["tokens"] += int(valid.sum())
            if hasattr(out, "keep"):
                sums["kept"] += int(out.keep.sum()) * getattr(model, "emit", 1)
            if self.pi is not None and self.tracking:  # the controller's statistics, from every micro-batch
                q, spread = self.pi.statistics(model.length_policy, out.head_logits.detach(), valid,
                                               out.shallow.detach())
                sums["quantile"] += q
                sums["spread"] += spread
        total = dict(zip(sums, dist.sum(list(sums.values()), self.device)))
        mean = {k: v / micros for k, v in total.items()}  # per micro-batch, over the global batch
        if total["bad"]:
            self.optimizer.zero_grad(set_to_none=True)
            prev = checkpoint.read_meta(self.out)
            where = f"the last good checkpoint (step {prev['step']}) is intact" if prev else "no checkpoint was written yet"
            loss_value = mean["loss"] if not math.isfinite(mean["total_loss"]) else mean["total_loss"]
            raise TrainingError(f"the loss became {loss_value} at step {self.step + 1}; {where}. "
                                f"Try a lower --lr / --lr-new or a larger --clip.")
        diag = {}
        if (self.step + 1) % cfg.log_every == 0:  # before clipping, so spikes show
            from .diagnostics import grad_norms, step_diagnostics

            diag = {f"grad_norm/{k}": v for k, v in grad_norms(model).items()}
            if hasattr(out, "keep") or hasattr(out, "plan"):  # (this rank's last micro-batch)
                with torch.no_grad(), self.gathered():
                    diag.update(step_diagnostics(model, out, b))
        grad_norm = torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], cfg.clip)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step used
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._sync()
        seconds = time.perf_counter() - start
        row = {"step": self.step, "loss": mean["loss"], "total_loss": mean["total_loss"], "lr": lr,
               "grad_norm": float(full_tensor(grad_norm)), "tokens_per_s": total["tokens"] / seconds}
        row.update({name: mean[name] for name in names})  # each objective's term, by name
        # the objectives' statistics (``_``-prefixed ones are inputs of their after_step, not logged)
        row.update({k: mean[k] for k in mean if k not in row and k not in base and not k.startswith("_")})
        if cfg.curriculum:
            row["seq_len"] = length
            if cfg.task == "continue":
                row["context_len"] = model.context_len
        for objective in self.objectives:
            if hasattr(objective, "after_step"):  # e.g. the quota controller moves the <EOS> bias
                row.update(objective.after_step(model, mean))
        if self.teacher_needs:
            teacher_s = total["teacher_s"] / dist.world_size  # per process
            row.update(teacher_s=teacher_s, teacher_fraction=teacher_s / seconds)
        if hasattr(out, "keep"):
            ratio = total["kept"] / max(1, total["tokens"])
            row.update(ratio=ratio, target_ratio=target, null_bias=float(getattr(model.length_policy, "null_bias", 0.0)),
                       tau=getattr(sampler, "tau", None))
            if self.pi is not None and self.tracking:
                self.pi.apply(model.length_policy, mean["quantile"], mean["spread"], ratio)
        if dist.world_size > 1:
            row["world_size"] = dist.world_size
        row.update({k: v for k, v in diag.items() if k not in row})  # (the step's ratio is the global one)
        return row

    def objective_states(self) -> dict[str, dict]:
        """The state of every objective that keeps one (e.g. Hard-EM's plan cache), by name; under torchrun
        the union over the ranks (each caches the examples of its own micro-batches)."""
        states = {}
        for objective in self.objectives:
            if hasattr(objective, "state_dict"):
                state = objective.state_dict()
                if self.dist.world_size > 1:
                    state = objective.merge_states(self.dist.gather_objects(state))
                states[objective.name] = state
        return states

    def calibrate_ratio(self) -> None:
        """Re-estimate the NULL bias on ``calibration_batches`` training batches with the final weights
        (the batches after the last step: a pure function of the step, so resume stays exact)."""
        cfg, model = self.config, self.model
        if not cfg.baseline:
            self.set_target(cfg.target_ratio)  # the curriculum's end: the model is saved with the final target
        if self.pi is None or cfg.calibration_batches < 1:
            return
        from .calibration import decision_inputs

        was_training = model.training
        model.eval()  # the decisions the evaluated model will make (e.g. no LoRA dropout)
        try:
            with torch.no_grad(), self.gathered():  # only the shallow stack and the head are needed
                # the same rows on every rank
                batches = (self.batch(self.step * self.micro_batches + i) for i in range(cfg.calibration_batches))
                logits, valid, reset, h = decision_inputs(model, batches)
                reached = self.pi.calibrate_exact(model.length_policy, logits, valid, reset, h=h)
        finally:
            model.train(was_training)
        if abs(reached - cfg.target_ratio) > 0.05 * cfg.target_ratio:
            self.notes.append(f"the final calibration reached {reached:.4f} concepts per token, not the target "
                              f"{cfg.target_ratio}: the length policy cannot reach it with these settings")

    def evaluate(self) -> dict:
        """Held-out evaluation. Under torchrun every rank evaluates the same batches (FSDP2 needs every
        rank in each forward; the results are identical) and rank 0 logs them."""
        from .diagnostics import evaluate

        if self.eval_data is None:
            return {}

        batches = (self.eval_data.batch(i, self.config.batch) for i in range(self.config.eval_batches))
        with self.gathered():
            return evaluate(self.model, ({k: v.to(self.device) for k, v in b.items()} for b in batches),
                            controls=False)

    def log(self, row: dict) -> None:
        if self.dist.is_main:
            with open(self.out / METRICS, "a") as f:
                f.write(json.dumps(_finite(row)) + "\n")

    def _on_sigint(self, signum, frame):
        if self._stop:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop = True

    def train(self, progress=None) -> dict:
        """Run until ``config.steps``; returns the final held-out evaluation. A run replacing an existing
        folder (``start(force=True)``) publishes only here, once every step is trained; anything that stops
        it before (an error, Ctrl-C) discards it and leaves the old folder as it was."""
        try:
            self._loop(progress)
            if self.dist.is_main:
                self.plot()
            if self._stop:
                if self.staging is not None:
                    raise KeyboardInterrupt(f"interrupted at step {self.step}; {self.staging.dest} is unchanged "
                                            f"(--force replaces it only once training finishes) and the new run "
                                            f"was discarded")
                raise KeyboardInterrupt(f"interrupted at step {self.step}; checkpoint saved in {self.out}")
            if self.staging is not None:  # every step trained: the new run replaces the old folder now
                self.dist.on_main(self.staging.publish)
                self.out, self.staging = self.staging.dest, None
        except BaseException:
            if self.staging is not None and self.dist.is_main:  # an unfinished replacement: the old folder stays
                self.staging.discard()
            raise
        if self.last_row:
            return self.last_row.get("eval", {})
        return self.metrics()[-1].get("eval", {}) if self.dist.is_main and self.metrics() else {}

    def _loop(self, progress) -> None:
        cfg = self.config
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            while self.step < cfg.steps and not self._stop:
                row = self.train_step()
                if self.step == cfg.steps:
                    self.calibrate_ratio()
                    if self.pi is not None:
                        row["null_bias_calibrated"] = float(self.model.length_policy.null_bias)
                if self.eval_data is not None and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    row["eval"] = self.evaluate()
                self.log(row)
                self.last_row = row
                if progress is not None:
                    progress(row)
                if self.dist.world_size > 1:  # a Ctrl-C seen by one rank stops them all at the same step
                    self._stop = self.dist.any(self._stop)
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps or self._stop:
                    self.save_checkpoint()
        finally:
            signal.signal(signal.SIGINT, previous)

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / METRICS).read_text().splitlines() if line.strip()]

    def plot(self) -> Path | None:
        from .plots import planner_curves, training_curves

        if getattr(self.model, "family", None) == "planner-executor":  # curves.png, then its planner diagnostics
            planner_curves({self.name: self.metrics()}, self.out / "planner.png")
        return training_curves(self.metrics(), self.out / "curves.png", self.config.target_ratio if not self.config.baseline else None)
