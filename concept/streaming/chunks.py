"""The chunk rule shared by the confidence-driven length policies (`entropy`, `mtp`).

A chunk stays open while the model is confident about the next token and ends at the first
token that is not, with at least ``min_chunk`` and at most ``max_chunk`` tokens per chunk::

    length = tokens in the open chunk, including t
    keep_t = (length >= min_chunk and unsure_t)  or  length == max_chunk

The state is the open chunk's length per row. The batched decision is a scan of the step rule
over t (padding does not advance a row's state; a document start resets it), so both agree
exactly.
"""
from __future__ import annotations

import torch


def validate(config) -> list[str]:
    """The checks every chunk-rule config shares (``tau``, ``min_chunk``, ``max_chunk``, ``block``)."""
    problems = []
    if not 0 < config.tau < 1:
        problems.append(f"tau: must be in (0, 1), got {config.tau}")
    if config.min_chunk < 1:
        problems.append(f"min_chunk: must be >= 1, got {config.min_chunk}")
    if config.max_chunk < 1:
        problems.append(f"max_chunk: must be >= 1, got {config.max_chunk}")
    if config.min_chunk > config.max_chunk:
        problems.append(f"min_chunk ({config.min_chunk}) must be <= max_chunk ({config.max_chunk})")
    if config.block < 1:
        problems.append(f"block: must be >= 1, got {config.block}")
    return problems


def advance(unsure_t: torch.Tensor, count: torch.Tensor, min_chunk: int, max_chunk: int):
    """One step: (keep_t [B], the new open-chunk length [B])."""
    count = count + 1
    keep = ((count >= min_chunk) & unsure_t) | (count >= max_chunk)
    return keep, torch.where(keep, torch.zeros_like(count), count)


def scan(unsure: torch.Tensor, valid: torch.Tensor, min_chunk: int, max_chunk: int, reset=None):
    """Batched over [B, T]: (keep [B, T], the final open-chunk lengths [B])."""
    B, T = valid.shape
    count = torch.zeros(B, dtype=torch.long, device=valid.device)
    keep = torch.zeros_like(valid)
    for t in range(T):
        if reset is not None:
            count = torch.where(reset[:, t], torch.zeros_like(count), count)
        k, new = advance(unsure[:, t], count, min_chunk, max_chunk)
        keep[:, t] = k & valid[:, t]
        count = torch.where(valid[:, t], new, count)
    return keep, count
