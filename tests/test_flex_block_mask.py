"""The `flex` backend's BlockMask (``flex.build_block_mask``): built eagerly up to ``DENSE_MASK_LIMIT``, it has the
blocks of the dense one-pass mask, block for block (partial and full, counts and indices), as the compiled build
it replaces had; beyond the limit it is built compiled. Negative control: a mask that is wrong in a few pairs
(a tail token that does not see its own segment) gives other blocks."""
from __future__ import annotations

import importlib

import pytest
import torch

from concept.packing import allowed, pack

BLOCK = 16


def layouts():
    """Two rows: one with 20 concepts then a long tail (full tiles), one with a concept every 7 tokens and a padded
    end; one document each, then two each."""
    keep = torch.zeros(2, 96, dtype=torch.bool)
    keep[0, :20] = True
    keep[0, 70] = True
    keep[1, ::7] = True
    mask = torch.ones_like(keep)
    mask[1, 80:] = False
    doc = torch.zeros(2, 96, dtype=torch.long)
    doc[:, 50:] = 1
    return [pack(keep, mask), pack(keep, mask, doc)]


def dense_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a dense [B, L, L] mask: which (query block, key block) tiles are partial and which full."""
    B, L, _ = dense.shape
    n = -(-L // BLOCK)
    padded = torch.zeros(B, n * BLOCK, n * BLOCK, dtype=torch.bool)
    padded[:, :L, :L] = dense
    tiles = padded.view(B, n, BLOCK, n, BLOCK).permute(0, 1, 3, 2, 4).flatten(3)
    full = tiles.all(-1)  # (as torch counts them: a tile's slots beyond L are masked, so such a tile is never full)
    return tiles.any(-1) & ~full, full


def mask_blocks(block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The BlockMask's partial and full tiles as [B, n, n] booleans (its counts and indices, read as sets)."""
    def tiles(counts, indices):
        B, _, n = counts.shape
        out = torch.zeros(B, n, indices.shape[-1], dtype=torch.bool)
        for b in range(B):
            for q in range(n):
                out[b, q, indices[b, 0, q, :counts[b, 0, q]].long()] = True
        return out

    return tiles(block_mask.kv_num_blocks, block_mask.kv_indices), tiles(block_mask.full_kv_num_blocks,
                                                                          block_mask.full_kv_indices)


def the_rule(layout) -> torch.Tensor:
    """The one-pass rule as a dense [B, L, L] mask (a padding query may look anywhere)."""
    return allowed(layout.meta, layout.meta)


@pytest.mark.parametrize("mask", ["ranges", "rule"])
def test_the_eager_build_has_the_blocks_of_the_dense_mask(mask):
    flex = importlib.import_module("concept_plugins.attention.flex")
    for layout in layouts():
        B, L = layout.meta.time.shape
        assert B * L * L <= flex.DENSE_MASK_LIMIT
        mask_mod = flex.ranges_mask(layout) if mask == "ranges" else flex.rule_mask(layout.meta)
        built = flex.build_block_mask(mask_mod, B, L, "cpu", BLOCK, compile=True)
        partial, full = mask_blocks(built)
        want_partial, want_full = dense_blocks(the_rule(layout))
        assert torch.equal(partial, want_partial) and torch.equal(full, want_full)
        assert full.any() and partial.any() and not (partial | full).all()  # the layouts have all three kinds


def test_negative_control_a_wrong_mask_gives_other_blocks():
    flex = importlib.import_module("concept_plugins.attention.flex")
    layout = layouts()[0]
    B, L = layout.meta.time.shape
    concept_lo, concept_hi, _ = flex.slot_ranges(layout)
    wrong = lambda b, h, q, k: (k >= concept_lo[b, q]) & (k < concept_hi[b, q])  # noqa: E731  (no tail to tail)
    partial, full = mask_blocks(flex.build_block_mask(wrong, B, L, "cpu", BLOCK, compile=True))
    want_partial, want_full = dense_blocks(the_rule(layout))
    assert not (torch.equal(partial, want_partial) and torch.equal(full, want_full))


def test_beyond_the_limit_the_build_is_compiled(monkeypatch):
    """Past ``DENSE_MASK_LIMIT`` the BlockMask comes from ``torch.compile(create_block_mask)`` (here a stand-in
    that records its call); within it, never; and never without ``compile``."""
    flex = importlib.import_module("concept_plugins.attention.flex")
    from torch.nn.attention.flex_attention import create_block_mask

    calls = []

    def compiled(*args, **kwargs):
        calls.append(args[3])
        return create_block_mask(*args, **kwargs, _compile=False)

    monkeypatch.setattr(flex, "_compiled_create_block_mask", lambda: compiled)
    layout = layouts()[0]
    B, L = layout.meta.time.shape
    mask_mod = flex.ranges_mask(layout)
    flex.build_block_mask(mask_mod, B, L, "cpu", BLOCK, compile=True)
    assert calls == []
    monkeypatch.setattr(flex, "DENSE_MASK_LIMIT", B * L * L - 1)
    flex.build_block_mask(mask_mod, B, L, "cpu", BLOCK, compile=False)
    assert calls == []
    built = flex.build_block_mask(mask_mod, B, L, "cpu", BLOCK, compile=True)
    assert calls == [L] and torch.equal(mask_blocks(built)[0], dense_blocks(the_rule(layout))[0])


@pytest.mark.slow  # two compilations of create_block_mask on a CPU: minutes
def test_the_eager_build_equals_the_compiled_ones_block_for_block():
    """Today's eager build against the compiled build it replaced (``_compile=True``) and the one torch advises
    (``torch.compile(create_block_mask)``): the same counts and indices."""
    flex = importlib.import_module("concept_plugins.attention.flex")
    from torch.nn.attention.flex_attention import create_block_mask

    layout = layouts()[1]
    B, L = layout.meta.time.shape
    mask_mod = flex.ranges_mask(layout)
    eager = flex.build_block_mask(mask_mod, B, L, "cpu", BLOCK, compile=True)
    for other in (create_block_mask(mask_mod, B, None, L, L, device="cpu", BLOCK_SIZE=BLOCK, _compile=True),
                  flex._compiled_create_block_mask()(mask_mod, B, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)):
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(eager, name), getattr(other, name)), name
        assert [torch.equal(a, b) for a, b in zip(mask_blocks(eager), mask_blocks(other))] == [True, True]
