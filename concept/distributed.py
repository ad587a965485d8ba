"""Training on several processes, as launched by ``torchrun`` (DDP or FSDP2).

    torchrun --nproc-per-node 2 -m concept_cli train runs/m1 -o runs/m1-ddp    # DDP (gloo on CPU, nccl on GPU)
    torchrun --nproc-per-node 8 -m concept_cli train runs/big --distributed fsdp2   # parameters sharded

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; a
process started without them is a single process (``Dist()``). What every mode shares, so
that the run does not depend on how many processes computed it (``concept.training``):

- the global batch of a step is ``batch x world_size x grad_accum`` rows, cut into that many
  micro-batches of ``batch`` rows; micro-batch ``j`` of step ``s`` is the pure function
  ``data.batch(s * micros + j, batch)``, and rank ``r`` takes ``j = r * grad_accum + m``;
- each micro-batch's randomness (Gumbel noise, dropout) is seeded from ``(seed, s, j)``;
- gradients are averaged over all micro-batches (DDP / FSDP2 average over ranks, the
  accumulation over a rank's micro-batches), so the loss curve equals a single process
  running the same global batch as ``world_size x grad_accum`` micro-batches;
- logged values (loss, ratio, tokens/s) and the ratio controller's statistics are
  all-reduced, so every rank keeps the same NULL bias;
- rank 0 alone writes the run folder (checkpoints atomically, metrics, plots); the others
  wait for it, and an error on rank 0 is raised on every rank.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch

from .errors import ConceptError

MODES = ("auto", "ddp", "fsdp2", "none")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(ConceptError):
    exit_code = 2


def launched() -> bool:
    """True in a process started by ``torchrun`` (or with its environment variables set)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE"))


@dataclass(frozen=True)
class Dist:
    """This process's place in the job; ``Dist()`` is a single process."""

    mode: str = "none"  # none | ddp | fsdp2
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group exists (also with a world of one under torchrun)."""
        return self.mode != "none"

    def describe(self) -> str:
        if not self.active:
            return "single process"
        backend = torch.distributed.get_backend()
        return f"{self.mode.upper()} over {self.world_size} process{'es' if self.world_size > 1 else ''} ({backend})"

    # -- collectives (no-ops in a single process) --------------------------------------------
    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def sum(self, values: list[float], device=None) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (float64)."""
        if not self.active or self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device or self.device())
        torch.distributed.all_reduce(t)
        return t.tolist()

    def sum_on_device(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks in place, on their device: nothing is read back."""
        if self.active and self.world_size > 1:
            torch.distributed.all_reduce(values)
        return values

    def mean(self, values: list[float], device=None) -> list[float]:
        return [v / self.world_size for v in self.sum(values, device)]

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def device(self) -> torch.device:
        backend = torch.distributed.get_backend() if self.active else "gloo"
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. filling a cache), then the other ranks."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def on_main(self, fn, *args, **kwargs):
        """Run ``fn`` on rank 0 only (a write to the run folder); the other ranks wait. An error on rank 0
        is raised on every rank (as ``ConceptError`` there), so no rank waits forever for the others."""
        if not self.active:
            return fn(*args, **kwargs)
        error, result = None, None
        if self.is_main:
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                error = exc
        message = [None if error is None else f"{error}"]
        torch.distributed.broadcast_object_list(message, src=0)
        if error is not None:
            raise error
        if message[0] is not None:
            raise ConceptError(f"rank 0 failed: {message[0]}")
        return result


def setup(mode: str = "auto", device: str = "auto", timeout_s: float = 1800) -> Dist:
    """Join the process group ``torchrun`` describes (``gloo`` on CPU, ``nccl`` on CUDA) and return
    this process's :class:`Dist`. ``auto``: DDP under torchrun, a single process otherwise."""
    if mode not in MODES:
        raise DistributedError(f"--distributed: one of {', '.join(MODES)}, got {mode!r}")
    if not launched():
        if mode in ("ddp", "fsdp2"):
            raise DistributedError(f"--distributed {mode} needs the process group torchrun sets up; launch with "
                                   f"`torchrun --nproc-per-node N -m concept_cli train ...` (or drop --distributed)")
        return Dist()
    if mode == "none":
        raise DistributedError("--distributed none under torchrun: every process would train the same run on its "
                               "own and write the same folder; use --distributed ddp / fsdp2, or launch without torchrun")
    mode = "ddp" if mode == "auto" else mode
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(mode=mode, rank=rank, world_size=world, local_rank=local)


def teardown(dist: Dist) -> None:
    if dist.active and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 ``DTensor``) tensor gathered whole; a plain tensor as it is. A collective
    for sharded tensors: every rank must call it, in the same order."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v).detach().cpu() for k, v in state.items()}


def available_devices() -> list[str]:
    """The ``--device`` values this machine can run: auto, cpu and each CUDA device."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["auto", "cpu", *(["cuda", *(f"cuda:{i}" for i in range(cuda))] if cuda else [])]


def pick_device(name: str) -> torch.device:
    """The torch device of a ``--device`` value: auto (CUDA if there is one, else the CPU), cpu, cuda or cuda:N.
    Anything else, or a device this machine lacks, is an error naming the available ones (before anything is
    loaded or written)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConceptError(f"--device {name}: not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise ConceptError(f"--device {name}: concept runs on the CPU or CUDA devices, not {device}; available here: "
                           f"{', '.join(available_devices())}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConceptError(f"--device {name}: no CUDA device is available on this machine; use --device cpu (or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConceptError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                           f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device
