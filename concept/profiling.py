"""Where the time of a forward or a training step goes: aten ops, host syncs, kernel launches.

Two tools, one for each machine:

* :class:`OpCounter` (any device, CPU included): a ``TorchDispatchMode`` that counts every aten op
  dispatched while it is active (forward and backward, the optimizer too), by name, and the calls among
  them that force a device -> host synchronisation (:func:`host_sync`). On a GPU each op is at least one
  kernel launch, so the op count is the CPU's proxy for launches, and a sync stalls the launch queue::

      with OpCounter() as counts:
          loss = model(ids, labels=ids).loss
          loss.backward()
      counts.ops              # 1843: aten ops dispatched
      counts.syncs            # {"item": 2, "nonzero": 1}: the ops that would stop the host on a GPU
      counts.by_op.most_common(5)

  ``OpCounter(on_op=f)`` calls ``f(func, args, kwargs, out)`` for every op, for counts of one's own
  (e.g. casts whose source is a frozen weight). Ops are counted where Python's dispatch sees them:
  after composite ops are decomposed (``x.item()`` arrives as ``_local_scalar_dense``), before kernels
  call other ops (boolean indexing arrives as ``index.Tensor`` with a boolean index, not as the
  ``nonzero`` inside it). Not seen on a CPU: ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a CPU
  tensor dispatch no op (on a GPU ``.cpu()`` / ``.tolist()`` are a device -> host copy, which is counted).
* :func:`profile_call` (CUDA, or CPU): one call under ``torch.profiler``: its wall time, the time the
  device was busy (the sum of its kernels' own time), kernel launches, host synchronisations, aten ops,
  and the operators with the most device and CPU time. A call whose device time is far below its wall
  time is bound by launches and Python, not by arithmetic.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .syncs import HostSyncs

__all__ = ["OpCounter", "host_sync", "count_ops", "profile_call"]

aten = torch.ops.aten
# ops that always wait for the device: their result's value or shape lives on it
_SYNC_OPS = {
    aten._local_scalar_dense: "item",  # .item(), float(t), int(t), bool(t), `if t:`
    aten.nonzero: "nonzero",  # also torch.where(cond) with one argument, argwhere
    aten.masked_select: "masked_select",
    aten._unique2: "unique", aten.unique_dim: "unique", aten.unique_consecutive: "unique",
    aten.unique_dim_consecutive: "unique", aten._unique: "unique",
    aten.equal: "equal",  # torch.equal returns a Python bool
    aten.bincount: "bincount",  # its length is max(x) + 1
}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def host_sync(func, args, kwargs) -> str | None:
    """Why the aten call ``func(*args, **kwargs)`` forces a device -> host sync on a GPU (a short name), or
    None where it does not: a scalar read, an output whose shape depends on values (``nonzero``,
    ``masked_select``, ``unique``, boolean indexing, ``repeat_interleave`` without ``output_size``), a
    bool result (``equal``), a copy from a device to the host, a blocking copy from the host to a device."""
    packet = func.overloadpacket
    if packet in _SYNC_OPS:
        return _SYNC_OPS[packet]
    if packet in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "boolean indexing"
    if packet is aten.repeat_interleave and func._overloadname in ("Tensor", "self_Tensor") \
            and kwargs.get("output_size") is None:  # tensor repeats: the output's length is their sum
        return "repeat_interleave without output_size"
    if packet in (aten._to_copy, aten.copy_):
        return _device_to_host(packet, args, kwargs)
    return None


def _device_to_host(packet, args, kwargs) -> str | None:
    if packet is aten._to_copy:
        source, target = args[0], kwargs.get("device")
        to_cpu = target is not None and torch.device(target).type == "cpu"
    else:  # copy_(dst, src[, non_blocking])
        target, source = args[0], args[1]
        if (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):  # into pinned memory: the host goes on
            return None
        to_cpu = getattr(target, "device", None) is not None and torch.device(target.device).type == "cpu"
    device = getattr(source, "device", None)
    if to_cpu and device is not None and torch.device(device).type not in ("cpu", "meta"):
        return "device to host copy"
    if packet is aten._to_copy and target is not None and torch.device(target).type != "cpu" and device is not None \
            and torch.device(device).type == "cpu" and not kwargs.get("non_blocking", False):
        return "host to device copy"  # from pageable memory, blocking: cudaMemcpy + cudaStreamSynchronize
    return None


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (``ops``, ``by_op``) and the host syncs among them
    (``syncs``, by kind; ``sync_ops``: the op names, e.g. ``aten._local_scalar_dense.default``).
    ``on_op(func, args, kwargs, out)`` is called for every op."""

    def __init__(self, on_op: Callable | None = None):
        super().__init__()
        self.on_op = on_op
        self.by_op: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()
        # "package/file.py:LINE function" of the code that asked for each sync (" via torch/...": through torch)
        self.sync_sites: Counter[str] = Counter()

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten":  # (not the profiler's record_function markers, ...)
            self.by_op[str(func.overloadpacket)] += 1
        why = host_sync(func, args, kwargs)
        if why:
            self.syncs[why] += 1
            self.sync_ops[str(func)] += 1
            self.sync_sites[_caller()] += 1
        out = func(*args, **kwargs)
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out

    def syncs_outside(self, *paths: str) -> int:
        """Host syncs whose site (:attr:`sync_sites`: the caller, and the torch module it went through) names
        none of ``paths`` (e.g. ``torch/optim/``)."""
        return sum(n for site, n in self.sync_sites.items() if not any(p in site for p in paths))

    def summary(self, top: int = 10) -> dict:
        """The counts as plain data (JSON): ops, host syncs by kind and by the code that asked, the most
        frequent ops."""
        return {"aten_ops": self.ops, "host_syncs": self.host_syncs, "syncs_by_kind": dict(self.syncs),
                "sync_ops": dict(self.sync_ops), "sync_sites": dict(self.sync_sites.most_common(top)),
                "top_ops": dict(self.by_op.most_common(top))}


def _caller() -> str:
    """Where a sync was asked for: ``package/file.py:LINE function`` of the innermost frame outside torch, and
    ``via`` the innermost one inside torch's public modules where that differs (e.g. ``torch/optim/...``)."""
    frame, inner = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        in_torch = "/torch/" in path
        internal = ("/torch/_" in path and "/torch/_refs" not in path) or path.endswith(
            ("/torch/utils/_python_dispatch.py", "concept/profiling.py"))
        if inner is None and not internal:
            inner = frame
        if not in_torch and not internal:
            break
        frame = frame.f_back
    outer = frame or inner
    if outer is None:
        return "?"
    return _where(outer) + (f" via {_where(inner)}" if inner is not None and inner is not outer else "")


def _where(frame) -> str:
    """``package/file.py:LINE function``: the path from an installed package's root or this project's folder."""
    parts = frame.f_code.co_filename.replace("\\", "/").split("/")
    starts = [i + 1 for i, p in enumerate(parts) if p in _INSTALLED] + [i for i, p in enumerate(parts) if p in _PACKAGES]
    rel = "/".join(parts[max(starts, default=len(parts) - 1):])
    return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"


_PACKAGES = ("concept", "plugins", "cli", "benchmarks", "tests")  # this project's folders: paths from there
_INSTALLED = ("site-packages", "dist-packages")  # installed packages: paths from below there


def count_ops(fn: Callable, *args, **kwargs) -> tuple[object, OpCounter]:
    """``fn(*args, **kwargs)`` under an :class:`OpCounter`: (its result, the counter)."""
    with OpCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter


# -- torch.profiler -------------------------------------------------------------------------------------
# CUDA runtime / driver calls: a kernel launch (eager, Triton's cuLaunchKernelEx, a CUDA graph replay as one
# launch), and a host wait for the device
_LAUNCH = ("LaunchKernel", "cudaGraphLaunch")
_SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def profile_call(fn: Callable[[], object], device: str | torch.device = "cpu", top: int = 12,
                 table_rows: int = 0, stacks: bool = False) -> dict:
    """``fn()`` once under ``torch.profiler`` (run it once before, so that warm-up and compilation stay out).

    Returns ``wall_s`` (the call, waited for), ``device_busy_s`` (the sum of its kernels' and copies' own
    device time, each counted once: :func:`device_time`; on a CPU the sum of the ops' own CPU time),
    ``kernel_launches``, ``host_syncs`` (the CUDA synchronisation calls made inside ``fn``: the one this
    function makes to wait for the device is not counted), ``sync_ops`` (aten ops that force a sync, by name),
    ``aten_ops`` (every aten op the profiler records, nested ones included), ``top_device`` (the ``top``
    kernels and copies with the most device time; on a CPU the ops with the most CPU time), ``short_kernels``
    (how many of them are a few microseconds a call, and their share: :func:`short_kernels`), ``top_cpu`` (the
    ``top`` operators with the most CPU time) and, with ``table_rows``, ``table``: the profiler's own table of
    that many rows. With ``stacks`` the profiler records Python's calls too (``with_stack``: slower, so not
    the call to time) and
    ``sync_stacks`` says where each host sync came from (:func:`sync_stacks`; where this torch's profiler records no
    Python frames, as torch 2.11's, from the ops :class:`concept.syncs.HostSyncs` counts in the call:
    :func:`dispatch_sync_stacks`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    by_dispatch = stacks and not profiler_records_python()  # (this torch's profiler records no Python frames)
    seen = HostSyncs(stacks=True) if by_dispatch else contextlib.nullcontext()
    with profile(activities=activities, with_stack=stacks) as prof:
        start = time.perf_counter()
        with seen:
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    syncs = sum(e.count for e in events if e.key in _SYNC_CALLS) - (1 if cuda else 0)
    sync_names = {f"aten::{str(op).split('.')[-1]}" for op in _SYNC_OPS}
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    out = {"wall_s": wall, **device_time(events, cuda, top),
           "kernel_launches": sum(e.count for e in events if any(k in e.key for k in _LAUNCH)),
           "host_syncs": max(0, syncs),
           "sync_ops": {e.key: e.count for e in events if e.key in sync_names},
           "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
           "top_cpu": [_row(e, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in top_cpu]}
    if stacks:
        out["sync_stacks"] = dispatch_sync_stacks(seen.stacks) if by_dispatch else sync_stacks(prof.events(), cuda)
    if table_rows:
        out["table"] = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                    row_limit=table_rows)
    return out


def device_time(events, cuda: bool, top: int = 12) -> dict:
    """``device_busy_s`` and ``top_device`` (the ``top`` entries with the most device time: ``op``, ``calls``,
    ``device_ms``, ``cpu_ms``) from the profiler's averaged ``events``. On CUDA only the device's own events
    count: kernels, copies and memsets (``device_type`` not CPU; not the device-side spans of annotated regions,
    e.g. ``Optimizer.step#AdamW.step``, which overlap their kernels): the sum torch's own table gives as "Self
    CUDA time total". An operator's self device time is the time of
    the kernels it launched, and those kernels are events of their own, so a sum over every event counted each
    kernel twice (``device_busy_s`` of the kits up to the H200 lease of 2026-11-27: about 2x; its compiled
    streaming step said 0.128 s where the profiler's own table sums 63 ms), and the top list named each cost
    twice, once as its op (or ``## Call CompiledFxGraph`` for a compiled region) and once as its kernel. On a
    CPU, which has no device events: the ops' own CPU time."""
    if cuda:
        from torch.autograd import DeviceType

        mine = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
        own = lambda e: e.self_device_time_total  # noqa: E731
    else:
        mine, own = list(events), (lambda e: e.self_cpu_time_total)
    ranked = sorted(mine, key=own, reverse=True)[:top]
    return {"device_busy_s": sum(own(e) for e in mine) / 1e6, "top_device": [_row(e, own(e)) for e in ranked],
            "short_kernels": short_kernels(mine, own)}


# a kernel whose mean call is shorter than this (microseconds) is "short": a GPU runs no GEMM in much less than a few
# microseconds, so a step made of them is bound by how many it runs, not by their bytes or FLOPs
# (``docs/benchmarks.md``, "The step's kernels at their floors")
SHORT_US = 5.0


def short_kernels(events, own) -> dict:
    """Of ``events`` (the device's averaged events: one a kernel name), those whose mean call takes under
    :data:`SHORT_US`: their ``calls`` and ``device_ms``, and their shares of all the calls and of the device time
    (``of_calls``, ``of_device``); ``split_k_reduce_calls``: cuBLAS's second kernel of a GEMM whose reduction it
    split (a GEMM with a small output over many rows: an adapter's weight gradient), counted apart."""
    calls = sum(e.count for e in events)
    busy = sum(own(e) for e in events)
    short = [e for e in events if e.count and own(e) / e.count < SHORT_US]
    short_calls, short_us = sum(e.count for e in short), sum(own(e) for e in short)
    return {"under_us": SHORT_US, "calls": short_calls, "device_ms": short_us / 1e3,
            "of_calls": short_calls / calls if calls else 0.0, "of_device": short_us / busy if busy else 0.0,
            "split_k_reduce_calls": sum(e.count for e in events if "splitKreduce" in e.key)}


def _row(event, device_us: float) -> dict:
    return {"op": event.key, "calls": event.count, "device_ms": device_us / 1e3,
            "cpu_ms": event.self_cpu_time_total / 1e3}


def sync_stacks(events, cuda: bool, frames: int = 8) -> list[dict]:
    """Where the host syncs of a profile taken ``with_stack`` came from, most frequent first: per distinct
    origin ``count``, ``call`` (on CUDA the runtime's synchronisation call, ``cudaStreamSynchronize``...; on a
    CPU, which has none, the aten op that would sync on a GPU: ``aten::_local_scalar_dense``...), ``ops`` (the
    aten ops it is nested in, innermost first), ``ours`` (the innermost frame in this project's code: what asked
    for it), ``torch`` (the innermost frame in torch's Python inside that: how; None when ours asked directly) and ``stack`` (the ``frames`` innermost Python
    frames, ``path(line of the function's definition): name``). The wait :func:`profile_call` itself makes for
    the device is left out."""
    sync_ops = {f"aten::{str(op).split('.')[-1]}" for op in _SYNC_OPS}
    found: dict[tuple, dict] = {}
    for event in events:
        if event.name not in (_SYNC_CALLS if cuda else sync_ops):
            continue
        chain = _parent_names(event)
        python = [_frame_name(name) for name in chain if _is_python_frame(name)]
        _count_origin(found, event.name, python, [name for name in chain if name.startswith("aten::")][:4], frames)
    return sorted(found.values(), key=lambda row: -row["count"])


def dispatch_sync_stacks(stacks: list[tuple[str, list[str]]], frames: int = 8) -> list[dict]:
    """:func:`sync_stacks`' rows from the syncs a :class:`concept.syncs.HostSyncs` counted with ``stacks`` (each
    op's name and the Python frames that made it, outermost first): ``call`` the aten op (or ``tensor from host
    data``), ``ops`` empty. For a torch whose profiler records no Python frames (torch 2.11, the GPU image's: the
    H200 lease of 2026-11-27 got no stack for two ``.item()`` calls). Under the counter (a dispatch mode) dynamo
    runs a compiled function's Python eagerly: the stacks of a compiled call are those of its eager twin."""
    found: dict[tuple, dict] = {}
    for name, stack in stacks:
        python = [_frame_name(f) for f in reversed(stack)]
        python = [f for f in python if not f.startswith(_COUNTER_FRAMES)]
        call = name if " " in name else f"aten::{name}"
        _count_origin(found, call, python, [], frames)
    return sorted(found.values(), key=lambda row: -row["count"])


# the counter's own frames and torch's between an op and the mode it calls (not where the sync came from)
_COUNTER_FRAMES = ("concept/syncs.py(", "torch/utils/_python_dispatch.py(", "torch/overrides.py(", "torch/_compile.py(",
                   "torch/_dynamo/eval_frame.py(")


def _count_origin(found: dict, call: str, python: list[str], ops: list[str], frames: int) -> None:
    """One sync of ``call`` whose Python frames (innermost first) are ``python`` into ``found``, by origin."""
    at = next((i for i, f in enumerate(python) if f.split("/", 1)[0] in _PACKAGES), len(python))
    ours = python[at] if at < len(python) else None
    if ours is not None and ours.startswith("concept/profiling.py("):  # profile_call's own wait for the device
        return
    inside_torch = next((f for f in python[:at] if f.startswith("torch/")), None)  # (called from ours)
    key = (call, ours, inside_torch, tuple(ops))
    if key not in found:
        found[key] = {"call": call, "count": 0, "ops": ops, "ours": ours, "torch": inside_torch,
                      "stack": python[:frames]}
    found[key]["count"] += 1


@functools.lru_cache(maxsize=None)
def profiler_records_python() -> bool:
    """Whether this torch's profiler, ``with_stack``, records the Python calls an op is made in (torch 2.13 does;
    the 2.11 of the GPU image records none): one tiny profiled call, once per process."""
    from torch.profiler import ProfilerActivity, profile

    def probe(x):
        return x.sum()

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        probe(torch.ones(2, device="cpu"))  # (the CPU profiler alone: the question is its Python tracer)
    return any(_is_python_frame(name) for event in prof.events() if event.name == "aten::sum"
               for name in _parent_names(event))


def _parent_names(event) -> list[str]:
    """The names of a profiler event's enclosing events, innermost first (ops, and with ``with_stack`` Python calls)."""
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _is_python_frame(name: str) -> bool:
    """A Python function event of ``with_stack`` (``/path/file.py(12): name``), not an op or a built-in."""
    return ".py(" in name and "): " in name


def _frame_name(name: str) -> str:
    """``path(LINE): name`` with the path from an installed package's root or this project's folder."""
    path, rest = name.split("(", 1)
    parts = path.replace("\\", "/").split("/")
    starts = [i + 1 for i, p in enumerate(parts) if p in _INSTALLED] + [i for i, p in enumerate(parts) if p in _PACKAGES]
    return "/".join(parts[max(starts, default=len(parts) - 1 if path.startswith("/") else 0):]) + "(" + rest
