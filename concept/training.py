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
decay, gradient clipping and accumulation, bf16 on GPU (the frozen base stored in bf16, LoRA, new
modules and optimizer state fp32, under autocast: ``concept.precision``), optional gradient
checkpointing. The data position is a pure function of the step and each micro-batch's
randomness is seeded from (seed, step, micro-batch), so a resumed run reproduces the
uninterrupted loss curve exactly. Under ``torchrun`` the same loop runs with DDP or FSDP2
(``concept.distributed``): the global batch is ``batch x world_size x grad_accum`` and the loss
curve is that of one process running the same global batch.
"""
from __future__ import annotations

import hashlib
import json
import math
import signal
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from . import checkpoint, data, fingerprint, fs, memory, run_files, tracking, training_run
from .backbone import decoder
from .compiled import compile_model
from .baselines import Baseline
from .builder import (
    PEFT_ADAPTER_DIR,
    backbone_folder,
    build,
    load_new_modules,
    read_run,
)
from .config import BuildConfig, resolve
from .diagnostics import evaluate
from .distributed import Dist, full_tensor, pick_device
from .errors import ConceptError, ConfigError, RunFolderError, TrainingError  # noqa: F401 (TrainingError: API)
from .lora import (
    add_lora,
    load_lora_state_dict,
    lora_state_dict,
    save_peft_adapter,
)
from .objectives import overrides
from .plots import training_curves
from .precision import autocast, compute_dtype, store_frozen_base
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
from .train_config import (  # noqa: F401 (TrainConfig, curriculum_len, parse_curriculum: also this module's API)
    TrainConfig,
    curriculum_len,
    foreign_options,
    parse_curriculum,
    recorded,
)


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


class FamilyTraining:
    """What trains without ``--baseline``: the build's family's model (``concept.builder.build``), asked
    through its :class:`concept.components.Family` methods."""

    def __init__(self, family):
        self.family = family
        self.name = family.name

    def __getattr__(self, name):  # check_training, objectives, plots, step_diagnostics: the family's
        return getattr(self.family, name)

    @property
    def what(self) -> str:
        return f"a {self.name} model"

    def notes(self, config) -> list[str]:
        return []

    def check_training(self, config, plan, device, dist) -> list[str]:
        return self.family.check_training(config, plan, device, dist) + [
            f"{flag} {value}: only for {owner} runs (`concept build --family {owner}`); {self.what} does not read it"
            for flag, value, owner in foreign_options(config, self.family)]

    def training_model(self, plan, config, out: Path, resume: bool, notes: list):
        model = build(resolution=plan)
        self.family.prepare(model, config.to_dict())
        if not resume and (out / "modules.safetensors").is_file():  # the source run's weights
            file = out / "modules.safetensors"
            load_new_modules(model, run_files.read_weights(file), file)  # (resume: _restore loads)
        return model

    def derived(self, config, plan) -> dict:
        return {}


def training_kind(config: TrainConfig, plan):
    """What a run trains: a baseline (``--baseline``) or the build's family."""
    return Baseline(config.baseline) if config.baseline else FamilyTraining(plan.family_object)


class Trainer:
    """One training run in a run folder (``out``)."""

    def __init__(self, out: Path, config: TrainConfig, build_config: BuildConfig, resume: bool,
                 dist: Dist | None = None):
        self.run = training_run.RunFolder(out)  # the folder, its lock and records (``out``: ``run.out``)
        self.config, self.build_config = config, build_config
        self.dist = dist or Dist()
        self.notes: list[str] = []  # warnings for the user (the CLI prints them)
        plan, self.device = self.check(config, build_config, self.dist)
        self.dtype = compute_dtype(config.dtype, self.device)  # the frozen base's storage and autocast dtype
        torch.manual_seed(config.seed)
        self.kind = training_kind(config, plan)
        self.model = self._training_model(plan, resume)
        self.train_data, self.eval_data = self._open_data()
        built = read_run(self.out)["config"]
        self.origin = checkpoint.fingerprints(built, backbone_folder(built), self.data_fingerprint)
        self.notes += self.kind.notes(config)
        # the loss terms beyond the CE and the controllers, each named in metrics.jsonl (concept.objectives)
        self.objectives = self.kind.objectives(config, self.model, lambda: self.step, self.notes)
        self.preparing = [o for o in self.objectives if overrides(o, "prepare")]  # (costly under FSDP2: gathers)
        self.step_module = StepModule(self.model, self.objectives, config.ce_weight, self.autocast, self._sync)
        self.teacher_needs = self.step_module.teacher_needs
        self.train_forward = self._wrap(self.step_module)  # DDP / FSDP2 under torchrun, else the module itself
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.runner = self._step_runner()  # the step counter, the queued steps and their log (concept.train_step)
        self.last_row: dict = {}
        self.trackers: list = []  # --report-to: opened by train()
        if resume:
            self._restore_state()
        self._stop = False
        self.attention = resolved_attention(self.model, self.device)
        derived = {}
        if self.attention:  # `auto`: record what it resolved to on this device
            derived["attention_resolved"] = self.attention
        derived.update(self.kind.derived(config, plan))  # e.g. which layers the pruned baseline skips
        derived["distributed"] = {"mode": self.dist.mode, "world_size": self.dist.world_size,
                                  "global_batch": self.global_batch}
        self.derived = derived  # written to train.json by start / resume once everything is checked

    def _training_model(self, plan, resume: bool) -> nn.Module:
        """The kind's model with the run's weights and LoRA adapters, on the device, with what does not train
        frozen (resume: the checkpoint's weights)."""
        config = self.config
        model = self.kind.training_model(plan, config, self.out, resume, self.notes)
        if (self.out / "backbone.safetensors").is_file():  # randomly initialised backbones travel with the run
            run_files.load_weights(model.backbone, self.out / "backbone.safetensors", "backbone")
        add_lora(model.backbone, config.lora)
        if (self.out / "adapter.safetensors").is_file():  # the source run was trained: start from its adapters
            file = self.out / "adapter.safetensors"
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
        store_frozen_base(model, self.dtype)  # bf16: cast once here, never inside a step
        model.to(self.device)
        model.gradient_checkpointing = config.grad_checkpointing
        compile_model(model, config.compile)  # (off: eager)
        if resume:  # weights before any sharding; the optimizer state once the optimizer exists
            self._restore_weights(model)
        return model

    def _open_data(self):
        """The training batches and the held-out ones (None, with a note, when the data is too small): read from
        token shards (concept.shards: tokenised once, memory-mapped). ``--eval-data`` replaces the held-out
        split of the training data for the periodic evaluation (all of it; a built-in corpus: its held-out split)."""
        config = self.config
        tokenizer = data.tokenizer_for(self.model)
        read = dict(text_field=config.text_field, encoding_errors=config.encoding_errors,
                    data_split=config.data_split, streaming=config.streaming)
        with self.dist.main_first():  # rank 0 fills the shard cache, the others read it
            tokens = data.open_tokens(config.data, "train", tokenizer, **read)
            # (a checkpoint records what it trained on: the documents of the train and held-out splits)
            self.data_fingerprint = fingerprint.of_digests(tokens.digest, *filter(None, [tokens.heldout_digest]))
            train = data.PackedSequences(tokens, None, config.seq_len, seed=config.seed)
            try:
                if config.eval_data is not None:
                    split = "heldout" if data.builtin_corpus(config.eval_data) else "all"
                    heldout = data.open_tokens(config.eval_data, split, tokenizer, text_field=config.text_field,
                                               encoding_errors=config.encoding_errors)
                else:
                    heldout = data.open_tokens(config.data, "heldout", tokenizer, **read)
                return train, data.PackedSequences(heldout, None, config.seq_len, seed=config.seed)
            except ConceptError as exc:  # small data: train anyway, evaluate later with `concept eval --data`
                self.notes.append(f"no held-out evaluation during training: {exc}")
                return train, None

    def _optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable LoRA parameters and each new module (its own learning rate if it has one)."""
        config = self.config
        lora = [p for p in self.model.backbone.parameters() if p.requires_grad]
        groups = [{"params": lora, "lr": config.lr, "name": "lora"}] if lora else []
        for name, module in self.model.new_modules().items():
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": getattr(module, "learning_rate", None) or config.lr_new,
                               "name": name})
        # fused: a step whose loss or gradients are not finite is skipped on the device (``found_inf``, set by
        # queue_step), its step counters too, and the counters live on the device (no host read)
        return torch.optim.AdamW(groups, weight_decay=config.weight_decay, fused=True)

    @property
    def out(self) -> Path:
        return self.run.out

    @property
    def staging(self) -> fs.Staging | None:  # (the CLI asks whether the run replaces a folder)
        return self.run.staging

    def _record(self, source: str | None) -> None:
        """train.json: the config, the source run and what training derived (resolved attention, pruned
        block, distribution)."""
        self.run.write_record(self.record(source), source)

    def record(self, source: str | None) -> dict:
        """train.json's content: the config (only the options the run's family reads), the source run, what
        training derived and what the run was made with (library versions, the git commit of a checkout)."""
        own = self.kind.family if isinstance(self.kind, FamilyTraining) else None
        config = self.config.to_dict() if own is None else recorded(self.config, own)
        return {**config, "source": source, **self.derived, "versions": versions(), "git_sha": git_sha()}

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
        kind = training_kind(config, plan)
        problems += kind.check_training(config, plan, device, dist)
        if not problems:  # a micro-batch that cannot fit: a clear error, not an out-of-memory kill
            problems += [p for p in [memory.training_problem(plan.backbone_info, config, device)] if p]
        if dist is not None and dist.mode == "fsdp2":
            problems += [f"{flag}: it rewrites code rows in place, which FSDP2's sharded parameters do not allow; "
                         f"use --distributed ddp" for flag, value in (("revive-after", config.revive_after),
                                                                     ("kmeans-init", config.kmeans_init)) if value]
        problems += tracking.problems(config.report_to)
        if problems:
            raise ConfigError(problems)
        return plan, device

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

    def _note_data_change(self, meta: dict | None, changed: list[str], accepted: bool) -> None:
        """Say how the data differs from what the checkpoint was trained on: another --data (a note), or the
        same --data whose documents changed (a warning, unless ``accepted``)."""
        recorded = ((meta or {}).get("fingerprints") or {}).get("data")
        same = recorded is None or recorded == self.data_fingerprint
        lost = f"training continues at step {self.step} on the new data, so it no longer reproduces an uninterrupted run"
        if changed:
            self.notes.append(f"the data changed ({'; '.join(changed)}): " + (
                lost if not same or recorded is None else
                "its documents are the same as before, so the run still reproduces an uninterrupted one"))
        elif not same and accepted:
            self.notes.append(f"the data {self.config.data or '(default corpus)'} changed since the checkpoint at step "
                              f"{self.step} (accepted with --accept-data-change): {lost}")
        elif not same:
            self.notes.append(f"warning: the documents of --data {self.config.data or '(default corpus)'} changed since "
                              f"the checkpoint at step {self.step} was written: {lost}; restore the data to continue "
                              f"exactly, or pass --accept-data-change to accept the change")

    resumed_config = staticmethod(training_run.resumed_config)
    _fit_global_batch = staticmethod(training_run.fit_global_batch)  # (tests call it)

    def _restore_weights(self, model) -> None:
        load_lora_state_dict(model.backbone, checkpoint.read_tensors(self.out, "adapter") or {})
        modules = checkpoint.read_tensors(self.out, "modules")
        if modules:
            load_new_modules(model, modules)

    def _restore_state(self) -> None:
        meta = checkpoint.read_meta(self.out)
        objects = checkpoint.read_objects(self.out)
        try:
            if objects.get("optimizer_format") == "fqn":  # keyed by parameter name: any number of processes
                from torch.distributed.checkpoint.state_dict import (
                    StateDictOptions,
                    set_optimizer_state_dict,
                )

                set_optimizer_state_dict(self.model, self.optimizer, objects["optimizer"],
                                         options=StateDictOptions(full_state_dict=True))
            else:  # older checkpoints: keyed by position
                self.optimizer.load_state_dict(objects["optimizer"])
            self.scheduler.load_state_dict(objects["scheduler"])
            checkpoint.set_rng_state(objects["rng"])
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
            file = checkpoint.folder(self.out) / checkpoint.OBJECTS_FILE
            first = (str(exc).splitlines() or [""])[0][:200]
            raise RunFolderError(f"{file} does not fit this run ({type(exc).__name__}: {first}); "
                                 f"{checkpoint.FIX}") from None
        self.step = meta["step"]
        self._restore_objective_states(meta)

    def _restore_objective_states(self, meta: dict) -> None:
        """Objective states (e.g. the plan cache) from the checkpoint, checked against the SHA-256 in its
        state.json: a missing, corrupted or unfitting one is dropped with a warning and rebuilt."""
        for objective in self.objectives:
            if not overrides(objective, "load_state_dict"):
                continue
            name = f"{objective.name}.json"
            data = checkpoint.read_file(self.out, name)
            expected = meta.get("files", {}).get(name)
            if data is None and objective.legacy_key and meta.get(objective.legacy_key) is not None:
                objective.load_state_dict(meta[objective.legacy_key], self.model)  # (an older checkpoint)
                continue
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

    def save_checkpoint(self) -> None:
        """Every rank gathers (FSDP2: a collective), rank 0 writes; an error on rank 0 stops every rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        model = self.model
        tensors = {"adapter": lora_state_dict(model.backbone),
                   "modules": {k: full_tensor(v) for k, v in model.new_state_dict().items()}}
        self.check_finite({**tensors["adapter"], **tensors["modules"]})
        optimizer = get_optimizer_state_dict(model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        objects = {"optimizer": optimizer, "optimizer_format": "fqn", "scheduler": self.scheduler.state_dict(),
                   "rng": checkpoint.rng_state()}
        meta = {"step": self.step, "world_size": self.dist.world_size, "global_batch": self.global_batch,
                "fingerprints": self.origin}
        files = {f"{name}.json": json.dumps(state).encode() for name, state in self.objective_states().items()}
        meta["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        self.dist.on_main(self._write_checkpoint, tensors, objects, meta, files)

    def check_finite(self, tensors: dict) -> None:
        """Refuse to save weights holding NaN or infinity (e.g. after a step with a huge learning rate): the run
        keeps its last good checkpoint, and a run replacing another (``--force``) is never published."""
        bad = run_files.nonfinite_weights(tensors)
        if bad:
            prev = checkpoint.read_meta(self.out) if self.staging is None else None
            where = f"the last good checkpoint (step {prev['step']}) is intact" if prev else "no checkpoint was written"
            raise TrainingError(f"the weights became NaN or infinite at step {self.step} ({len(bad)} tensors, e.g. "
                                f"{bad[0]!r}); they were not saved and {where}. Try a lower --lr / --lr-new or a "
                                f"larger --clip")

    def _write_checkpoint(self, tensors, objects, meta, files=None) -> None:
        try:
            checkpoint.write(self.out, tensors, objects, meta, files)
            # the adapters also as a standard peft folder (RUN/adapter/), loadable onto the plain HF backbone;
            # concept.load reads the checkpoint's copy first, so a torn peft folder never wins

            save_peft_adapter(self.model.backbone, self.out / PEFT_ADAPTER_DIR, state=tensors["adapter"],
                              base_model_name_or_path=self.model.resolution.backbone_info.name,
                              removed=getattr(self.model, "removed", None))
            if self.run.record_pending:  # (resume) train.json describes the run from its first new checkpoint on
                self._record(self.run.record_source)
                self.run.record_pending = False
        except (OSError, RuntimeError, SafetensorError) as exc:  # e.g. a full disk
            prev = checkpoint.read_meta(self.out)
            where = f"the previous checkpoint (step {prev['step']}) is intact" if prev else "no earlier checkpoint exists"
            code = fs.disk_errno(exc)
            reason = f": {fs.disk_message(code, self.out)}" if code else f" ({getattr(exc, 'strerror', None) or exc})"
            raise TrainingError(f"could not write the checkpoint at step {self.step}{reason}; {where}") from exc

    def checkpoint_bytes(self) -> int:
        """About what one checkpoint writes: the new modules, the LoRA adapters (twice: the checkpoint's copy
        and the peft folder) and AdamW's two moments of every trained parameter."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        trained = size(p for group in self.optimizer.param_groups for p in group["params"])
        return 2 * size(lora_state_dict(self.model.backbone).values()) + size(self.model.new_state_dict().values()) \
            + 2 * trained

    def release(self) -> None:
        """Release the run's lock (``train`` does when it ends)."""
        self.run.release()

    # -- the steps (concept.train_step) ---------------------------------------------------------------
    def batch(self, index: int) -> dict[str, torch.Tensor]:
        b = self.train_data.batch(index, self.config.batch)
        return {k: v.to(self.device) for k, v in b.items()}

    def autocast(self):
        """bf16 autocast where ``--dtype`` asks for it (``bf16`` on any device, ``auto`` on CUDA only): every
        use of the model (a bf16-stored base needs it), the backward excepted (``concept.precision``)."""
        return autocast(self.dtype, self.device)

    def forward(self, b):
        """The model alone on a batch (no objectives, no teacher), e.g. to calibrate the NULL bias."""
        return self.runner.model_forward(b)

    def _sync(self) -> None:
        if self.device.type == "cuda":  # honest timings of asynchronous kernels
            torch.cuda.synchronize(self.device)

    def _step_runner(self) -> StepRunner:
        """The step machinery over this run's training forward, objectives, optimizer and data."""
        return StepRunner(self.config, self.model, self.train_forward, self.objectives, self.optimizer, self.scheduler,
                          self.dist, self.device, batch=self.batch, autocast=self.autocast, gathered=self.gathered,
                          diagnostics=self.kind.step_diagnostics, note=lambda text: self.notes.append(text))

    @property
    def step(self) -> int:
        """The steps trained (``StepRunner.step``)."""
        return self.runner.step

    @step.setter
    def step(self, value: int) -> None:
        self.runner.step = value

    @property
    def queued(self) -> list[QueuedStep]:
        return self.runner.queued

    @property
    def acting_on_host(self) -> list:
        """The objectives that act on a step's values read on the host (``after_step``): with any, every step's
        log is read before the next step runs."""
        return self.runner.acting_on_host

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

    # -- the loop ----------------------------------------------------------------------------------
    def objective_states(self) -> dict[str, dict]:
        """The state of every objective that keeps one (e.g. Hard-EM's plan cache), by name; under torchrun
        the union over the ranks (each caches the examples of its own micro-batches)."""
        states = {}
        for objective in self.objectives:
            state = objective.state_dict()
            if state is None:
                continue
            if self.dist.world_size > 1:
                state = objective.merge_states(self.dist.gather_objects(state))
            states[objective.name] = state
        return states

    def evaluate(self) -> dict:
        """Held-out evaluation. Under torchrun every rank evaluates the same batches (FSDP2 needs every
        rank in each forward; the results are identical) and rank 0 logs them."""
        if self.eval_data is None:
            return {}

        batches = (self.eval_data.batch(i, self.config.batch) for i in range(self.config.eval_batches))
        with self.gathered(), self.autocast():
            return evaluate(self.model, ({k: v.to(self.device) for k, v in b.items()} for b in batches),
                            controls=False)

    def log(self, row: dict) -> None:
        if self.dist.is_main:
            self.run.append_metrics(_finite(row))
            for tracker in self.trackers:
                tracker.log(row["step"], row)

    def _on_sigint(self, signum, frame):
        if self._stop:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop = True

    def train(self, progress=None) -> dict:
        """Run until ``config.steps``; returns the final held-out evaluation. A run replacing an existing
        folder (``start(force=True)``) publishes only here, once every step is trained; anything that stops
        it before (an error, Ctrl-C) discards it and leaves the old folder as it was."""
        try:
            if self.dist.is_main and tracking.names(self.config.report_to):
                self.trackers = tracking.open_trackers(self.config.report_to, self.out, self.record(self.run.source_run),
                                                       self.run.name, self.step + 1)
            try:
                self._loop(progress)
            finally:
                for tracker in self.trackers:
                    tracker.close()
                self.trackers = []
            if self.dist.is_main:
                self.plot()
            if self._stop:
                raise self.run.interrupted(self.step)
            self.run.publish(self.dist)  # every step trained: a new run replacing a folder replaces it now
        except BaseException:
            self.run.discard(self.dist)  # an unfinished replacement: the old folder stays
            raise
        finally:
            self.release()
        if self.last_row:
            return self.last_row.get("eval", {})
        return self.metrics()[-1].get("eval", {}) if self.dist.is_main and self.metrics() else {}

    def _loop(self, progress) -> None:
        """Queue the steps; read their logs one step late (at step k + 1 the values of the steps up to k, every
        ``log_every`` steps, so the device always has the next step queued while the host waits), and all of
        them before an evaluation, a checkpoint and the end (a skipped step is never saved over)."""
        cfg = self.config
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            while self.step < cfg.steps and not self._stop:
                self.queue_step()
                if self.dist.world_size > 1:  # a Ctrl-C seen by one rank stops them all at the same step
                    self._stop = self.dist.any(self._stop)
                last = self.step == cfg.steps
                evaluate = self.eval_data is not None and (self.step % cfg.eval_every == 0 or last)
                save = self.step % cfg.checkpoint_every == 0 or last or self._stop
                if evaluate or save or self.acting_on_host:
                    rows = self.read_log()
                elif (self.step - 1) % cfg.log_every == 0:
                    rows = self.read_log(keep=1)
                else:
                    continue
                self._handle_rows(rows, evaluate, progress)
                if self._stop and not save:  # a Ctrl-C while the rows were handled: the rest, then a checkpoint
                    self._handle_rows(self.read_log(), False, progress)
                    save = True
                if save:
                    self.save_checkpoint()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _handle_rows(self, rows: list[dict], evaluate: bool, progress) -> None:
        """The steps' rows read back: a skipped step stops the run; the last step's final objectives, the
        evaluation, the log line and the progress callback."""
        for row in rows:
            if row.get("skipped"):
                self.log(row)
                raise self.skip_error(row)
            if row["step"] == self.config.steps:
                with self.autocast():
                    for objective in self.objectives:  # e.g. the ratio controller's final calibration
                        row.update(objective.finish(self.runner.context()))
            if evaluate and row["step"] == self.step:
                row["eval"] = self.evaluate()
            self.log(row)
            self.last_row = row
            if progress is not None:
                progress(row)

    def metrics(self) -> list[dict]:
        return self.run.metrics()

    def plot(self) -> Path | None:
        """curves.png (loss, held-out NLL and, where there is one, the concept ratio), then the kind's own."""
        rows = self.metrics()
        self.kind.plots(self.run.name, rows, self.out)
        return training_curves(rows, self.out / "curves.png", self.config.target_ratio)
