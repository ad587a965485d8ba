"""The chunk rule shared by the confidence-driven length policies (`entropy`, `mtp`).

A chunk stays open while the model is confident about the next token and ends at the first
token that is not, with at least ``min_chunk`` and at most ``max_chunk`` tokens per chunk::

    length = tokens in the open chunk, including t
    keep_t = (length >= min_chunk and unsure_t)  or  length == max_chunk

The state is the open chunk's length per row. The batched decision is a scan of the same rule
over t, on the device on CUDA (a Triton kernel, ``concept.streaming.device_scan``) and on the host
elsewhere (``concept.streaming.host_scan``; padding does not advance a row's state; a document start
resets it), so both agree exactly.
"""
from __future__ import annotations

import torch

from concept.streaming import gap
from concept.streaming.host_scan import interval_admits
from concept.streaming.scan import DeviceRule, host_rule, scan_rule


def validate(config) -> list[str]:
    """The checks every chunk-rule config shares (``tau``, ``min_chunk``, ``max_chunk``, ``block``)."""
    problems = []
    if not 0 < config.tau < 1:
        problems.append(f"tau: must be in (0, 1), got {config.tau}")
    if config.min_chunk < 1:
        problems.append(f"min_chunk: must be >= 1, got {config.min_chunk}")
    bound = gap.problems("max_chunk", config.max_chunk)
    problems += bound
    if not bound and isinstance(config.max_chunk, int) and config.min_chunk > config.max_chunk:
        problems.append(f"min_chunk ({config.min_chunk}) must be <= max_chunk ({config.max_chunk})")
    if config.block < 1:
        problems.append(f"block: must be >= 1, got {config.block}")
    return problems


def advance(unsure_t: torch.Tensor, count: torch.Tensor, min_chunk: int, max_chunk: int):
    """One step: (keep_t [B], the new open-chunk length [B])."""
    count = count + 1
    keep = ((count >= min_chunk) & unsure_t) | (count >= max_chunk)
    return keep, torch.where(keep, torch.zeros_like(count), count)


def rule(min_chunk: int, max_chunk: int):
    """The step rule on one row's plain numbers, for ``concept.streaming.host_scan.scan_rows``:
    ``rule((count,), unsure_t) -> (keep_t, (count,))``, the same decision as :func:`advance`."""
    def step(state, unsure_t):
        count = state[0] + 1
        if (count >= min_chunk and unsure_t) or count >= max_chunk:
            return True, (0,)
        return False, (count,)
    return step


@host_rule("chunk_scan")
def chunk_scan_rule(params: tuple, dtypes: tuple):
    """The kernel ``concept::chunk_scan``'s rule on one row's numbers (``concept.streaming.scan``): :func:`rule`
    on ``unsure_t``, with ``params`` (min_chunk, max_chunk)."""
    return rule(*params), (0,)


@host_rule("tracked_chunk_scan")
def tracked_chunk_scan_rule(params: tuple, dtypes: tuple):
    """The kernel ``concept::tracked_chunk_scan``'s rule on one row's numbers: :func:`rule` with ``params``
    (min_chunk, max_chunk), t unsure when the document's concepts so far lie in its allowance interval ``bound_t``
    (``allowance``), those concepts counted in the state."""
    chunk = rule(*params)

    def step(state, bound_t):
        count, concepts = state
        keep, (count,) = chunk((count,), interval_admits(concepts, bound_t))
        return keep, (count, concepts + keep)

    return step, (0, 0)


def scan(unsure: torch.Tensor, valid: torch.Tensor, min_chunk: int, max_chunk: int, reset=None):
    """Batched over [B, T]: (keep [B, T], the final open-chunk lengths [B]), the step rule run along
    each row: on CUDA its Triton kernel (no host sync), elsewhere on the host (one copy of ``unsure`` there,
    not a dozen kernel launches per token); ``concept.streaming.scan``."""
    device = DeviceRule("chunk_scan", (min_chunk, max_chunk))
    keep, (count,) = scan_rule(device, [unsure], valid, reset, (torch.long,))
    return keep, count
