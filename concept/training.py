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
layers) train a run of that family, its build derived from the source's (``concept.baselines``).
AdamW, linear warmup then cosine decay, gradient clipping and accumulation, bf16 on GPU (the
frozen base stored in bf16, LoRA, new modules and optimizer state fp32, under autocast:
``concept.precision``), optional gradient checkpointing. The data position is a pure function of the step and each micro-batch's
randomness is seeded from (seed, step, micro-batch), so a resumed run reproduces the
uninterrupted loss curve exactly. Under ``torchrun`` the same loop runs with DDP or FSDP2
(``concept.distributed``): the global batch is ``batch x world_size x grad_accum`` and the loss
curve is that of one process running the same global batch.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import checkpoint, data, distributed_wrap, lora_triton, memory, run_files, tracking, training_run
from .backbone import decoder
from .compiled import compile_model, compiled_choice
from .builder import build, load_new_modules
from .checkpoint_state import CheckpointState, restore_weights
from .config import AUTO_CHOICE, BuildConfig, resolve
from .diagnostics import evaluate
from .distributed import Dist, pick_device
from .errors import ConfigError, TrainingError  # noqa: F401 (TrainingError: API)
from .lora import add_lora, load_lora_state_dict
from .optimizer import adamw
from .plots import training_curves
from .precision import autocast, compute_dtype, store_frozen_base
from .syncs import to_device
from .training_loop import TrainingLoop
from .training_run import DATA_FIELDS, DERIVED, METRICS  # noqa: F401 (also this module's API)
from .versions import git_sha, versions
from .train_step import (  # noqa: F401 (STEP_SUMS, QueuedStep, micro_seed: also this module's API)
    STEP_SUMS,
    QueuedStep,
    StepModule,
    StepRunner,
    micro_seed,
    skip_error,
)
from .train_config import (  # noqa: F401 (curriculum_len, parse_curriculum: also this module's API)
    curriculum_len,
    foreign_options,
    missing_options,
    parse_curriculum,
    recorded,
)

if TYPE_CHECKING:  # (composed when asked for: importing this module imports no family)
    from .train_config import TrainConfig


def __getattr__(name: str):
    """``TrainConfig`` (also this module's API), composed when asked for: importing this module imports no family
    (``concept train RUN`` imports only the run's)."""
    if name == "TrainConfig":
        # lazy: composing every family's options imports them all (``concept train RUN`` needs only its own)
        from .train_config import composed

        return composed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def training_model(family, plan, config: TrainConfig, out: Path, resume: bool):
    """The model of the run's ``family`` (``concept.builder.build``), set up for what ``config`` trains it for
    (``Family.prepare``), with the source run's new modules (resume: ``trained_model`` restores them)."""
    model = build(resolution=plan)
    family.prepare(model, config.to_dict())
    if not resume and (out / "modules.safetensors").is_file():  # the source run's weights
        file = out / "modules.safetensors"
        load_new_modules(model, run_files.read_weights(file), file)
    return model


def trained_model(family, plan, config: TrainConfig, run: training_run.RunFolder, resume: bool, dtype,
                  device, dist: Dist | None = None) -> nn.Module:
    """The family's model with the run's weights and LoRA adapters, on the device, with what does not train
    frozen (resume: the checkpoint's weights)."""
    out = run.out
    model = training_model(family, plan, config, out, resume)
    if (out / "backbone.safetensors").is_file():  # randomly initialised backbones travel with the run
        run_files.load_weights(model.backbone, out / "backbone.safetensors", "backbone")
    add_lora(model.backbone, config.lora)
    if (out / "adapter.safetensors").is_file():  # the source run was trained: start from its adapters
        file = out / "adapter.safetensors"
        adapter = run_files.read_weights(file)
        expected = {k: v for k, v in model.backbone.state_dict().items() if "lora_" in k}
        run_files.check_weights(adapter, expected, file, "LoRA adapters")
        load_lora_state_dict(model.backbone, adapter)
    if config.train_only == "new":  # the adapters stay injected (and saved) but frozen
        for p in model.backbone.parameters():
            p.requires_grad_(False)
    if getattr(model, "removed", None):  # the skipped layers' adapters never see a gradient
        start, stop = model.removed
        for layer in list(decoder(model.backbone).layers)[start:stop]:
            for p in layer.parameters():
                p.requires_grad_(False)
    store_frozen_base(model, dtype)  # bf16: cast once here, never inside a step
    model.to(device)
    model.gradient_checkpointing = config.grad_checkpointing
    # (off: eager; auto: decided for the device, eager where the run's sharding cannot compile)
    compile_model(model, config.compile, device=device, refused=sharding_refusal(dist))
    if resume:  # weights before any sharding; the optimizer state once the optimizer exists
        restore_weights(run, model)
    return model


def training_problems(family, config: TrainConfig, plan, device, dist) -> list[str]:
    """Problems of ``config`` for a run of ``family``: a config composed for another family, its own checks, then
    the options only another family reads."""
    missing = missing_options(config, family)
    if missing:  # (the Python API: a config composed for another family)
        return [f"the training config has no {', '.join(missing)}, options of the {family.name} family: make it "
                f"with concept.train_config.for_family({family.name!r})"]
    return family.check_training(config, plan, device, dist) + [
        f"{flag} {value}: only for {owner} runs (`concept build --family {owner.split(' or ')[0]}`); a {family.name} "
        f"model does not read it" for flag, value, owner in foreign_options(config, family)]


def sharding_refusal(dist: Dist | None) -> str | None:
    """Why a run distributed as ``dist`` cannot compile its model, or None: under FSDP2 its hooks around each decoder
    layer (the layer's parameters gathered and freed) are excluded from dynamo's tracing, so a fullgraph graph refuses
    them (the first step crashed on it)."""
    if dist is not None and dist.mode == "fsdp2":
        return ("FSDP2's hooks around each decoder layer (its parameters gathered and freed) cannot be traced into "
                "the compiled graphs (fullgraph)")
    return None


def check_training(config: TrainConfig, build_config: BuildConfig, dist: Dist | None = None):
    """Validate a training config against the build (all problems at once, ``ConfigError``) before
    anything is loaded or written. Returns the resolved build plan and the device."""
    device = pick_device(config.device)
    if device.type == "cuda" and dist is not None and dist.active:
        device = torch.device("cuda", dist.local_rank)
    plan = resolve(build_config)
    problems = config.validate(plan.backbone_info.max_positions, plan.backbone_info.num_layers)
    problems += training_problems(plan.family_object, config, plan, device, dist)
    if config.lora.kernel == "triton":
        problems += [p for p in [lora_triton.why_not(device)] if p]
    sharded = sharding_refusal(dist)
    if sharded and config.compile not in ("off", AUTO_CHOICE):
        problems.append(f"--compile {config.compile} with --distributed {dist.mode}: {sharded}; train with "
                        f"--distributed ddp, or without --compile (--compile auto trains eagerly under {dist.mode})")
    if not problems:  # a micro-batch that cannot fit: a clear error, not an out-of-memory kill
        problems += [p for p in [memory.training_problem(plan.backbone_info, config, device)] if p]
    problems += tracking.problems(config.report_to)
    if problems:
        raise ConfigError(problems)
    return plan, device


class Trainer:
    """One training run in a run folder (``out``).

    Its parts are asked directly: ``run`` (the folder, its lock and records: ``concept.training_run.RunFolder``),
    ``runner`` (the step counter, the queued steps and their log: ``concept.train_step.StepRunner``) and ``loop``
    (the cadence, Ctrl-C, the metrics: ``concept.training_loop.TrainingLoop``); ``out`` and ``step`` stand for
    ``run.out`` and ``runner.step`` (what the CLI, the recipes and the tests read most)."""

    def __init__(self, out: Path, config: TrainConfig, build_config: BuildConfig, resume: bool,
                 dist: Dist | None = None):
        self.run = training_run.RunFolder(out)  # the folder, its lock and records (``out``: ``run.out``)
        self.config, self.build_config = config, build_config
        self.dist = dist or Dist()
        self.notes: list[str] = []  # warnings for the user (the CLI prints them)
        plan, self.device = self.check(config, build_config, self.dist)
        self.dtype = compute_dtype(config.dtype, self.device)  # the frozen base's storage and autocast dtype
        torch.manual_seed(config.seed)
        self.family = plan.family_object  # what it trains (a baseline too: the dense and pruned families)
        self.model = trained_model(self.family, plan, config, self.run, resume, self.dtype, self.device, self.dist)
        with self.dist.main_first():  # rank 0 fills the shard cache, the others read it
            read = data.open_training(config, data.tokenizer_for(self.model))
        self.train_data, self.eval_data, self.data_fingerprint = read.train, read.heldout, read.fingerprint
        if read.no_heldout:  # small data: train anyway, evaluate later with `concept eval --data`
            self.notes.append(f"no held-out evaluation during training: {read.no_heldout}")
        # the loss terms beyond the CE and the controllers, each named in metrics.jsonl (concept.objectives)
        self.objectives = self.family.objectives(config, self.model, lambda: self.step, self.notes)
        self.step_module = StepModule(self.model, self.objectives, config.ce_weight, self.autocast)
        self.teacher_needs = self.step_module.teacher_needs
        self.train_forward = distributed_wrap.wrap(self.step_module, decoder(self.model.backbone).layers, self.dist,
                                                   self.device)  # DDP / FSDP2 under torchrun, else the module itself
        self.optimizer = adamw(self.model, config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.runner = self._step_runner()  # the step counter, the queued steps and their log (concept.train_step)
        self.checkpoint_state = CheckpointState(self.run, self.model, self.optimizer, self.scheduler, self.objectives,
                                                self.dist, self.global_batch, self.data_fingerprint, self.record)
        if resume:
            self.step = self.checkpoint_state.restore(self.notes)
        self.loop = self._training_loop()  # the cadence, Ctrl-C, the metrics and trackers (concept.training_loop)
        self.attention = resolved_attention(self.model, self.device)
        derived = {}
        if self.attention:  # `auto`: record what it resolved to on this device
            derived["attention_resolved"] = self.attention
        if config.compile == AUTO_CHOICE:  # and what `--compile auto` runs here, and why
            derived["compile_resolved"] = compiled_choice(self.model)
            self.notes.append(f"--compile auto: {self.model.compile_reason}")
        derived["distributed"] = {"mode": self.dist.mode, "world_size": self.dist.world_size,
                                  "global_batch": self.global_batch}
        self.derived = derived  # written to train.json by start / resume once everything is checked

    @property
    def out(self) -> Path:
        return self.run.out

    def _record(self, source: str | None) -> None:
        """train.json: the config, the source run and what training derived (resolved attention, pruned
        block, distribution)."""
        self.run.write_record(self.record(source), source)

    def record(self, source: str | None) -> dict:
        """train.json's content: the config (only the options the run's family reads), the source run, what
        training derived and what the run was made with (library versions, the git commit of a checkout)."""
        config = recorded(self.config, self.family)
        return {**config, "source": source, **self.derived, "versions": versions(), "git_sha": git_sha()}

    @property
    def micro_batches(self) -> int:
        """Micro-batches of ``batch`` rows per optimizer step, over all processes."""
        return self.config.grad_accum * self.dist.world_size

    @property
    def global_batch(self) -> int:
        return self.config.batch * self.micro_batches

    def gathered(self):
        """FSDP2: the root's parameters gathered whole for a forward outside the training step (calibration,
        evaluation; ``concept.distributed_wrap``); else nothing."""
        return distributed_wrap.gathered(self.step_module, self.dist)

    check = staticmethod(check_training)  # (before anything is loaded or written: ``start``, tests, recipes)

    # -- starting and resuming -----------------------------------------------------------------
    @classmethod
    def start(cls, source: str | Path, out: str | Path, config: TrainConfig, force: bool = False,
              dist: Dist | None = None) -> "Trainer":
        """A new run in ``out`` from a built (or trained) run folder ``source`` (under torchrun: every
        rank calls it; rank 0 writes). Everything is checked and the run is set up in a staging folder
        beside ``out`` (``concept.fs``) under ``out``'s lock, held until :meth:`train` ends: a new ``out``
        appears once the run is set up, while an existing one (``force``: a run folder, never anything else)
        is replaced only when :meth:`train` has trained every step."""
        return training_run.start(cls, source, out, config, force, dist)

    @classmethod
    def resume(cls, out: str | Path, dist: Dist | None = None, accept_data_change: bool = False,
               **overrides) -> "Trainer":
        """Continue the run in ``out``; only ``steps`` (and logging cadence) may differ from the saved config,
        ``batch`` / ``grad_accum`` as long as the global batch stays (a different number of processes), and
        the data (``data``, ``text_field``, ``encoding_errors``: a note says the data changed; data whose
        documents changed under the same name gets a warning, or a note with ``accept_data_change``).

        The run's lock is held from here until :meth:`train` ends (a second writer is refused), and what a
        writer killed in it left is swept first. Every file read is checked before anything is written:
        train.json, the checkpoint (``state.json``, the SHA-256 of its weights and trainer.pt, the build and
        backbone fingerprints), metrics.jsonl, the data and the device; a failed resume leaves the folder
        byte-identical. train.json is rewritten with the first new checkpoint, so a resume stopped before it
        (a full disk, Ctrl-C, a kill) leaves it as it was. A run killed before its first checkpoint starts
        again from step 0."""
        return training_run.resume(cls, out, dist, accept_data_change, **overrides)

    resumed_config = staticmethod(training_run.resumed_config)
    _fit_global_batch = staticmethod(training_run.fit_global_batch)  # (tests call it)

    def save_checkpoint(self) -> None:
        """The checkpoint of this step (``concept.checkpoint_state``): every rank gathers, rank 0 writes."""
        self.checkpoint_state.save(self.step)

    def release(self) -> None:
        """Release the run's lock (``train`` does when it ends)."""
        self.run.release()

    # -- the steps (concept.train_step) ---------------------------------------------------------------
    def batch(self, index: int) -> dict[str, torch.Tensor]:
        b = self.train_data.batch(index, self.config.batch)
        return {k: to_device(v, self.device) for k, v in b.items()}  # (on CUDA: no wait for the step before)

    def autocast(self):
        """bf16 autocast where ``--dtype`` asks for it (``bf16`` on any device, ``auto`` on CUDA only): every
        use of the model (a bf16-stored base needs it), the backward excepted (``concept.precision``)."""
        return autocast(self.dtype, self.device)

    def forward(self, b):
        """The model alone on a batch (no objectives, no teacher), e.g. to calibrate the NULL bias."""
        return self.runner.model_forward(b)

    def _training_loop(self) -> TrainingLoop:
        """The loop over this run's steps; the step and the checkpoint through the trainer (tests replace them)."""
        return TrainingLoop(self.config, self.runner, self.run, self.dist, self.objectives,
                            queue_step=lambda: self.queue_step(), save=lambda: self.save_checkpoint(),
                            evaluate=self.evaluate if self.eval_data is not None else None,
                            skip_error=self.skip_error, autocast=self.autocast, record=self.record, plot=self.plot)

    def _step_runner(self) -> StepRunner:
        """The step machinery over this run's training forward, objectives, optimizer and data."""
        return StepRunner(self.config, self.model, self.train_forward, self.objectives, self.optimizer, self.scheduler,
                          self.dist, self.device, batch=self.batch, autocast=self.autocast, gathered=self.gathered,
                          diagnostics=self.family.step_diagnostics, note=lambda text: self.notes.append(text))

    @property
    def step(self) -> int:
        """The steps trained (``StepRunner.step``)."""
        return self.runner.step

    @step.setter
    def step(self, value: int) -> None:
        self.runner.step = value

    def queue_step(self) -> None:
        """One optimizer step, queued on the device (:meth:`concept.train_step.StepRunner.queue_step`)."""
        self.runner.queue_step()

    def read_log(self, keep: int = 0) -> list[dict]:
        """The queued steps' rows but the last ``keep`` (:meth:`concept.train_step.StepRunner.read_log`)."""
        return self.runner.read_log(keep)

    def train_step(self) -> dict:
        """One optimizer step, its values read now (:meth:`queue_step`, then :meth:`read_log`): its row. A step
        whose loss or gradients were not finite raises ``TrainingError`` (nothing changed: it was skipped)."""
        self.queue_step()
        rows = self.read_log()
        if rows[-1].get("skipped"):
            raise self.skip_error(rows[-1])
        return rows[-1]

    def skip_error(self, row: dict) -> TrainingError:
        """The error of a step that was skipped (``read_log``): its loss or gradients were not finite."""
        prev = checkpoint.read_meta(self.out)
        return skip_error(row, prev["step"] if prev else None)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out evaluation. Under torchrun every rank evaluates the same batches (FSDP2 needs every
        rank in each forward; the results are identical) and rank 0 logs them."""
        if self.eval_data is None:
            return {}

        batches = (self.eval_data.batch(i, self.config.batch) for i in range(self.config.eval_batches))
        with self.gathered(), self.autocast():
            return evaluate(self.model, ({k: to_device(v, self.device) for k, v in b.items()} for b in batches),
                            controls=False)

    # -- the loop (concept.training_loop) -----------------------------------------------------------------
    def train(self, progress=None) -> dict:
        """Run until ``config.steps`` (:meth:`concept.training_loop.TrainingLoop.train`): publishes a replacing
        run once every step is trained, else discards it; returns the final held-out evaluation."""
        return self.loop.train(progress)

    def metrics(self) -> list[dict]:
        return self.run.metrics()

    def plot(self) -> Path | None:
        """curves.png (loss, held-out NLL and, where there is one, the concept ratio), then the family's own."""
        rows = self.metrics()
        self.family.plots(self.run.name, rows, self.out)
        return training_curves(rows, self.out / "curves.png")
