"""Sequential length-policy rules, run along each row on the host in one pass.

Some length policies decide token t from decisions made before it (the ratio tracker counts the
concepts already emitted, a chunk counts its open tokens, ``threshold`` accumulates a score). Their
batched decision is a scan of the step rule over t. Written with tensor ops, that scan is a dozen
tiny tensor ops per token: T * 12 kernel launches on a GPU (about 0.2 s of launch overhead for
one 16k-token forward) and about 0.1 ms per token on a CPU, paid in every training forward.

Here the per-token inputs (computed for all t at once, in the policy's own tensor arithmetic) are
copied to the host once and the rule runs on plain Python numbers, one row at a time: one device
synchronisation per forward, then a few hundred nanoseconds per token. The rule must compute
exactly what the policy's tensor ``step`` computes, so that decoding equals teacher forcing:
integer rules are exact as they are, float rules use ``numpy.float32`` for float32 arithmetic
(``threshold``), and comparisons of a float score against a concept count are turned into an
interval of integers per token beforehand by :func:`allowance`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..syncs import declared, upload

State = tuple
Rule = Callable[..., tuple[bool, State]]


def scan_rows(rule: Rule, init: State, inputs: Sequence[torch.Tensor], valid: torch.Tensor,
              reset: torch.Tensor | None = None) -> tuple[torch.Tensor, list[State]]:
    """Run ``rule(state, *inputs_t) -> (keep, next state)`` along each row of [B, T] inputs.

    A document start (``reset`` True at t) puts the row back to ``init`` before its token; padding
    (``valid`` False) keeps nothing and leaves the state unchanged. Returns keep [B, T] (bool, on
    ``valid``'s device) and each row's state after its last token."""
    B, T = valid.shape
    tensors = [x.detach() for x in (valid, *inputs, *([] if reset is None else [reset]))]
    with declared("policy scan"):  # the forward's one host sync: every input in one copy (float64 holds them all)
        host = torch.stack([x.double() for x in tensors]).cpu()
        columns = [column.to(x.dtype).tolist() for column, x in zip(host, tensors)]  # (host tensors by now)
    starts = columns.pop() if reset is not None else None
    keeps, finals = [], []
    for b in range(B):
        live, *xs = (column[b] for column in columns)
        fresh = starts[b] if starts is not None else None
        row, state = [False] * T, init
        for t, values in enumerate(zip(*xs)):
            if fresh is not None and fresh[t]:
                state = init
            if live[t]:
                row[t], state = rule(state, *values)
        keeps.append(row)
        finals.append(state)
    keep = upload(keeps, torch.bool, valid.device).reshape(B, T)  # back without a second sync
    return keep, finals


def state_tensors(finals: list[State], device, dtypes: Sequence[torch.dtype]) -> tuple[torch.Tensor, ...]:
    """Rows' final states (tuples of numbers) -> one [B] tensor per state field."""
    return tuple(upload([state[i] for state in finals], dtype, device) for i, dtype in enumerate(dtypes))


def allowance(score: torch.Tensor, price: torch.Tensor, limit: int, strict: bool = False) -> torch.Tensor:
    """Which concept counts ``c`` in ``0..limit`` pass the tensor test

        score - price * c >= 0        (``> 0`` when ``strict``)

    computed in ``score``'s own float arithmetic for each element [...]: the interval ``lo <= c <= hi`` of the
    counts that pass, its two ends packed in one int64 shaped as ``score`` (:func:`interval_ends` unpacks them,
    :func:`interval_admits` tests a count).

    The ratio trackers compare a float score with a price per concept already emitted; the count is
    only known during the scan. The test is monotone in ``c`` (falling for a positive ``price``, the
    trackers' case; rising for a negative one; constant for 0), so the passing counts are an interval
    and the scan compares integers, deciding what the tensor step rule decides, bit for bit. A float64
    quotient gives the estimate of the interval's moving end; the five integers around it are tested with
    the step rule's own ops, which settles any rounding. Every sign is computed on the device and chosen
    there (nothing is read back: the price is a tensor). The ends (``0 <= lo <= limit + 1``, ``-1 <= hi <=
    limit``; an empty interval has ``lo > hi``) travel as one integer per token, ``lo * 2**32 + hi``: a scan's
    serial loop unpacks them with a shift and a truncation (until 2026-11-28 ``lo * (limit + 3) + hi + 1``, which
    took a 64-bit division a token in the device scan's loop)."""
    price = price.to(score.dtype)

    def passes(c: torch.Tensor) -> torch.Tensor:
        margin = score - price * c.to(score.dtype)
        return margin > 0 if strict else margin >= 0

    def passing_around(estimate: torch.Tensor) -> torch.Tensor:
        """How many of the five counts ``estimate - 2 .. estimate + 2`` pass, tested all at once (a last
        dimension of 5: the same elementwise ops as five calls of ``passes``)."""
        counts = (estimate[..., None] + offsets).to(score.dtype)
        margin = score[..., None] - price[..., None] * counts
        return (margin > 0 if strict else margin >= 0).sum(-1)

    offsets = torch.arange(-2, 3, device=score.device)
    quotient = score.double() / price.double()
    # both ends' estimates tested in one call (a leading dimension of 2: the same elementwise ops)
    estimate = torch.stack([
        torch.nan_to_num(torch.floor(quotient), nan=-2.0).clamp(-2, limit + 1),  # a positive price: c <= hi
        torch.nan_to_num(torch.ceil(quotient), nan=float(limit + 3)).clamp(-1, limit + 2),  # a negative one: c >= lo
    ]).long()
    passing = passing_around(estimate)
    falling = (estimate[0] - 3 + passing[0]).clamp(-1, limit)
    rising = (estimate[1] + 3 - passing[1]).clamp(0, limit + 1)
    # 0 (or NaN): every count passes or none does
    every = passes(torch.zeros_like(score, dtype=torch.long))
    lo = torch.where(price > 0, 0, torch.where(price < 0, rising, torch.where(every, 0, limit + 1)))
    hi = torch.where(price > 0, falling, torch.where(price < 0, limit, torch.where(every, limit, -1)))
    return interval_bound(lo, hi)


HALF = 2 ** 32  # an allowance packs its interval as ``lo * HALF + hi``: lo in the high 32 bits, hi (signed) in the low


def interval_bound(lo, hi):
    """The interval ``lo <= c <= hi`` (``lo >= 0``, ``hi`` an int32) packed as :func:`allowance` packs it:
    ``lo * 2**32 + hi``; integers or tensors (int64)."""
    return lo * HALF + hi


def interval_ends(bound):
    """The ends ``(lo, hi)`` of the interval :func:`allowance` packed into ``bound``: integers or int64 tensors.
    (``bound + 2**31`` carries ``hi + 2**31`` in its low 32 bits, which is in 0..2**32 - 1 for any int32 ``hi``,
    so its high bits are ``lo``; the device scan's kernels take ``hi`` as the low 32 bits, read as an int32.)"""
    lo = (bound + HALF // 2) >> 32
    return lo, bound - lo * HALF


def interval_admits(c, bound):
    """Whether the concept count ``c`` lies in the interval :func:`allowance` packed into ``bound``; integers or
    tensors that broadcast."""
    lo, hi = interval_ends(bound)
    return (c >= lo) & (c <= hi)
