"""``concept.profiling``: the op counter sees every op of a call and exactly the host syncs among them (each kind
against a sync-free twin that computes the same thing, the negative control), and the profiler summary."""
from __future__ import annotations

import pytest
import torch

from concept import profiling
from concept.profiling import OpCounter, count_ops, host_sync, profile_call

X = torch.arange(24.0).reshape(6, 4) - 7
MASK = X[:, 0] > 0
COUNTS = torch.tensor([1, 2, 0, 1, 1, 1])

# (kind, a call that syncs on a GPU, the same result without a sync)
PAIRS = [
    ("item", lambda: X.sum().item(), lambda: X.sum()),
    ("item", lambda: float(X[0, 0]), lambda: X[0, 0]),
    ("item", lambda: 1 if X.sum() > 0 else 0, lambda: (X.sum() > 0).long()),
    ("nonzero", lambda: X.nonzero(), lambda: torch.nonzero_static(X, size=X.numel())),
    ("nonzero", lambda: torch.where(MASK), lambda: torch.where(MASK, 1, 0)),
    ("boolean indexing", lambda: X[MASK], lambda: X * MASK[:, None]),
    ("boolean indexing", lambda: X.clone().__setitem__(MASK, 0.0), lambda: X.masked_fill(MASK[:, None], 0.0)),
    ("masked_select", lambda: X.masked_select(MASK[:, None]), lambda: X.where(MASK[:, None], 0.0)),
    ("unique", lambda: torch.unique(COUNTS), lambda: torch.sort(COUNTS)),
    ("repeat_interleave without output_size", lambda: torch.repeat_interleave(COUNTS),
     lambda: torch.repeat_interleave(COUNTS, output_size=6)),
    ("repeat_interleave without output_size", lambda: X.repeat_interleave(COUNTS, dim=0),
     lambda: X.repeat_interleave(2, dim=0)),
    ("equal", lambda: torch.equal(X, X), lambda: (X == X).all()),
]


@pytest.mark.parametrize("kind,syncs,free", PAIRS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(PAIRS)])
def test_each_sync_is_counted_and_its_sync_free_twin_is_not(kind, syncs, free):
    _, counter = count_ops(syncs)
    assert counter.host_syncs == 1 and dict(counter.syncs) == {kind: 1}, counter.summary()
    site = next(iter(counter.sync_sites))
    assert site.startswith("tests/test_profiling.py:"), site  # the line that asked, not torch's internals
    _, counter = count_ops(free)
    assert counter.host_syncs == 0, counter.summary()
    assert counter.ops >= 1


def test_ops_are_counted_by_name_forward_and_backward():
    w = torch.randn(4, 3, requires_grad=True)
    with OpCounter() as counter:
        (X @ w).relu().sum().backward()
    assert counter.by_op["aten.mm"] == 2  # X @ w, then w's gradient X^T @ g (X needs none)
    assert counter.by_op["aten.relu"] == 1 and counter.by_op["aten.threshold_backward"] == 1
    assert counter.ops == sum(counter.by_op.values()) and counter.host_syncs == 0


def test_on_op_sees_every_op_with_its_arguments():
    seen = []
    with OpCounter(on_op=lambda func, args, kwargs, out: seen.append((str(func.overloadpacket), out.dtype))):
        X.to(torch.bfloat16).sum()
    assert seen == [("aten._to_copy", torch.bfloat16), ("aten.sum", torch.bfloat16)]


def test_a_copy_to_the_host_counts_only_from_another_device():
    from types import SimpleNamespace

    gpu, cpu, meta = SimpleNamespace(device=torch.device("cuda", 0)), torch.ones(3), torch.ones(3, device="meta")
    to_copy, copy_ = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default
    assert host_sync(to_copy, (gpu,), {"device": torch.device("cpu")}) == "device to host copy"  # .cpu(), .tolist()
    assert host_sync(copy_, (cpu, gpu), {}) == "device to host copy"
    assert host_sync(to_copy, (gpu,), {"dtype": torch.bfloat16}) is None  # a cast on the device
    assert host_sync(copy_, (gpu, cpu), {}) is None  # host -> device: asynchronous
    assert host_sync(to_copy, (cpu,), {"device": torch.device("cpu")}) is None
    assert host_sync(to_copy, (meta,), {"device": "cpu"}) is None


def test_profile_call_reports_wall_busy_ops_and_the_top_operators():
    p = profile_call(lambda: (X @ X.T).relu().sum().item(), top=3, table_rows=5)
    assert p["wall_s"] > 0 and p["device_busy_s"] > 0 and p["aten_ops"] >= 4
    assert p["kernel_launches"] == 0 and p["host_syncs"] == 0  # a CPU: no kernels, no CUDA synchronisation
    assert p["sync_ops"] == {"aten::_local_scalar_dense": 1}
    assert len(p["top_device"]) == 3 and "Name" in p["table"]


def test_a_blocking_host_to_device_copy_is_a_sync():
    """A host tensor copied to another device (``meta`` stands in for CUDA here) waits for the device unless
    the copy is non-blocking (from pinned memory: ``concept.syncs.upload``); a copy within the host is none."""
    host = torch.tensor([1, 2, 3])
    with OpCounter() as counter:
        host.to("meta")
    assert dict(counter.syncs) == {"host to device copy": 1}
    with OpCounter() as counter:
        host.to("meta", non_blocking=True), host.to(torch.float64)
    assert not counter.syncs


def read_back(x):
    return x.sum().item()


def through_torch(x):
    return torch.unique(x)  # (torch/functional.py's wrapper calls the aten op)


@pytest.mark.skipif(not profiling.profiler_records_python(), reason="this torch's profiler records no Python frames "
                    "(torch 2.11): the stacks come from the dispatch counter, tested below")
def test_profile_call_with_stacks_says_where_each_sync_came_from():
    """``stacks``: per origin of a host sync (on a CPU the aten op that would sync on a GPU) its count, the
    innermost frame of this project's code, the torch frame inside it and the stack; a sync-free twin has none."""
    def both():
        read_back(X), read_back(X), through_torch(COUNTS)

    found = profile_call(both, stacks=True)["sync_stacks"]
    assert [(r["call"], r["count"]) for r in found] == [("aten::_local_scalar_dense", 2), ("aten::_unique2", 1)]
    item, unique = found
    assert item["ours"].startswith("tests/test_profiling.py(") and item["ours"].endswith(": read_back")
    assert item["torch"] is None and item["ops"] == ["aten::item"] and item["stack"][0] == item["ours"]
    assert item["stack"][1].endswith(": both")
    assert unique["ours"].endswith(": through_torch") and unique["torch"].startswith("torch/functional.py(")
    assert profile_call(lambda: X.sum() * 2, stacks=True)["sync_stacks"] == []  # the sync-free twin
    assert "sync_stacks" not in profile_call(lambda: X.sum().item())  # (only when asked: with_stack is slower)


def test_sync_stacks_leave_out_profile_calls_own_wait():
    """On CUDA ``profile_call`` waits for the device itself (``torch.cuda.synchronize``, under torch's frame):
    that wait is not the call's. Stand-in: the profiler's events of a CUDA run, as ``sync_stacks`` reads them."""
    from types import SimpleNamespace as Event

    from concept.profiling import sync_stacks

    def chain(*names):
        parent = None
        for name in reversed(names):
            parent = Event(name=name, cpu_parent=parent)
        return parent

    own = chain("cudaDeviceSynchronize", "torch/cuda/__init__.py(1080): synchronize",
                "/x/concept/profiling.py(190): profile_call")
    asked = chain("cudaStreamSynchronize", "aten::_local_scalar_dense", "aten::item",
                  "/x/plugins/attention/flex.py(80): slot_ranges", "/x/concept/profiling.py(190): profile_call")
    found = sync_stacks([own, asked], cuda=True)
    assert [(r["call"], r["ours"], r["ops"]) for r in found] == [
        ("cudaStreamSynchronize", "plugins/attention/flex.py(80): slot_ranges",
         ["aten::_local_scalar_dense", "aten::item"])]


def test_device_time_counts_each_kernel_once_and_lists_kernels_not_the_ops_that_launched_them():
    """On CUDA the profiler lists an op with its kernels' time as its own (``self_device_time_total``) and each
    kernel as an event of its own: the busy time and the top list take the device's events only, without the
    device-side spans of annotated regions. Stand-in: the averaged events of a CUDA profile (an op, its kernel, a
    compiled region and its Triton kernel, a copy, the optimizer step's span).
    Negative control: the sum over every event, the kits' measure up to the H200 lease of 2026-11-27b, is twice
    the device's time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from concept.profiling import device_time

    def event(key, device_us, cpu_us, kind, count=1, annotation=False):
        return SimpleNamespace(key=key, count=count, self_device_time_total=device_us, self_cpu_time_total=cpu_us,
                               device_type=kind, is_user_annotation=annotation)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [event("aten::mm", 4000.0, 70.0, cpu, 53), event("nvjet_sm90_gemm", 4000.0, 0.0, gpu, 53),
              event("## Call CompiledFxGraph f1 ##", 9000.0, 2300.0, cpu, 8),
              event("triton_per_fused_rms_norm_0", 9000.0, 0.0, gpu, 8),
              event("aten::copy_", 1500.0, 900.0, cpu, 149),
              event("Memcpy DtoD (Device -> Device)", 1500.0, 0.0, gpu, 188),
              event("Optimizer.step#AdamW.step", 20000.0, 0.0, gpu, 1, annotation=True)]  # a span over kernels
    found = device_time(events, cuda=True, top=2)
    assert found["device_busy_s"] == pytest.approx(0.0145)  # 4 + 9 + 1.5 ms, each once
    assert [(r["op"], r["calls"], r["device_ms"]) for r in found["top_device"]] == [
        ("triton_per_fused_rms_norm_0", 8, 9.0), ("nvjet_sm90_gemm", 53, 4.0)]
    naive = sum(e.self_device_time_total for e in events if not e.is_user_annotation) / 1e6
    assert naive == pytest.approx(2 * found["device_busy_s"])
    on_cpu = device_time(events[:-1], cuda=False, top=1)  # a CPU: the ops' own CPU time, every event
    assert on_cpu["device_busy_s"] == pytest.approx(0.00327) and on_cpu["top_device"][0]["op"].startswith("## Call")


def test_without_the_profilers_python_frames_the_stacks_come_from_the_dispatch_counter(monkeypatch):
    """A torch whose profiler records no Python frames (2.11, the GPU image's: ``profiler_records_python``) still
    says where each sync came from: the ops ``HostSyncs`` counts in the call, each with the Python stack that made
    it (the counter's and torch's dispatch frames left out). Negative control: the profiler's rows of the same
    call, stripped of their Python frames as 2.11 gives them, name no origin."""
    def both():
        read_back(X), read_back(X), through_torch(COUNTS)

    monkeypatch.setattr(profiling, "profiler_records_python", lambda: False)
    found = profile_call(both, stacks=True)["sync_stacks"]
    assert [(r["call"], r["count"]) for r in found] == [("aten::_local_scalar_dense", 2), ("aten::_unique2", 1)]
    item, unique = found
    assert item["ours"].startswith("tests/test_profiling.py(") and item["ours"].endswith(": read_back")
    assert item["torch"] is None and item["stack"][0] == item["ours"] and item["stack"][1].endswith(": both")
    assert unique["ours"].endswith(": through_torch") and unique["torch"].startswith("torch/functional.py(")
    assert profile_call(lambda: X.sum() * 2, stacks=True)["sync_stacks"] == []  # the sync-free twin
    stripped = profiling.sync_stacks([_NoFrames(e) for e in _profiled_events(both)], cuda=False)
    assert stripped and all(r["ours"] is None and r["stack"] == [] for r in stripped)


class _NoFrames:
    """A profiler event as torch 2.11 gives it: its parents are ops only."""

    def __init__(self, event):
        self.name, parent = event.name, event.cpu_parent
        while parent is not None and profiling._is_python_frame(parent.name):
            parent = parent.cpu_parent
        self.cpu_parent = None if parent is None else _NoFrames(parent)


def _profiled_events(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    return prof.events()


def test_short_kernels_are_counted_with_their_share_of_calls_and_device_time():
    """``short_kernels``: the kernels whose mean call is under ``SHORT_US`` (5 us), with their shares, and cuBLAS's
    split-K reductions apart. Stand-in: a GEMM at 4.25 us a call (short), a split-K reduction at 2.3 us (short), a
    long GEMM at 50 us. Negative control: every kernel long, none counted."""
    from types import SimpleNamespace

    from concept.profiling import short_kernels

    def event(key, count, mean_us):
        return SimpleNamespace(key=key, count=count, self_device_time_total=count * mean_us)

    own = lambda e: e.self_device_time_total  # noqa: E731
    events = [event("nvjet_sm90_tst_32x64_64x16_1x4_h_bz_NNN", 126, 4.25),
              event("void cublasLt::splitKreduce_kernel<32, 16, int, float>", 444, 2.3),
              event("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", 100, 50.0)]
    found = short_kernels(events, own)
    assert found["calls"] == 570 and found["device_ms"] == pytest.approx((126 * 4.25 + 444 * 2.3) / 1e3)
    assert found["of_calls"] == pytest.approx(570 / 670)
    assert found["of_device"] == pytest.approx((126 * 4.25 + 444 * 2.3) / (126 * 4.25 + 444 * 2.3 + 5000))
    assert found["split_k_reduce_calls"] == 444
    long = short_kernels([event("a", 3, 6.0), event("b", 1, 80.0)], own)
    assert long["calls"] == 0 and long["of_device"] == 0 and long["split_k_reduce_calls"] == 0
    assert short_kernels([], own)["of_calls"] == 0
