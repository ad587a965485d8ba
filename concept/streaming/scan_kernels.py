"""The Triton kernels of the length policies' device scan and their ops (``concept.streaming.device_scan``).

Imported on first use only (``device_scan.ops()``): Triton and torch's Triton support take seconds to import,
which a CPU run (the host scan) never needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .scan_choice import rows_per_program


UNROLL = 8  # tokens per iteration of a kernel's loop over t: their loads issued together, ahead of the updates


@triton.jit
def _load_values(ptr, start, t0, end, inside, UNROLL: tl.constexpr):
    """The UNROLL tokens from t0 of each row (its elements ``start`` to ``end``; 0 past its end and outside the
    batch), all loaded before any is used."""
    values = ()
    for u in tl.static_range(UNROLL):
        at = start + t0 + u
        values = values + (tl.load(ptr + at, mask=inside & (at < end), other=0),)
    return values


@triton.jit
def _load_flags(ptr, start, t0, end, inside, UNROLL: tl.constexpr):
    """:func:`_load_values` of a bool tensor, as flags (False past the row's end)."""
    values = _load_values(ptr, start, t0, end, inside, UNROLL)
    flags = ()
    for u in tl.static_range(UNROLL):
        flags = flags + (values[u] != 0,)
    return flags


@triton.jit
def _store_keeps(keep_ptr, start, t0, end, inside, keeps, UNROLL: tl.constexpr):
    for u in tl.static_range(UNROLL):
        at = start + t0 + u
        tl.store(keep_ptr + at, keeps[u], mask=inside & (at < end))


@triton.jit
def _intervals(bounds, UNROLL: tl.constexpr):
    """Each allowance ``bound = lo * 2**32 + hi`` (``host_scan.allowance``) as its int32 ends (lo, hi): hi is the
    low 32 bits read as an int32, lo the high ones of ``bound + 2**31`` (an add and a shift: no division)."""
    lo, hi = (), ()
    for u in tl.static_range(UNROLL):
        bound = bounds[u].to(tl.int64)
        lo = lo + (((bound + 2147483648) >> 32).to(tl.int32),)
        hi = hi + (bound.to(tl.int32),)
    return lo, hi


@triton.jit
def null_tracker_kernel(valid_ptr, reset_ptr, bound_ptr, keep_ptr, run_ptr, concepts_ptr, B, T, max_run,
                        HAS_RESET: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr):
    """`null` with its ratio tracker: keep when the concept count is in the token's allowance interval
    (``bound``: ``lo <= concepts <= hi``) or after ``max_run`` NULLs; state (NULL run, concepts), int32 in the loop.
    The loop takes UNROLL tokens an iteration: their inputs loaded first, then the serial updates, then the
    stores (past T: not live, no reset, so the state stays and nothing is stored)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = rows < B
    start = rows.to(tl.int64) * T
    end = start + T
    run = tl.zeros([ROWS], dtype=tl.int32)
    concepts = tl.zeros([ROWS], dtype=tl.int32)
    for t0 in range(0, T, UNROLL):
        if HAS_RESET:
            fresh = _load_flags(reset_ptr, start, t0, end, inside, UNROLL)
        live = _load_flags(valid_ptr, start, t0, end, inside, UNROLL)
        lo, hi = _intervals(_load_values(bound_ptr, start, t0, end, inside, UNROLL), UNROLL)
        keeps = ()
        for u in tl.static_range(UNROLL):
            if HAS_RESET:
                run = tl.where(fresh[u], 0, run)
                concepts = tl.where(fresh[u], 0, concepts)
            admitted = (concepts >= lo[u]) & (concepts <= hi[u])
            keep = live[u] & (admitted | (run >= max_run))
            keeps = keeps + (keep,)
            run = tl.where(live[u], tl.where(keep, 0, run + 1), run)
            concepts = tl.where(keep, concepts + 1, concepts)
        _store_keeps(keep_ptr, start, t0, end, inside, keeps, UNROLL)
    tl.store(run_ptr + rows, run.to(tl.int64), mask=inside)
    tl.store(concepts_ptr + rows, concepts.to(tl.int64), mask=inside)


@triton.jit
def chunk_kernel(valid_ptr, reset_ptr, unsure_ptr, bound_ptr, keep_ptr, count_ptr, concepts_ptr, B, T, min_chunk,
                 max_chunk, HAS_RESET: tl.constexpr, TRACKED: tl.constexpr, ROWS: tl.constexpr,
                 UNROLL: tl.constexpr):
    """The chunk rule (``concept.streaming.chunks``): keep when the open chunk (t included) has at least
    ``min_chunk`` tokens and t is unsure, or ``max_chunk``. Untracked, ``unsure`` (bool) says which tokens are;
    tracked (`mtp` with its tracker), t is unsure when the concept count is in its allowance interval
    (``bound``: ``lo <= concepts <= hi``), with the count in the state: (count, concepts), int32 in the loop.
    UNROLL tokens an iteration, as :func:`null_tracker_kernel`."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = rows < B
    start = rows.to(tl.int64) * T
    end = start + T
    count = tl.zeros([ROWS], dtype=tl.int32)
    concepts = tl.zeros([ROWS], dtype=tl.int32)
    for t0 in range(0, T, UNROLL):
        if HAS_RESET:
            fresh = _load_flags(reset_ptr, start, t0, end, inside, UNROLL)
        live = _load_flags(valid_ptr, start, t0, end, inside, UNROLL)
        if TRACKED:
            lo, hi = _intervals(_load_values(bound_ptr, start, t0, end, inside, UNROLL), UNROLL)
        else:
            unsure = _load_flags(unsure_ptr, start, t0, end, inside, UNROLL)
        keeps = ()
        for u in tl.static_range(UNROLL):
            if HAS_RESET:
                count = tl.where(fresh[u], 0, count)
                concepts = tl.where(fresh[u], 0, concepts)
            if TRACKED:
                unsure_t = (concepts >= lo[u]) & (concepts <= hi[u])
            else:
                unsure_t = unsure[u]
            length = count + 1
            keep = live[u] & (((length >= min_chunk) & unsure_t) | (length >= max_chunk))
            keeps = keeps + (keep,)
            count = tl.where(live[u], tl.where(keep, 0, length), count)
            concepts = tl.where(keep, concepts + 1, concepts)
        _store_keeps(keep_ptr, start, t0, end, inside, keeps, UNROLL)
    tl.store(count_ptr + rows, count.to(tl.int64), mask=inside)
    if TRACKED:
        tl.store(concepts_ptr + rows, concepts.to(tl.int64), mask=inside)


@triton.jit
def threshold_kernel(valid_ptr, reset_ptr, p_ptr, threshold_ptr, keep_ptr, total_ptr, run_ptr, B, T, max_run,
                     HAS_RESET: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr):
    """`threshold`: add p_t to the running sum (in p's dtype, in order) and keep when it reaches the
    threshold or after ``max_run`` NULLs; state (sum, NULL run). UNROLL tokens an iteration, as
    :func:`null_tracker_kernel`."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = rows < B
    start = rows.to(tl.int64) * T
    end = start + T
    threshold = tl.load(threshold_ptr)
    total = tl.zeros([ROWS], dtype=threshold.dtype)
    run = tl.zeros([ROWS], dtype=tl.int32)
    for t0 in range(0, T, UNROLL):
        if HAS_RESET:
            fresh = _load_flags(reset_ptr, start, t0, end, inside, UNROLL)
        live = _load_flags(valid_ptr, start, t0, end, inside, UNROLL)
        p = _load_values(p_ptr, start, t0, end, inside, UNROLL)
        keeps = ()
        for u in tl.static_range(UNROLL):
            if HAS_RESET:
                total = tl.where(fresh[u], 0.0, total)
                run = tl.where(fresh[u], 0, run)
            summed = total + p[u]
            keep = live[u] & ((summed >= threshold) | (run >= max_run))
            keeps = keeps + (keep,)
            total = tl.where(live[u], tl.where(keep, 0.0, summed), total)
            run = tl.where(live[u], tl.where(keep, 0, run + 1), run)
        _store_keeps(keep_ptr, start, t0, end, inside, keeps, UNROLL)
    tl.store(total_ptr + rows, total, mask=inside)
    tl.store(run_ptr + rows, run.to(tl.int64), mask=inside)


def _launch(kernel, B: int, device, *args, **constants) -> None:
    rows = rows_per_program(device)
    if B:
        wrap_triton(kernel)[(triton.cdiv(B, rows),)](*args, ROWS=rows, UNROLL=UNROLL, **constants)


def _outputs(valid: torch.Tensor, *dtypes: torch.dtype):
    B, T = valid.shape
    return (torch.empty((B, T), dtype=torch.bool, device=valid.device),
            *(torch.zeros((B,), dtype=d, device=valid.device) for d in dtypes))


def _in_row(limit: int, T: int) -> int:
    """A limit the kernels compare a count along a row with (``max_run``, ``min_chunk``, ``max_chunk``), as the int32
    their int32 counts are compared with: a count along T tokens never passes T, so every limit above T + 1
    (``gap.UNBOUNDED``: none) decides as T + 1 does."""
    return min(limit, T + 1)


@triton_op("concept::null_tracker_scan", mutates_args=())
def null_tracker_scan(valid: torch.Tensor, reset: torch.Tensor | None, bound: torch.Tensor,
                      max_run: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keep [B, T], NULL run [B], concepts [B]; ``bound``: each token's allowance interval (``allowance``)."""
    B, T = valid.shape
    keep, run, concepts = _outputs(valid, torch.long, torch.long)
    valid, bound = valid.contiguous(), bound.contiguous()
    reset_ = valid if reset is None else reset.contiguous()
    _launch(null_tracker_kernel, B, valid.device, valid, reset_, bound, keep, run, concepts, B, T,
            _in_row(max_run, T), HAS_RESET=reset is not None)
    return keep, run, concepts


@triton_op("concept::chunk_scan", mutates_args=())
def chunk_scan(valid: torch.Tensor, reset: torch.Tensor | None, unsure: torch.Tensor, min_chunk: int,
               max_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [B, T], open-chunk length [B]; ``unsure`` [B, T] bool."""
    B, T = valid.shape
    keep, count = _outputs(valid, torch.long)
    valid, unsure = valid.contiguous(), unsure.contiguous()
    reset_ = valid if reset is None else reset.contiguous()
    # (untracked, the kernel reads no interval and writes no concept count: those pointers are placeholders)
    _launch(chunk_kernel, B, valid.device, valid, reset_, unsure, unsure, keep, count, count, B, T,
            _in_row(min_chunk, T), _in_row(max_chunk, T), HAS_RESET=reset is not None, TRACKED=False)
    return keep, count


@triton_op("concept::tracked_chunk_scan", mutates_args=())
def tracked_chunk_scan(valid: torch.Tensor, reset: torch.Tensor | None, bound: torch.Tensor, min_chunk: int,
                       max_chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keep [B, T], open-chunk length [B], concepts [B]; ``bound``: each token's allowance interval
    (``allowance``), a token unsure when the concept count is in it."""
    B, T = valid.shape
    keep, count, concepts = _outputs(valid, torch.long, torch.long)
    valid, bound = valid.contiguous(), bound.contiguous()
    reset_ = valid if reset is None else reset.contiguous()
    _launch(chunk_kernel, B, valid.device, valid, reset_, bound, bound, keep, count, concepts, B, T,  # (no `unsure`)
            _in_row(min_chunk, T), _in_row(max_chunk, T), HAS_RESET=reset is not None, TRACKED=True)
    return keep, count, concepts


@triton_op("concept::threshold_scan", mutates_args=())
def threshold_scan(valid: torch.Tensor, reset: torch.Tensor | None, p: torch.Tensor, threshold: float,
                   max_run: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keep [B, T], running sum [B] (p's dtype), NULL run [B]."""
    B, T = valid.shape
    keep, total, run = _outputs(valid, p.dtype, torch.long)
    valid, p = valid.contiguous(), p.contiguous()
    reset_ = valid if reset is None else reset.contiguous()
    limit = torch.full((1,), threshold, dtype=p.dtype, device=p.device)  # rounded as the host rounds it
    _launch(threshold_kernel, B, valid.device, valid, reset_, p, limit, keep, total, run, B, T, _in_row(max_run, T),
            HAS_RESET=reset is not None)
    return keep, total, run
