"""The device scan's Triton kernels against the host scan, bit for bit, on the policies' own decisions.

Used two ways: ``TRITON_INTERPRET=1 python -m tests.device_scan_cases`` runs every check on CPU tensors
in Triton's interpreter and prints a JSON report (``tests/test_device_scan.py`` runs it in a subprocess:
the interpreter must be chosen before Triton is first imported, and no other test's Triton may see it), and
``tests/test_device_scan.py``'s ``cuda`` tests call the same checks on a GPU (compiled kernels).

Each case runs a policy's batched decision (``decide_with_state``: keep [B, T] and the state after the last
token) twice, with the device scan and with the host scan (``concept.streaming.device_scan.choose``), on
inputs with document starts, padding (left, right, holes), a row that keeps every token, a row that keeps
none, ``max_run`` / ``max_chunk`` forcing, B > 1 and T not a power of 2.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

from concept.streaming import chunks, device_scan, gap
from concept.streaming.host_scan import interval_bound
from plugins.length_policies.mtp import MTPPolicy, MTPPolicyConfig
from plugins.length_policies.null import NullPolicy, NullPolicyConfig
from plugins.length_policies.threshold import ThresholdPolicy, ThresholdPolicyConfig

B, T, K, D = 5, 23, 7, 8


def layout(device, seed=0):
    """valid [B, T] (row 0 full, 1 left-padded, 2 right-padded, 3 with holes, 4 full) and reset [B, T]."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :9] = False
    valid[2, -6:] = False
    valid[3] = torch.rand(T, generator=g) > 0.3
    reset = torch.rand(B, T, generator=g) < 0.12
    reset[:, 0] = True
    return valid.to(device), reset.to(device)


def intervals(shape, limit: int, generator) -> torch.Tensor:
    """Random allowance intervals packed as ``allowance`` packs them (``lo`` in 0..limit + 1, ``hi`` in -1..limit;
    empty ones where ``lo > hi``), for calling the tracked kernels' ops directly."""
    lo = torch.randint(0, limit + 2, shape, generator=generator)
    hi = torch.randint(-1, limit + 1, shape, generator=generator)
    return interval_bound(lo, hi)


def extremes(score: torch.Tensor, high: float) -> torch.Tensor:
    """Row 1 keeps at every token (score +high), row 4 at none (-high): on top of random rows."""
    score = score.clone()
    score[1], score[4] = high, -high
    return score


def null_case(device, max_run, track, seed):
    policy = NullPolicy(NullPolicyConfig(max_run=max_run, track=track), SimpleNamespace(concept_vocab_size=K))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, K + 1, generator=g) * 3
    logits[1, :, K], logits[4, :, K] = -1e4, 1e4  # the NULL logit: -1e4 keeps every token, +1e4 none
    policy, logits = policy.to(device), logits.to(device)
    return lambda valid, reset: policy.decide_with_state(None, logits, valid, reset)


def threshold_case(device, max_run, threshold, seed, dtype=torch.float32):
    config = ThresholdPolicyConfig(threshold=threshold, max_run=max_run)
    policy = ThresholdPolicy(config, SimpleNamespace(hidden_size=D))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        policy.score.weight.mul_(20)
    h = torch.randn(B, T, D, generator=g)
    h[1], h[4] = policy.score.weight.detach()[0], -policy.score.weight.detach()[0]  # p near 1; p near 0
    policy, h = policy.to(device), h.to(device)

    def decide(valid, reset):
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # float64: the sums in float64 (what init_state's sum + p_t is in)
        try:
            return policy.decide_with_state(h, None, valid, reset)
        finally:
            torch.set_default_dtype(before)
    return decide


def chunk_case(device, min_chunk, max_chunk, seed):
    g = torch.Generator().manual_seed(seed)
    unsure = extremes(torch.randn(B, T, generator=g), 1.0).to(device) > 0
    return lambda valid, reset: chunks.scan(unsure, valid, min_chunk, max_chunk, reset)


def mtp_case(device, min_chunk, max_chunk, track, seed):
    policy = MTPPolicy(MTPPolicyConfig(heads=1, min_chunk=min_chunk, max_chunk=max_chunk, track=track),
                       SimpleNamespace(hidden_size=D)).to(device)
    g = torch.Generator().manual_seed(seed)
    logit = extremes(torch.randn(B, T, generator=g) * 2, 1e4).to(device)
    policy.keep_logit = lambda head_logits, h: logit  # the confidences' log-odds, given (no MTP heads to bind)
    return lambda valid, reset: policy.decide_with_state(None, None, valid, reset)


def cases(device) -> dict:
    none = gap.NONE
    return {
        "null tracker max_run 3": null_case(device, 3, 0.25, 1),
        "null tracker max_run none": null_case(device, none, 0.25, 2),
        "null tracker strong": null_case(device, 2, 2.0, 3),
        "threshold float32 max_run 3": threshold_case(device, 3, 1.0, 4),
        "threshold float32 0.7 none": threshold_case(device, none, 0.7, 5),
        "threshold float64": threshold_case(device, 4, 0.7, 6, torch.float64),
        "chunk 2..4": chunk_case(device, 2, 4, 7),
        "chunk 1..none": chunk_case(device, 1, gap.UNBOUNDED, 8),
        "mtp tracked 2..5": mtp_case(device, 2, 5, 0.25, 9),
        "mtp tracked 1..none": mtp_case(device, 1, none, 1.0, 10),
    }


def outputs(decide, valid, reset, device: bool, rows: int = 16):
    with torch.no_grad(), device_scan.choose(device, rows):
        keep, state = decide(valid, reset)
    state = state if isinstance(state, tuple) else (state,)
    return keep, state


def same(a, b) -> bool:
    (keep_a, state_a), (keep_b, state_b) = a, b
    return torch.equal(keep_a, keep_b) and len(state_a) == len(state_b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(state_a, state_b))


def compare(device) -> dict:
    """Per case: equal (device scan == host scan, keep and every state field, bit for bit), and what the
    case exercised (kept tokens; whether row 1 kept every real token and row 4 none of its own choice)."""
    report = {}
    for seed, (name, decide) in enumerate(cases(device).items()):
        valid, reset = layout(device, seed)
        host = outputs(decide, valid, reset, False)
        result = {"equal": same(outputs(decide, valid, reset, True), host),
                  "kept": int(host[0].sum()), "real": int(valid.sum()),
                  "all_keep_row": bool(torch.equal(host[0][1], valid[1]))}
        if seed in (0, 3, 6, 8):  # each kernel with one program per row, as on a GPU (the interpreter: 16 rows)
            result["equal_one_row_per_program"] = same(outputs(decide, valid, reset, True, rows=1), host)
        if seed in (1, 4, 7, 9):  # each kernel on a batch without document starts (reset None)
            result["equal_without_reset"] = same(outputs(decide, valid, None, True),
                                                 outputs(decide, valid, None, False))
        report[name] = result
    return report


def negative_controls(device) -> dict:
    """Perturbed rules must be told apart by the same comparison: the device op run with ``max_run`` one
    more, with the document starts dropped, and `threshold`'s sums in float64 against the host's float32."""
    valid, reset = layout(device, 0)
    bound = intervals((B, T), T, torch.Generator().manual_seed(0)).to(device)
    ops = device_scan.ops()
    with device_scan.choose(True):
        right = ops.null_tracker_scan(valid, reset, bound, 3)
        off_by_one = ops.null_tracker_scan(valid, reset, bound, 4)
        no_reset = ops.null_tracker_scan(valid, None, bound, 3)
        p = torch.rand(B, T, generator=torch.Generator().manual_seed(1)).to(device) * 0.4
        sums32 = ops.threshold_scan(valid, reset, p, 1.0, gap.UNBOUNDED)
        sums64 = ops.threshold_scan(valid, reset, p.double(), 1.0, gap.UNBOUNDED)
    return {"max_run off by one": same((right[0], right[1:]), (off_by_one[0], off_by_one[1:])),
            "reset dropped": same((right[0], right[1:]), (no_reset[0], no_reset[1:])),
            "threshold sums in float64": bool(torch.equal(sums32[1].double(), sums64[1]))}


def interpreter_runs_the_broken_kernel(device="cpu") -> bool:
    """The negative control of ``tests/test_scan_kernel_builds.py``: its broken `threshold` kernel (the running
    sum starts as float32), which the compiler refuses for float64 p, runs here and decides exactly as the op
    (keep, sums, NULL runs): the interpreter cannot see the error."""
    from tests.scan_kernel_builds import broken_threshold_launch
    valid, reset = layout(device, 0)
    p = torch.rand(B, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device) * 0.4
    kernel, args, constants = broken_threshold_launch(valid, reset, p, 1.0, 3)
    kernel[(B,)](*args, **constants)
    with device_scan.choose(True):
        right = device_scan.ops().threshold_scan(valid, reset, p, 1.0, 3)
    keep, total, run = args[4], args[5], args[6]
    return same((keep, (total, run)), (right[0], right[1:])) and 0 < int(keep.sum()) < int(valid.sum())


FORWARD_POLICIES = ("null", "threshold", "mtp")  # each kernel: the tracker, the sums, the chunks


def forward_syncs(device="cpu") -> dict:
    """The decided forward of a tiny streaming model (static budget) per sequential policy, one per kernel, under
    ``HostSyncs`` with the device scan: its hidden and declared syncs, and whether its logits equal the host scan's
    bit for bit. The control: `null`'s forward with the host scan counts its declared scan."""
    from concept.syncs import HostSyncs
    from tests.conftest import mixed_model
    from tests.test_host_syncs import forward_inputs
    from tests.test_static_shapes import BACKENDS, budgeted

    report, inputs = {}, {k: v.to(device) for k, v in forward_inputs().items()}
    for policy in FORWARD_POLICIES:
        with budgeted(mixed_model(policy).to(device), 0.25, BACKENDS["chunked"]) as model, torch.no_grad():
            with device_scan.choose(True), HostSyncs() as seen:
                logits = model(**inputs).logits
            with device_scan.choose(False), HostSyncs() as host:
                host_logits = model(**inputs).logits if policy == "null" else None
            if host_logits is None:
                with device_scan.choose(False):
                    host_logits = model(**inputs).logits
        report[policy] = {"hidden": dict(seen.syncs), "declared": dict(seen.declared), "ops": seen.ops,
                          "host_declared": dict(host.declared), "same_logits": bool(torch.equal(logits, host_logits))}
    return report


def training_step_syncs() -> dict:
    """A streaming training step (``tests/test_host_syncs.py``'s: the default `null` policy with its tracker, the
    ratio controller and loss; after the first step) under ``HostSyncs``, with the device scan and, the control,
    with the host scan."""
    import tempfile
    from pathlib import Path

    from concept.syncs import HostSyncs
    from tests.test_host_syncs import static_run, static_trainer

    class Folders:  # pytest's tmp_path_factory, as static_run uses it
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name, dir=root))

    report = {}
    with tempfile.TemporaryDirectory() as root:
        trainer = static_trainer(static_run.__wrapped__(Folders()), None)
        for device in (True, False):
            with device_scan.choose(device), HostSyncs() as seen:
                trainer.queue_step()
            report["device scan" if device else "host scan"] = {"hidden": dict(seen.syncs),
                                                                 "declared": dict(seen.declared)}
        trainer.read_log()
    return report


def main() -> int:
    if not device_scan.interpreted():
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(json.dumps({"compare": compare("cpu"), "negative": negative_controls("cpu"),
                      "interpreter_runs_the_broken_kernel": interpreter_runs_the_broken_kernel(),
                      "forward": forward_syncs(),
                      "step": training_step_syncs()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
