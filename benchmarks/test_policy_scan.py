"""The default length policy's batched decision (`null` with its ratio tracker: a scan of its step rule,
run on the host on a CPU, as a Triton kernel on CUDA) against its step rule looped over the tokens with
tensor ops (what decoding does one token at a time, and what the batched decision did before), side by
side on the same head logits; on CUDA also the host scan against the device scan.

    .venv/bin/python -m pytest benchmarks/test_policy_scan.py
    .venv/bin/python -m pytest benchmarks/test_policy_scan.py --device cuda --long    # + the GPU cases

All make the same decisions with the same arithmetic (no FLOP ideal: its rows carry none): the loop pays a
dozen small tensor ops per token (kernel launches on a GPU), the host scan one copy to the host (a host
sync) and well under a microsecond per token, the device scan one kernel launch and no sync
(``concept.streaming.device_scan``). Every forward of a streaming model in training and evaluation decides
this way.
"""
from __future__ import annotations

import pytest
import torch

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.decoding import select_rows
from concept.streaming import device_scan
from plugins.length_policies.null import NullPolicy, NullPolicyConfig

from .conftest import GPU_LENGTHS, gpu_case, side_by_side

K = 4096  # concept classes (the default vocabulary); the head's logits are [B, T, K + 1]


class _Context:
    concept_vocab_size = K


def step_loop(policy, head_logits, valid):
    """The step rule over t, batched over the rows (padding leaves a row's state as it is)."""
    state = policy.init_state(valid.shape[0], valid.device)
    keeps = []
    for t in range(valid.shape[1]):
        keep, new = policy.step(None, head_logits[:, t], state)
        keeps.append(keep & valid[:, t])
        state = select_rows(valid[:, t], new, state)
    return torch.stack(keeps, 1)


def scan_name(device) -> str:
    """What ``policy.decide`` runs here: the device scan on CUDA with Triton, the host scan otherwise."""
    return "device scan" if device_scan.runs_on(device) else "host scan"


def default_policy(device, B: int, T: int):
    policy = NullPolicy(NullPolicyConfig(), _Context()).to(device)
    policy.target_ratio.fill_(DEFAULT_TARGET_RATIO)
    g = torch.Generator().manual_seed(0)
    head_logits = (torch.randn(B, T, K + 1, generator=g) * 2).to(device)
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
    return policy, head_logits, valid


def measure(benchmark, record, device, B: int, T: int, name: str):
    policy, head_logits, valid = default_policy(device, B, T)
    with torch.no_grad():
        batched = policy.decide(None, head_logits, valid)
        assert torch.equal(batched, step_loop(policy, head_logits, valid))  # the same decisions
        if benchmark.disabled:  # smoke run (CI): checked once, no timing claims
            return
        timing = side_by_side(lambda: step_loop(policy, head_logits, valid),
                              lambda: policy.decide(None, head_logits, valid), device=device)
        benchmark.pedantic(lambda: policy.decide(None, head_logits, valid), rounds=3, iterations=1)
    # the same decisions and arithmetic both ways: no FLOP ideal (None), the sides named as what they are
    record(benchmark, name, timing, None, B=B, T=T, ratio=float(batched.float().mean()), suite="policy-scan",
           sides=["step loop", scan_name(device)])


CASES = [(16, 128), (1, 2048)]


@pytest.mark.parametrize("B,T", CASES, ids=[f"B{b}-T{t}" for b, t in CASES])
def test_tracker_scan_vs_step_loop(benchmark, record, device, B, T):
    measure(benchmark, record, device, B, T, f"null tracker B={B} T={T}: step loop vs {scan_name(device)}")


@pytest.mark.parametrize("T", GPU_LENGTHS, ids=[f"default-T{t}" for t in GPU_LENGTHS])
def test_tracker_scan_vs_step_loop_on_the_gpu(benchmark, record, request, device, T):
    gpu_case(request, device, T, real_backbone=False)
    measure(benchmark, record, device, 1, T, f"null tracker default B=1 T={T}: step loop vs {scan_name(device)}")


DEVICE_CASES = [(1, T) for T in GPU_LENGTHS] + [(128, 128)]  # one long row; the demo recipe's batch


def two_ways_on_the_gpu(benchmark, record, device, B: int, T: int, name: str, sides: list, first):
    """The default policy's decision on CUDA both ways, side by side: ``first(decide)`` (the way it is compared
    with: the decision called under some other setting) against ``decide`` as the model runs it; the same
    decisions asserted."""
    policy, head_logits, valid = default_policy(device, B, T)

    def decide():
        return policy.decide(None, head_logits, valid)

    with torch.no_grad():
        decisions = decide()
        assert torch.equal(decisions, first(decide))  # the same decisions
        if benchmark.disabled:
            return
        timing = side_by_side(lambda: first(decide), decide, device=device)
        benchmark.pedantic(decide, rounds=3, iterations=1)
    record(benchmark, name, timing, None, B=B, T=T, ratio=float(decisions.float().mean()), suite="policy-scan",
           sides=sides)


@pytest.mark.parametrize("B,T", DEVICE_CASES, ids=[f"default-B{b}-T{t}-device" for b, t in DEVICE_CASES])
def test_host_scan_vs_device_scan_on_the_gpu(benchmark, record, request, device, B, T):
    """The same decision both ways on CUDA: the host scan (a host sync, the decisions copied back) against the
    Triton kernel (one launch, nothing read back)."""
    gpu_case(request, device, T, real_backbone=False)
    if not device_scan.runs_on(device):
        pytest.skip("the device scan needs triton")

    def on_the_host(decide):
        with device_scan.choose(False):
            return decide()

    two_ways_on_the_gpu(benchmark, record, device, B, T, f"null tracker default B={B} T={T}: host scan vs device scan",
                        ["host scan", "device scan"], on_the_host)


@pytest.mark.parametrize("B,T", DEVICE_CASES, ids=[f"default-B{b}-T{t}-unroll" for b, t in DEVICE_CASES])
def test_device_scan_loop_unrolled_on_the_gpu(benchmark, record, request, device, B, T, monkeypatch):
    """The device scan's two loop shapes on CUDA: one token per iteration of the loop over t (each token's
    loads after the last one's store) against ``scan_kernels.UNROLL`` tokens per iteration (their loads issued
    together, ahead of the updates); the same decisions. The unrolled loop's gain is an estimate read from its
    SASS (``docs/benchmarks.md``) until this row measures it."""
    gpu_case(request, device, T, real_backbone=False)
    if not device_scan.runs_on(device):
        pytest.skip("the device scan needs triton")
    from concept.streaming import scan_kernels  # (imports Triton: on a GPU run only)
    unroll = scan_kernels.UNROLL

    def one_token_per_iteration(decide):
        with monkeypatch.context() as patch:
            patch.setattr(scan_kernels, "UNROLL", 1)
            return decide()

    two_ways_on_the_gpu(benchmark, record, device, B, T,
                        f"null tracker default B={B} T={T}: device scan, loop by 1 vs by {unroll} tokens",
                        ["loop by 1", f"loop by {unroll}"], one_token_per_iteration)
