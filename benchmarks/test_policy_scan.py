"""The default length policy's batched decision (`null` with its ratio tracker: a scan of its step rule,
run on the host) against its step rule looped over the tokens with tensor ops (what decoding does one
token at a time, and what the batched decision did before), side by side on the same head logits.

    .venv/bin/python -m pytest benchmarks/test_policy_scan.py
    .venv/bin/python -m pytest benchmarks/test_policy_scan.py --device cuda --long    # + the GPU cases

Both make the same decisions with the same arithmetic (no FLOP ideal: its rows carry none): the loop pays a dozen small
tensor ops per token (kernel launches on a GPU), the scan one copy to the host and well under a
microsecond per token. Every forward of a streaming model in training and evaluation decides this way.
"""
from __future__ import annotations

import pytest
import torch

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO
from concept.decoding import select_rows
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


def measure(benchmark, record, device, B: int, T: int, name: str):
    policy = NullPolicy(NullPolicyConfig(), _Context()).to(device)
    policy.target_ratio.fill_(DEFAULT_TARGET_RATIO)
    g = torch.Generator().manual_seed(0)
    head_logits = (torch.randn(B, T, K + 1, generator=g) * 2).to(device)
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
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
           sides=["step loop", "host scan"])


CASES = [(16, 128), (1, 2048)]


@pytest.mark.parametrize("B,T", CASES, ids=[f"B{b}-T{t}" for b, t in CASES])
def test_tracker_scan_vs_step_loop(benchmark, record, device, B, T):
    measure(benchmark, record, device, B, T, f"null tracker B={B} T={T}: step loop vs host scan")


@pytest.mark.parametrize("T", GPU_LENGTHS, ids=[f"default-T{t}" for t in GPU_LENGTHS])
def test_tracker_scan_vs_step_loop_on_the_gpu(benchmark, record, request, device, T):
    gpu_case(request, device, T, real_backbone=False)
    measure(benchmark, record, device, 1, T, f"null tracker default B=1 T={T}: step loop vs host scan")
