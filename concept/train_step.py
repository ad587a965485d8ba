"""One training step at a time, queued on the device, and its log read back later (``Trainer``'s step machinery).

    runner = StepRunner(config, model, train_forward, objectives, optimizer, scheduler, dist, device, batch=...,
                        autocast=..., gathered=..., diagnostics=..., note=...)
    runner.queue_step(); runner.queue_step()      # two steps on the device, nothing read back
    rows = runner.read_log()                      # their logged values, read in one copy

A step is ``grad_accum`` micro-batches through ``train_forward`` (the :class:`StepModule`, eager or compiled, wrapped in
DDP / FSDP2 under torchrun), the gradients clipped, a fused-AdamW step guarded by ``found_inf`` (a step whose
loss or gradients are not finite leaves the weights, the optimizer state and the controllers as they were) and
the objectives' device-side hooks. Its logged values stay on the device (a :class:`QueuedStep`) until
:meth:`StepRunner.read_log`, so the host never waits inside a step (``concept.syncs``). The objectives see the
run through a :class:`concept.objectives.StepContext`, never the trainer.
"""
from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext

import torch
from torch import nn

from .compiled import gradients_in_graph_memory
from .diagnostics import grad_norms
from .distributed import full_tensor
from .errors import TrainingError
from .objectives import StepContext, overrides
from .syncs import declared
from .teacher import TeacherClock, teacher_forward
from .train_config import curriculum_len

STEP_SUMS = ("loss", "total_loss", "tokens", "teacher_s", "bad")  # summed over a step's micro-batches and ranks


def micro_seed(seed: int, step: int, micro: int) -> int:
    """The seed of micro-batch ``micro`` of (0-based) ``step``: its Gumbel noise and dropout do not
    depend on which process computes it, nor on what ran before (exact resume)."""
    return (seed * 1_000_003 + step * 65_537 + micro) % 2 ** 63


@dataclasses.dataclass
class QueuedStep:
    """A step run on the device whose logged values are not read yet (``StepRunner.queue_step``, ``read_log``)."""
    step: int  # its number (1-based)
    lr: float  # the rate it used
    length: int  # its rows' length (the curriculum's)
    on_device: list[str]  # the sums in ``values``, in order (then the gradient norm, then ``later``)
    later: list[str]  # the objectives' logged device scalars in ``values``
    values: torch.Tensor  # float64: the sums (over the ranks), the gradient norm, ``later`` (a GPU: a pinned copy)
    host: dict  # the sums made on the host (e.g. teacher seconds), this rank's
    logged: dict  # what the objectives' ``device_step`` returned (its device scalars are read from ``values``)
    diag: dict  # the step diagnostics (every --log-every steps), read when it ran
    scheduler: dict  # the schedule's state before the step (a skipped step puts it back)
    ready: object = None  # a CUDA event: ``values`` has arrived


class StepModule(nn.Module):
    """One training forward: the frozen teacher (when an objective reads it), the model and every
    loss term. One module, so that DDP / FSDP2 see every parameter the loss touches inside its
    forward (the MTP heads and the objectives read the model outside the model's own forward)."""

    def __init__(self, model: nn.Module, objectives: list, ce_weight: float, autocast):
        super().__init__()
        self.model = model
        self.objectives, self.ce_weight, self.autocast = objectives, ce_weight, autocast
        self.losses = [o for o in objectives if o.adds_term]  # (a controller adds no term)
        self.teacher_needs = frozenset().union(*(o.teacher_needs for o in objectives))

    def forward(self, b: dict):
        """Returns (model output, total loss, {objective name: term}, seconds spent in the teacher)."""
        teacher, teacher_s = None, 0.0
        if self.teacher_needs:  # before the student: its graph never sees the adapters switched off
            teacher_s = TeacherClock(b["input_ids"].device)  # (no sync: read with the step's log)
            with teacher_s.timing(), self.autocast():
                teacher = teacher_forward(self.model, b["input_ids"], b["attention_mask"], b["document_ids"],
                                          self.teacher_needs)
        extra = {k: v for k, v in b.items() if k not in ("input_ids", "attention_mask", "document_ids")}
        with self.autocast():  # (extra: what an objective's `prepare` adds, e.g. Hard-EM's plan)
            out = self.model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["input_ids"],
                             document_ids=b["document_ids"], **extra)
            loss, terms = self.ce_weight * out.loss, {}
            for objective in self.losses:  # (under autocast too: they read bf16 states with fp32 modules)
                terms[objective.name] = objective(self.model, b, out, teacher)
                loss = loss + terms[objective.name]
        return out, loss, terms, teacher_s


def skip_error(row: dict, last_saved: int | None) -> TrainingError:
    """The error of a step that was skipped (``read_log``): its loss or gradients were not finite.
    ``last_saved``: the step of the run's last checkpoint (None: none yet)."""
    where = (f"the last good checkpoint (step {last_saved}) is intact" if last_saved is not None
             else "no checkpoint was written yet")
    total = row["total_loss"]
    what = f"the loss became {total}" if not math.isfinite(total) else f"the gradients became {row['grad_norm']}"
    return TrainingError(f"{what} at step {row['step']}; the step was skipped (the weights and the optimizer "
                         f"state are those of step {row['step'] - 1}) and {where}. "
                         f"Try a lower --lr / --lr-new or a larger --clip.")


class StepRunner:
    """The optimizer steps of a run: the step counter, the steps queued on the device and their log.

    ``train_forward`` is the training forward (a :class:`StepModule`, compiled or eager, or its DDP / FSDP2 wrapper);
    ``batch(index)`` a training batch on the device; ``autocast()`` / ``gathered()`` the contexts of a use of the
    model (``gathered``: FSDP2's root parameters, for a forward outside ``train_forward``); ``diagnostics(model, out,
    batch)`` the family's step diagnostics; ``note(text)`` a note for the user."""

    def __init__(self, config, model: nn.Module, train_forward, objectives: list, optimizer: torch.optim.Optimizer,
                 scheduler, dist, device: torch.device, *, batch, autocast, gathered, diagnostics, note):
        self.config, self.model, self.train_forward, self.objectives = config, model, train_forward, objectives
        self.optimizer, self.scheduler, self.dist, self.device = optimizer, scheduler, dist, device
        self.batch, self.autocast, self.gathered, self.diagnostics, self.note = batch, autocast, gathered, \
            diagnostics, note
        self.teacher_needs = frozenset().union(*(o.teacher_needs for o in objectives))
        self.preparing = [o for o in objectives if overrides(o, "prepare")]  # (costly under FSDP2: gathers)
        # the objectives that act on a step's values read on the host (``after_step``): with any, every step's
        # log is read before the next step runs
        self.acting_on_host = [o for o in objectives if overrides(o, "after_step")]
        self.logging_stats = [o for o in objectives if overrides(o, "log_stats")]  # (never forces a read)
        # gradient accumulation over a backward that hands its gradients over in CUDA graphs' memory (compiled on
        # CUDA): the next micro-batch's forward would reuse a gradient a weight took as its ``.grad``, so the weights
        # keep ``.grad`` buffers of their own, zeroed after each step, that every backward adds into
        self.own_grads = config.grad_accum > 1 and gradients_in_graph_memory(model, device.type)
        self.step = 0  # the steps trained (a skipped step, once read, takes it back)
        self.queued: list[QueuedStep] = []  # steps run on the device whose logged values are not read yet
        self.skipping: torch.Tensor | None = None  # on the device: a step so far had a non-finite loss or gradient
        self.window_start = time.perf_counter()  # when the first step not read yet was queued (tokens_per_s)
        self.interrupted = False  # a Ctrl-C this rank saw (with several ranks: summed with the step's values)
        self.stop_agreed = False  # a step read back says a rank saw one: every rank stops after it

    @property
    def micro_batches(self) -> int:
        """Micro-batches of ``batch`` rows per optimizer step, over all processes."""
        return self.config.grad_accum * self.dist.world_size

    def model_forward(self, b: dict):
        """The model alone on a batch (no objectives, no teacher), e.g. to calibrate the NULL bias."""
        with self.autocast():
            return self.model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["input_ids"],
                              document_ids=b["document_ids"])

    def context(self) -> StepContext:
        """What the objectives' ``before_step`` / ``finish`` see of the run at this step."""
        return StepContext(step=self.step, steps=self.config.steps, model=self.model, dist=self.dist,
                           micro_batches=self.micro_batches, batch=self.batch, forward=self.model_forward,
                           gathered=self.gathered, note=self.note)

    def queue_step(self) -> None:
        """One optimizer step over the global batch, queued on the device without reading anything back (the
        length policy's declared scan excepted): this rank's ``grad_accum`` micro-batches (DDP / FSDP2 average
        the gradients over the ranks in backward), every logged value summed on the device, the non-finite
        guard (a step whose loss or gradients are not finite, or one after such a step, leaves the weights, the
        optimizer state and the controllers as they were: fused AdamW's ``found_inf``) and the objectives'
        ``device_step``. Its values wait in ``queued`` until :meth:`read_log`. Rows are ``curriculum_len``
        tokens long (``--curriculum``)."""
        cfg, model = self.config, self.model
        length = curriculum_len(cfg, self.step)
        if not model.training:  # (``train()`` walks every module: ~1,000 on SmolLM2 with its adapters, each step)
            model.train()
        context = self.context()
        with self.autocast():
            for objective in self.objectives:  # e.g. the sampler's temperature, the ratio controller's target
                objective.before_step(context)
        if not self.queued:
            self.window_start = time.perf_counter()
        sums, out, b = self._accumulate(length)
        if self.dist.world_size > 1:  # a Ctrl-C one rank saw: summed over the ranks with the step's values
            sums["_stop"] = torch.full((), float(self.interrupted), dtype=torch.float64, device=self.device)
        diag = self._diagnostics(out, b) if (self.step + 1) % cfg.log_every == 0 else {}  # before clipping
        summed, total, grad_norm, skipped, lr, scheduler = self._optimizer_step(sums)
        self.step += 1
        means = {k: v / self.micro_batches for k, v in total.items()}
        logged = {}
        for objective in self.objectives:  # e.g. the ratio controller moves the NULL bias (on the device)
            logged.update(objective.device_step(model, means, total, skipped))
        later = [k for k, v in logged.items() if isinstance(v, torch.Tensor)]
        values = torch.cat([summed, grad_norm[None], *(logged[k].detach().double().reshape(1) for k in later)])
        values, ready = self._on_its_way(values)
        host = {k: v for k, v in sums.items() if k not in total}  # (teacher seconds: read with the log)
        self.queued.append(QueuedStep(self.step, lr, length, list(total), later, values, host, logged, diag, scheduler,
                                      ready))

    def _diagnostics(self, out, b) -> dict:
        """The step diagnostics (every ``--log-every`` steps, before clipping so that spikes show): the gradient
        norms per group and the family's own, on this rank's last micro-batch."""
        with declared("step diagnostics"):
            diag = {f"grad_norm/{k}": v for k, v in grad_norms(self.model).items()}
            with torch.no_grad(), self.gathered(), self.autocast():
                diag.update(self.diagnostics(self.model, out, b))
        return diag

    def _optimizer_step(self, sums: dict):
        """Clip, sum the step's values over the ranks, and step the fused AdamW unless they are not finite (its
        ``found_inf``: no update, the step counters as they were), then the schedule. Returns (the summed device
        values, them by name, the gradient norm, the skip flag, the rate the step used, the schedule's state
        before)."""
        cfg = self.config
        grad_norm = torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], cfg.clip)
        grad_norm = full_tensor(grad_norm).detach().to(self.device, torch.float64)
        on_device = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]  # (teacher seconds: host numbers)
        summed = self.dist.sum_on_device(torch.stack([sums[k].double() for k in on_device]))
        total = dict(zip(on_device, summed.unbind()))
        skipped = (total["bad"] > 0) | ~torch.isfinite(grad_norm)
        self.skipping = skipped = skipped if self.skipping is None else skipped | self.skipping
        self.optimizer.found_inf = skipped.float()  # fused AdamW: no update, the step counters as they were
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        scheduler = self.scheduler.state_dict()  # (a skipped step, once read, puts it back)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=not self.own_grads)
        return summed, total, grad_norm, skipped, lr, scheduler

    @staticmethod
    def _on_its_way(values: torch.Tensor):
        """On a GPU: ``values`` copied into pinned memory as the device gets there (read later), and the event
        that says it has. Elsewhere: as they are."""
        if values.device.type != "cuda":
            return values, None
        values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return values, ready

    def _accumulate(self, length: int) -> tuple[dict, object, dict]:
        """This rank's ``grad_accum`` micro-batches: forward, backward (gradients add up), and the sums the step
        logs (``STEP_SUMS``, each loss term, each objective's statistics). Returns (sums, the last micro-batch's
        output, that micro-batch)."""
        cfg, model, dist = self.config, self.model, self.dist
        sums = dict.fromkeys([*STEP_SUMS, *(o.name for o in self.objectives if o.adds_term)], 0.0)
        micros = self.micro_batches
        if self.own_grads:  # (allocated once; ``zero_grad`` keeps them from then on)
            for p in (p for g in self.optimizer.param_groups for p in g["params"] if p.grad is None):
                p.grad = torch.zeros_like(p)
        for m in range(cfg.grad_accum):
            j = dist.rank * cfg.grad_accum + m  # this micro-batch's place in the global batch
            b = {k: v[:, :length] for k, v in self.batch(self.step * micros + j).items()}
            for objective in self.preparing:  # e.g. Hard-EM's E-step puts the batch's plans in it
                with self.gathered(), self.autocast():  # (FSDP2: the search runs outside the wrapped forward)
                    b = objective.prepare(model, b, self.step)
            torch.manual_seed(micro_seed(cfg.seed, self.step, j))
            last = m == cfg.grad_accum - 1
            no_sync = getattr(self.train_forward, "no_sync", None) if not last else None
            with no_sync() if no_sync else nullcontext():  # DDP: all-reduce once, in the last backward
                out, loss, terms, teacher_s = self.train_forward(b)
                (loss / cfg.grad_accum).backward()
            # summed on the device in float64 (as Python floats were): read once per step, in read_log
            for name, term in terms.items():
                sums[name] = sums[name] + term.detach().double()
            with self.autocast():
                for objective in self.objectives:  # statistics an objective acts on after the step (e.g. the quota)
                    for key, value in objective.stats(model, b, out).items():
                        value = value.detach().double() if isinstance(value, torch.Tensor) else value
                        sums[key] = sums.get(key, 0.0) + value
            sums["bad"] = sums["bad"] + (~torch.isfinite(loss.detach())).double()
            sums["loss"] = sums["loss"] + out.loss.detach().double()
            sums["total_loss"] = sums["total_loss"] + loss.detach().double()
            sums["teacher_s"] += teacher_s
            sums["tokens"] = sums["tokens"] + b["attention_mask"].sum().double()
        return sums, out, b

    def read_log(self, keep: int = 0) -> list[dict]:
        """The rows of the queued steps but the last ``keep``, in order, their values read in one copy (the
        declared ``step log`` sync; on a GPU it waits for those steps only, not for the ``keep`` still
        running). ``tokens_per_s``: over the steps read together. A step whose loss or gradients were not
        finite (the device skipped it and every step after it) ends the list, marked ``skipped``: the steps
        after it are dropped and the step counter and the schedule go back to before it (the weights, the
        optimizer state and the controllers never moved); :func:`skip_error` says what happened."""
        dist = self.dist
        ready, self.queued = self.queued[:len(self.queued) - keep], self.queued[len(self.queued) - keep:]
        if not ready:
            return []
        with declared("step log"):  # the one read of these steps' device values
            if ready[-1].ready is not None:
                ready[-1].ready.synchronize()  # (in stream order: the earlier steps' copies are done too)
            values = torch.stack([q.values for q in ready]).tolist()
            host = iter(dist.sum([v for q in ready for v in q.host.values()], self.device))
        now = time.perf_counter()
        seconds, self.window_start = now - self.window_start, now
        rows = []
        for q, read in zip(ready, values):
            row, total = self._row(q, read, host, seconds, len(ready))
            rows.append((row, total["tokens"]))
            if total["bad"] or not math.isfinite(row["grad_norm"]):
                row["skipped"] = True
                self.step, self.queued = q.step - 1, []
                self.scheduler.load_state_dict(q.scheduler)
                self.optimizer.zero_grad(set_to_none=not self.own_grads)
                break
        tokens_per_s = sum(tokens for _, tokens in rows) / seconds
        for row, _ in rows:
            row["tokens_per_s"] = tokens_per_s
        return [row for row, _ in rows]

    def _row(self, q: QueuedStep, read: list[float], host, seconds: float, steps_read: int) -> tuple[dict, dict]:
        """The metrics row of one queued step from its values read back (and the host sums, an iterator over
        every step's in order); returns it and the step's totals."""
        dist = self.dist
        total = dict(zip(q.on_device, read))
        self.stop_agreed = self.stop_agreed or total.get("_stop", 0) > 0  # every rank reads the same steps
        total.update({k: next(host) for k in q.host})
        mean = {k: v / self.micro_batches for k, v in total.items()}  # per micro-batch, over the global batch
        row = {"step": q.step, "loss": mean["loss"], "total_loss": mean["total_loss"], "lr": q.lr,
               "grad_norm": read[len(q.on_device)], "tokens_per_s": 0.0}
        row.update({o.name: mean[o.name] for o in self.objectives if o.adds_term})  # each objective's term
        # the objectives' statistics (``_``-prefixed ones are inputs of their hooks, not logged)
        row.update({k: mean[k] for k in mean if k not in row and k not in STEP_SUMS and not k.startswith("_")})
        if self.config.curriculum:
            row["seq_len"] = q.length
        row.update({k: dict(zip(q.later, read[len(q.on_device) + 1:])).get(k, v) for k, v in q.logged.items()})
        for objective in self.logging_stats:  # e.g. Hard-EM's E-step ratios (read when the log is: no sync)
            row.update(objective.log_stats(mean, total))
        for objective in self.acting_on_host:  # e.g. the quota controller moves the <EOS> bias
            row.update(objective.after_step(self.model, mean, total))
        if self.teacher_needs:
            teacher_s = total["teacher_s"] / dist.world_size  # per process
            row.update(teacher_s=teacher_s, teacher_fraction=teacher_s / seconds * steps_read)
        if dist.world_size > 1:
            row["world_size"] = dist.world_size
        row.update({k: v for k, v in q.diag.items() if k not in row})  # (the step's ratio is the global one)
        return row, total
