"""The host-side scan of sequential length-policy rules (concept.streaming.host_scan): the integer
allowance equals the float test it replaces, element by element, ties included, and the row scan
follows its padding and document-start rules, each checked against an obviously correct loop."""
import math

import pytest
import torch

from concept.streaming.host_scan import (allowance, interval_admits, interval_bound, interval_ends, scan_rows,
                                        state_tensors)
from concept.syncs import HostSyncs


def brute_allowance(score, price, limit, strict):
    """The set of counts c in 0..limit that pass the tensor test, by trying every c: [..., limit + 1] bool."""
    columns = []
    for c in range(limit + 1):
        margin = score - price * torch.tensor(float(c), dtype=score.dtype)
        columns.append(margin > 0 if strict else margin >= 0)
    return torch.stack(columns, -1)


def passing(bound, limit):
    """The counts in 0..limit that ``allowance``'s interval ``bound`` admits: [..., limit + 1] bool."""
    return interval_admits(torch.arange(limit + 1), bound[..., None])


def scores(price, limit, g):
    ties = price * torch.randint(-5, limit + 5, (200,), generator=g).float()  # exactly on a count's edge
    near = ties + torch.randn(200, generator=g) * 1e-6
    return torch.cat([torch.randn(400, generator=g) * 30, ties, near,
                      torch.tensor([0.0, -0.0, 1e9, -1e9, math.inf, -math.inf, math.nan])])


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("price", [2.0, 0.5, 1 / 3, 1e-3, 7.0, -2.0, -0.3, 0.0])
def test_allowance_equals_trying_every_count(strict, price):
    """Every sign of price: falling (the trackers' positive price), rising (negative: a target ratio below
    0, e.g. randomised weights) or constant (0)."""
    g = torch.Generator().manual_seed(0)
    price, limit = torch.tensor(price, dtype=torch.float32), 60
    score = scores(price, limit, g)
    with HostSyncs() as seen:
        bound = allowance(score, price, limit, strict)
    assert seen.hidden == 0  # nothing read back to the host: the sign of the price is chosen on the device
    want = brute_allowance(score, price, limit, strict)
    assert bound.dtype == torch.long and bound.shape == score.shape
    assert torch.equal(passing(bound, limit), want)
    assert want.all(-1).any() and (~want).all(-1).any()  # both ends were reached


def test_allowance_catches_a_count_that_is_one_off():
    """Negative control: the tie cases tell a non-strict test from a strict one."""
    price = torch.tensor(2.0)
    score = price * torch.arange(10).float()
    bound = allowance(score, price, 20, strict=True)
    assert not torch.equal(passing(bound, 20), brute_allowance(score, price, 20, False))


@pytest.mark.parametrize("lo", [0, 1, 7, 2 ** 31 - 2])
@pytest.mark.parametrize("hi", [-1, 0, 6, 7, 2 ** 31 - 1])
def test_an_interval_unpacks_to_its_ends(lo, hi):
    """``lo * 2**32 + hi`` back to (lo, hi) for every int32 ``hi`` from -1 (an empty interval at 0) and any ``lo``,
    as integers and as int64 tensors, and as the kernels read it: ``hi`` the low 32 bits as an int32."""
    bound = interval_bound(lo, hi)
    assert interval_ends(bound) == (lo, hi)
    ends = interval_ends(torch.tensor([bound]))
    assert (int(ends[0]), int(ends[1])) == (lo, hi)
    assert int(torch.tensor([bound]).to(torch.int32)) == hi


def run_length_rule(state, x_t):
    """A toy sequential rule: keep when the running sum reaches 3 (then restart)."""
    total = state[0] + x_t
    return (True, (0,)) if total >= 3 else (False, (total,))


def loop_reference(x, valid, reset):
    """The same rule with tensor ops, one column at a time (padding leaves the state; a document
    start resets it before its token)."""
    B, T = x.shape
    total = torch.zeros(B, dtype=torch.long)
    keep = torch.zeros(B, T, dtype=torch.bool)
    for t in range(T):
        if reset is not None:
            total = torch.where(reset[:, t], torch.zeros_like(total), total)
        new = total + x[:, t]
        k = (new >= 3) & valid[:, t]
        keep[:, t] = k
        total = torch.where(valid[:, t], torch.where(k, torch.zeros_like(new), new), total)
    return keep, total


@pytest.mark.parametrize("documents", [False, True])
def test_scan_rows_equals_the_tensor_loop(documents):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (5, 40), generator=g)
    valid = torch.rand(5, 40, generator=g) > 0.2
    reset = (torch.rand(5, 40, generator=g) > 0.8) if documents else None
    keep, finals = scan_rows(run_length_rule, (0,), [x], valid, reset)
    want_keep, want_total = loop_reference(x, valid, reset)
    assert keep.dtype == torch.bool and keep.shape == x.shape
    assert torch.equal(keep, want_keep)
    assert torch.equal(state_tensors(finals, "cpu", (torch.long,))[0], want_total)
    assert 0 < int(keep.sum()) < int(valid.sum())


def test_scan_rows_negative_control_padding_that_advances_is_caught():
    """A scan that lets padding advance the state decides differently: the comparison can fail."""
    x = torch.ones(1, 8, dtype=torch.long)
    valid = torch.tensor([[True, False, True, False, True, True, True, True]])
    keep, _ = scan_rows(run_length_rule, (0,), [x], valid)
    wrong, _ = scan_rows(run_length_rule, (0,), [x], torch.ones_like(valid))
    assert torch.equal(keep, loop_reference(x, valid, None)[0])
    assert not torch.equal(keep, wrong & valid)


def test_scan_rows_handles_empty_batches_and_rows():
    keep, finals = scan_rows(run_length_rule, (0,), [torch.zeros(0, 5, dtype=torch.long)], torch.zeros(0, 5, dtype=torch.bool))
    assert keep.shape == (0, 5) and finals == []
    keep, finals = scan_rows(run_length_rule, (0,), [torch.zeros(2, 0, dtype=torch.long)], torch.zeros(2, 0, dtype=torch.bool))
    assert keep.shape == (2, 0) and finals == [(0,), (0,)]
