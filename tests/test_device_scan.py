"""The length policies' sequential scan on the device (``concept.streaming.device_scan``: one Triton kernel per
rule, registered as ``torch.library.triton_op``s) against the host scan it replaces on CUDA.

On CPU, in Triton's interpreter (a subprocess, ``tests/device_scan_cases.py``: the interpreter must be chosen
before Triton is first imported): every rule (`null`'s tracker, `threshold`'s float32 and float64 sums, the
chunk rule with and without `mtp`'s tracker) decides the same keep and final states as the host scan, bit for
bit, with document starts, padding, a row that keeps every token and one that keeps none, forcing, B > 1, T not a
power of 2, one row or 16 rows per program; perturbed rules (``max_run`` off by one, the document starts dropped,
float64 sums) are told apart; a decided forward and a streaming training step with the device scan make no host
sync, declared ones included (the control, the host scan, declares its one), and the forward gives the same
logits. In this process (Triton compiled, no
GPU): each op's body, traced on fake tensors, is allocations and one kernel launch, nothing read back (the
control: an ``.item()`` added to a body is seen). Marked ``cuda`` (the GPU kit's ``exact`` stage runs them): the
same checks with the compiled kernels, ``torch.compile(fullgraph=True)`` of the ops and of a decision, and a
streaming training step with no host sync.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from concept.streaming import device_scan
from concept.syncs import SYNC_OPS
from tests.conftest import WRAP_TRITON_REFUSES, interpreter_report

needs_triton = pytest.mark.skipif(not device_scan.AVAILABLE, reason="triton is not installed")
pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreted():
    """The report of ``tests/device_scan_cases.py`` run in Triton's interpreter on CPU tensors."""
    return interpreter_report("tests.device_scan_cases", skip_on=WRAP_TRITON_REFUSES)


def test_every_kernel_equals_the_host_scan_bit_for_bit(interpreted):
    compare = interpreted["compare"]
    assert len(compare) == 10
    for name, case in compare.items():
        assert case["equal"], name
        assert case.get("equal_one_row_per_program", True) and case.get("equal_without_reset", True), name
        assert 0 < case["kept"] < case["real"], name  # decisions that vary (neither all nor none)
    assert sum(case["all_keep_row"] for case in compare.values()) >= 7  # the row that keeps every real token
    assert sum("equal_one_row_per_program" in case for case in compare.values()) == 4
    assert sum("equal_without_reset" in case for case in compare.values()) == 4


def test_negative_controls_perturbed_rules_are_told_apart(interpreted):
    assert interpreted["negative"] == {"max_run off by one": False, "reset dropped": False,
                                       "threshold sums in float64": False}


def test_the_interpreter_runs_a_kernel_the_compiler_refuses(interpreted):
    """Why ``tests/test_scan_kernel_builds.py`` compiles the kernels: its broken kernel decides right here."""
    assert interpreted["interpreter_runs_the_broken_kernel"] is True


def test_a_decided_forward_with_the_device_scan_has_no_host_sync(interpreted):
    forward = interpreted["forward"]
    assert set(forward) == {"null", "threshold", "mtp"}
    for policy, seen in forward.items():
        assert seen["hidden"] == {} and seen["declared"] == {}, policy
        assert seen["same_logits"], policy
    assert forward["null"]["host_declared"] == {"policy scan": 1}  # the control: the host scan declares its sync


def test_a_streaming_training_step_with_the_device_scan_has_no_host_sync(interpreted):
    assert interpreted["step"] == {"device scan": {"hidden": {}, "declared": {}},
                                   "host scan": {"hidden": {}, "declared": {"policy scan": 1}}}  # (the control)


def traced_calls(body, *args) -> list[str]:
    from torch.fx.experimental.proxy_tensor import make_fx
    graph = make_fx(body, tracing_mode="fake")(*args).graph
    return [str(node.target) for node in graph.nodes if node.op == "call_function"]


def scan_kernels():
    from concept.streaming import scan_kernels  # Triton compiled (no interpreter in this process), no launch
    return scan_kernels


def op_bodies():
    """Each op's Python body (what ``torch.compile`` traces, and what runs on CUDA) with small inputs."""
    valid = torch.ones(3, 7, dtype=torch.bool)
    reset = torch.zeros(3, 7, dtype=torch.bool)
    bound = torch.zeros(3, 7, dtype=torch.long)
    return {
        "null_tracker_scan": (lambda v, r, b: scan_kernels().null_tracker_scan._abstract_fn(v, r, b, 3),
                              (valid, reset, bound)),
        "chunk_scan": (lambda v, r, u: scan_kernels().chunk_scan._abstract_fn(v, r, u, 2, 4), (valid, reset, valid)),
        "tracked_chunk_scan": (lambda v, r, b: scan_kernels().tracked_chunk_scan._abstract_fn(v, r, b, 2, 4),
                               (valid, reset, bound)),
        "threshold_scan": (lambda v, r, p: scan_kernels().threshold_scan._abstract_fn(v, r, p, 0.7, 3),
                           (valid, reset, torch.rand(3, 7))),
    }


ALLOCATIONS = {"aten.empty.memory_format", "aten.zeros.default", "aten.full.default"}


@pytest.mark.parametrize("op", ["null_tracker_scan", "chunk_scan", "tracked_chunk_scan", "threshold_scan"])
def test_each_op_is_allocations_and_one_kernel_launch(op):
    body, args = op_bodies()[op]
    calls = traced_calls(body, *args)
    assert calls.count("triton_kernel_wrapper_mutation") == 1
    assert set(calls) - {"triton_kernel_wrapper_mutation"} <= ALLOCATIONS, calls
    assert not {c.split(".")[1] for c in calls if c.startswith("aten.")} & SYNC_OPS


def test_negative_control_a_read_back_in_an_op_is_seen():
    body, args = op_bodies()["null_tracker_scan"]

    def reads(*xs):
        out = body(*xs)
        out[1].sum().item()
        return out

    assert "aten._local_scalar_dense.default" in traced_calls(reads, *args)


def test_the_host_scan_is_chosen_without_a_gpu():
    assert not device_scan.runs_on("cpu") and not device_scan.runs_on("meta")
    with device_scan.choose(False):
        assert not device_scan.runs_on("cuda")


# -- on a GPU (the GPU kit's `exact` stage) -------------------------------------------------------------------


@pytest.mark.parametrize("part", ["compare", "negative", "forward"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_kernels_equal_the_host_scan_on_cuda(part):
    from tests import device_scan_cases as cases
    if part == "compare":
        report = cases.compare("cuda")
        assert all(c["equal"] and c.get("equal_without_reset", True) and c.get("equal_one_row_per_program", True)
                   for c in report.values()), report
    elif part == "negative":
        assert not any(cases.negative_controls("cuda").values())
    else:
        for policy, seen in cases.forward_syncs("cuda").items():
            assert seen["hidden"] == {} and seen["declared"] == {} and seen["same_logits"], (policy, seen)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_ops_and_a_decision_compile_fullgraph_on_cuda():
    """``torch.compile(fullgraph=True)`` traces the ops (inductor calls the kernels): the same outputs, and the
    default policy's whole decision compiled decides the same."""
    from tests import device_scan_cases as cases
    torch._dynamo.reset()
    valid, reset = cases.layout("cuda", 0)
    g = torch.Generator().manual_seed(0)
    bound = cases.intervals(valid.shape, cases.T, g).to("cuda")
    p = torch.rand(valid.shape, generator=g).to("cuda")
    ops = device_scan.ops()
    calls = [lambda: ops.null_tracker_scan(valid, reset, bound, 3),
             lambda: ops.tracked_chunk_scan(valid, reset, bound, 2, 4),
             lambda: ops.chunk_scan(valid, None, p > 0.5, 1, 3),
             lambda: ops.threshold_scan(valid, reset, p, 1.0, 3)]
    for call in calls:
        eager, compiled = call(), torch.compile(call, fullgraph=True)()
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    decide = cases.cases("cuda")["null tracker max_run 3"]
    with torch.no_grad():
        eager = decide(valid, reset)
        compiled = torch.compile(decide, fullgraph=True)(valid, reset)
    assert cases.same(eager, compiled)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_streaming_training_step_on_cuda_has_no_host_sync(tmp_path_factory):
    """The streaming training step of ``tests/test_host_syncs.py`` (the default `null` policy with its tracker,
    the ratio controller and loss), on CUDA: with the scan on the device, no sync in the step, declared or not."""
    from concept.syncs import HostSyncs
    from tests.test_host_syncs import static_run, static_trainer
    trainer = static_trainer(static_run.__wrapped__(tmp_path_factory), None)
    assert torch.device(trainer.device).type == "cuda"
    with HostSyncs() as seen:
        trainer.queue_step()
    assert seen.hidden == 0 and dict(seen.declared) == {}, (dict(seen.syncs), dict(seen.declared))


def test_a_kernel_failing_on_its_first_call_falls_back_to_the_host_scan_with_a_warning(monkeypatch):
    """A device kernel that cannot run here (Triton refuses this GPU) warns once and the rule decides on the host,
    the same decisions; a kernel that has run once and then fails raises (the control: no silent fallback)."""
    from concept.streaming import scan
    from concept.streaming.chunks import rule

    class Broken:
        calls = 0

        def chunk_scan(self, *args):
            Broken.calls += 1
            raise RuntimeError("PTX for this GPU could not be compiled")

    monkeypatch.setattr(device_scan, "runs_on", lambda device: True)
    monkeypatch.setattr(device_scan, "ops", lambda: Broken())
    monkeypatch.setattr(scan, "_failed", set())
    monkeypatch.setattr(scan, "_proven", set())
    g = torch.Generator().manual_seed(0)
    unsure = torch.rand(3, 17, generator=g) > 0.6
    valid = torch.ones(3, 17, dtype=torch.bool)
    device = scan.DeviceRule("chunk_scan", (2, 5))
    with pytest.warns(RuntimeWarning, match=r"concept::chunk_scan\) failed on its first call on cpu.*PTX"):
        keep, (count,) = scan.scan_rule(device, [unsure], valid, None, (torch.long,))
    host_keep, finals = scan.scan_rows(rule(2, 5), (0,), [unsure], valid)  # (the host scan itself)
    host_count = torch.tensor([state[0] for state in finals])
    assert torch.equal(keep, host_keep) and torch.equal(count, host_count)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the failed kernel is not tried again
        scan.scan_rule(device, [unsure], valid, None, (torch.long,))
    assert Broken.calls == 1
    # the control: a kernel that has run raises when it fails later
    scan._failed.clear()
    scan._proven.add(("chunk_scan", "cpu", True, (torch.bool,), ()))
    with pytest.raises(RuntimeError, match="PTX"):
        scan.scan_rule(device, [unsure], valid, None, (torch.long,))
