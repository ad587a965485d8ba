"""Host synchronisations: the ones the code means to make, declared by name, and a counter that finds every op
forcing one (and counts aten ops) in a block of code, on any device.

A GPU runs ahead of the Python that feeds it until something needs a device value on the host: ``.item()``
(``_local_scalar_dense``), ``bool(t)`` / ``int(t)`` (a data-dependent ``if``), ``.tolist()``, ``.cpu()``,
``.numpy()``, ``nonzero``, ``masked_select``, boolean indexing, ``unique``, ``repeat_interleave`` without an
output size (their output shape is data). Each stops the host until the device catches up. The static,
compiled forward (``docs/architecture.md``, "Static shapes, host syncs and compilation") has none of them,
except the points declared with :func:`declared` (the length policy's host scan, ``cascade``'s tile plan, the
trainer's read of its steps' logged values, outside the steps: ``Trainer.read_log``; in the dynamic decoder the
step's tokens, whether a row emits a concept, and its KV caches' growth check)::

    with declared("policy scan"):
        columns = x.cpu().tolist()

    with HostSyncs() as seen:
        model(ids)
    seen.ops, seen.syncs (undeclared, by op), seen.declared (by name)

On CPU ``.tolist()`` / ``.cpu()`` / ``.numpy()`` dispatch no aten op, so they are caught one level up (a
``TorchFunctionMode``); everything else at the aten level (a ``TorchDispatchMode``).

The other direction stops the host too: ``torch.tensor(python_data, device=cuda)`` (and ``torch.as_tensor`` of
Python data) fills a pageable host buffer and copies it with a blocking ``cudaMemcpy`` + ``cudaStreamSynchronize``.
On a CPU it is no copy at all, so the counter counts every tensor made from Python data inside the block as the
sync it is on CUDA (``syncs["tensor from host data"]``); :func:`upload` is the way without one (pinned memory, a
non-blocking copy).
"""
from __future__ import annotations

import threading
import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result is a host value or has a data-dependent shape
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                      "unique_consecutive", "unique_dim", "is_nonzero", "equal"})
# tensor methods that copy to the host without an aten op on CPU
HOST_READS = frozenset({"tolist", "cpu", "numpy"})
# factories that make a tensor from Python data: a blocking host -> device copy on CUDA
HOST_DATA = frozenset({"tensor", "as_tensor"})

_local = threading.local()


def _points() -> list[str]:
    if not hasattr(_local, "points"):
        _local.points = []
    return _local.points


def _counters() -> list["HostSyncs"]:
    if not hasattr(_local, "counters"):
        _local.counters = []
    return _local.counters


@contextmanager
def declared(name: str):
    """A host synchronisation the code makes on purpose: :class:`HostSyncs` counts the point once under
    ``name`` (its ``declared``), and none of the syncs inside as hidden ones."""
    for counter in _counters():
        counter.declared[name] += 1
    points = _points()
    points.append(name)
    try:
        yield
    finally:
        points.pop()


@contextmanager
def host_values(reason: str):
    """Reads of values that live on the host whatever the device (e.g. AdamW's step counters): no device
    sync on a GPU, so :class:`HostSyncs` counts nothing inside (on a CPU it cannot tell them apart)."""
    points = _points()
    points.append(None)
    try:
        yield
    finally:
        points.pop()


def upload(data, dtype: torch.dtype, device) -> torch.Tensor:
    """Python data (lists, numbers) as a tensor on ``device`` without stopping the host (:func:`to_device`).
    ``torch.tensor(data, device=cuda)`` would copy from pageable memory and wait."""
    points = _points()
    points.append(None)
    try:
        return to_device(torch.tensor(data, dtype=dtype), device)
    finally:
        points.pop()


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without stopping the host: on CUDA through pinned host memory and a
    non-blocking copy (torch's caching host allocator keeps the pinned buffer until the copy is done, so ``host``
    may change at once); elsewhere (and a tensor already there) ``host.to(device)``. A plain ``host.to(cuda)``
    copies from pageable memory and then waits for the device's stream (``cudaStreamSynchronize``): every
    training batch moved so waited for the step before it, and the host could not queue the next one meanwhile."""
    if torch.device(device).type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _is_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:  # x[mask]
        return _bool_index(args[1])
    if name == "repeat_interleave":  # the repeats tensor form, without output_size
        return (kwargs or {}).get("output_size") is None and isinstance(args[0], torch.Tensor) and (
            len(args) == 1 or isinstance(args[1], torch.Tensor))
    return False


class _Ops(TorchDispatchMode):
    supports_higher_order_operators = True  # e.g. flex_attention: one op, run as it is

    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func)).split(".")[0]
        self.owner.ops += 1
        if _is_sync(name, args, kwargs):
            self.owner._sync(name)
        return func(*args, **(kwargs or {}))


def _empty(data) -> bool:
    """Empty Python data (``torch.tensor([], device=...)``, e.g. transformers' ``DynamicCache`` before its first
    update): nothing to copy, and ``copy_`` of no element returns before any transfer, so no sync."""
    return isinstance(data, (list, tuple)) and len(data) == 0


class _Reads(TorchFunctionMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor):
            self.owner._sync(name)
        elif name in HOST_DATA and args and not isinstance(args[0], torch.Tensor) and not _empty(args[0]):
            self.owner._sync("tensor from host data")
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Counts, in a ``with`` block: ``ops`` (aten ops dispatched, forward and backward), ``syncs`` (the
    ops that force a host sync outside a :func:`declared` point, by op name) and ``declared`` (how often
    each declared point was passed, by name). ``hidden`` is the total of ``syncs``."""

    def __init__(self, stacks: bool = False):
        self.ops = 0
        self.syncs: Counter = Counter()
        self.declared: Counter = Counter()
        # with ``stacks``: (op name, the Python frames that made it, outermost first, ``path(line): function``) per
        # undeclared sync: where each came from, on any torch (its profiler's Python events are not: torch 2.11's
        # record none, ``concept.profiling.sync_stacks``)
        self.stacks: list[tuple[str, list[str]]] | None = [] if stacks else None
        self._modes = (_Reads(self), _Ops(self))

    def _sync(self, name: str) -> None:
        if not _points():
            self.syncs[name] += 1
            if self.stacks is not None:
                self.stacks.append((name, [f"{f.filename}({f.lineno}): {f.name}"
                                           for f in traceback.extract_stack()[:-1]]))

    @property
    def hidden(self) -> int:
        return sum(self.syncs.values())

    def __enter__(self) -> "HostSyncs":
        _counters().append(self)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        _counters().remove(self)
