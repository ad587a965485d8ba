"""A training run's checkpoint state: what a checkpoint holds, how a trainer writes it and reads it back.

A checkpoint holds everything a resumed run needs to continue exactly: the new modules' weights and the LoRA
adapters (safetensors), the optimizer state (keyed by parameter name, so any number of processes can read it),
the scheduler, the RNG states, each objective's state (e.g. the ratio controller, Hard-EM's plan cache) with
its SHA-256, the step (the data position is a pure function of the step) and the fingerprints of what the run
was trained from. :class:`CheckpointState` is what a ``Trainer`` holds: it writes a checkpoint atomically on
rank 0 (``concept.checkpoint.write``; a full disk is one clear error and the previous checkpoint stays), never
one holding NaN or infinite weights, and restores one on resume. The weights are restored on their own
(:func:`restore_weights`), before the model is sharded and its optimizer exists.
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable

from safetensors import SafetensorError

from . import checkpoint, fs, run_files
from .builder import PEFT_ADAPTER_DIR, backbone_folder, load_new_modules, read_run
from .distributed import Dist, full_tensor
from .errors import RunFolderError, TrainingError
from .lora import load_lora_state_dict, lora_state_dict, save_peft_adapter
from .objectives import overrides
from .training_run import RunFolder

# what restoring the optimizer, scheduler and RNG state raises on a checkpoint that does not fit the run
UNFITTING = (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError)


def restore_weights(run: RunFolder, model) -> None:
    """The checkpoint's LoRA adapters and new modules into ``model`` (before any sharding)."""
    load_lora_state_dict(model.backbone, checkpoint.read_tensors(run.out, "adapter") or {})
    modules = checkpoint.read_tensors(run.out, "modules")
    if modules:
        load_new_modules(model, modules)


class CheckpointState:
    """The checkpoint of the run in ``run``: the weights of ``model``, the state of ``optimizer``, ``scheduler``
    and ``objectives``, the RNG and the step. ``record(source)`` is train.json's content, rewritten with the
    first checkpoint of a resumed run."""

    def __init__(self, run: RunFolder, model, optimizer, scheduler, objectives: list, dist: Dist, global_batch: int,
                 data_fingerprint: str, record: Callable[[str | None], dict]):
        self.run, self.model, self.optimizer, self.scheduler = run, model, optimizer, scheduler
        self.objectives, self.dist, self.global_batch, self.record = objectives, dist, global_batch, record
        built = read_run(run.out)["config"]
        self.origin = checkpoint.fingerprints(built, backbone_folder(built), data_fingerprint)

    # -- writing ---------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Every rank gathers (FSDP2: a collective), rank 0 writes; an error on rank 0 stops every rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        model = self.model
        tensors = {"adapter": lora_state_dict(model.backbone),
                   "modules": {k: full_tensor(v) for k, v in model.new_state_dict().items()}}
        self.check_finite({**tensors["adapter"], **tensors["modules"]}, step)
        optimizer = get_optimizer_state_dict(model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        objects = {"optimizer": optimizer, "optimizer_format": "fqn", "scheduler": self.scheduler.state_dict(),
                   "rng": checkpoint.rng_state()}
        meta = {"step": step, "world_size": self.dist.world_size, "global_batch": self.global_batch,
                "fingerprints": self.origin}
        files = {f"{name}.json": json.dumps(state).encode() for name, state in self.objective_states().items()}
        meta["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        self.dist.on_main(self._write, tensors, objects, meta, files)

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

    def check_finite(self, tensors: dict, step: int) -> None:
        """Refuse to save weights holding NaN or infinity (e.g. after a step with a huge learning rate): the run
        keeps its last good checkpoint, and a run replacing another (``--force``) is never published."""
        bad = run_files.nonfinite_weights(tensors)
        if bad:
            prev = checkpoint.read_meta(self.run.out) if self.run.staging is None else None
            where = f"the last good checkpoint (step {prev['step']}) is intact" if prev else "no checkpoint was written"
            raise TrainingError(f"the weights became NaN or infinite at step {step} ({len(bad)} tensors, e.g. "
                                f"{bad[0]!r}); they were not saved and {where}. Try a lower --lr / --lr-new or a "
                                f"larger --clip")

    def _write(self, tensors, objects, meta, files=None) -> None:
        run, out = self.run, self.run.out
        try:
            checkpoint.write(out, tensors, objects, meta, files)
            # the adapters also as a standard peft folder (RUN/adapter/), loadable onto the plain HF backbone;
            # concept.load reads the checkpoint's copy first, so a torn peft folder never wins
            save_peft_adapter(self.model.backbone, out / PEFT_ADAPTER_DIR, state=tensors["adapter"],
                              base_model_name_or_path=self.model.resolution.backbone_info.name,
                              removed=getattr(self.model, "removed", None))
            if run.record_pending:  # (resume) train.json describes the run from its first new checkpoint on
                run.write_record(self.record(run.record_source), run.record_source)
                run.record_pending = False
        except (OSError, RuntimeError, SafetensorError) as exc:  # e.g. a full disk
            prev = checkpoint.read_meta(out)
            where = f"the previous checkpoint (step {prev['step']}) is intact" if prev else "no earlier checkpoint exists"
            code = fs.disk_errno(exc)
            reason = f": {fs.disk_message(code, out)}" if code else f" ({getattr(exc, 'strerror', None) or exc})"
            raise TrainingError(f"could not write the checkpoint at step {meta['step']}{reason}; {where}") from exc

    def size(self) -> int:
        """About what one checkpoint writes, in bytes: the new modules, the LoRA adapters (twice: the
        checkpoint's copy and the peft folder) and AdamW's two moments of every trained parameter."""
        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        trained = nbytes(p for group in self.optimizer.param_groups for p in group["params"])
        return 2 * nbytes(lora_state_dict(self.model.backbone).values()) \
            + nbytes(self.model.new_state_dict().values()) + 2 * trained

    # -- reading back ----------------------------------------------------------------------------------
    def restore(self, notes: list[str]) -> int:
        """The optimizer, scheduler, RNG and objective states from the checkpoint (already verified against
        its checksums); returns its step. A state that does not fit the run is one ``RunFolderError``; an
        objective state that is missing or damaged is rebuilt, with a warning in ``notes``."""
        meta = checkpoint.read_meta(self.run.out)
        objects = checkpoint.read_objects(self.run.out)
        try:
            self._restore_objects(objects)
        except UNFITTING as exc:
            file = checkpoint.folder(self.run.out) / checkpoint.OBJECTS_FILE
            first = (str(exc).splitlines() or [""])[0][:200]
            raise RunFolderError(f"{file} does not fit this run ({type(exc).__name__}: {first}); "
                                 f"{checkpoint.FIX}") from None
        self._restore_objective_states(meta, notes)
        return meta["step"]

    def _restore_objects(self, objects: dict) -> None:
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

    def _restore_objective_states(self, meta: dict, notes: list[str]) -> None:
        """Objective states (e.g. the plan cache) from the checkpoint, checked against the SHA-256 in its
        state.json: a missing, corrupted or unfitting one is dropped with a warning and rebuilt."""
        for objective in self.objectives:
            if not overrides(objective, "load_state_dict"):
                continue
            name = f"{objective.name}.json"
            data = checkpoint.read_file(self.run.out, name)
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
            notes.append(f"warning: the checkpoint's {objective.name} state ({name}) is not used: {problem}; "
                         f"it is rebuilt from scratch (Hard-EM: every example's plan is searched again)")
