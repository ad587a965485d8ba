"""The deep stack's block (``packing.DeepBlock``): a static layout's concepts and tail in one block as wide as the
tokens (one concept per boundary), each row's boundary between them a tensor. Checked: the block holds exactly the
layout's elements under the same rule, every key at or before its query's slot; the forward over it equals the
forward over the layout and the naive reference (logits and gradients) for every backend that plans it, whose deep
stack then runs T slots instead of the budget's C + T (negative controls: the switch off, a backend that plans no
block); flex's ranges over it equal the rule; the FLOP count of the widths it computes."""
from __future__ import annotations

import pytest
import torch

from concept import packing
from concept.flops import Shape, deep_pairs, evenly_spaced_keep, forward_flops
from plugins.attention import flex
from plugins.attention.cascade import CascadeBackend, CascadeConfig
from plugins.attention.chunked import ChunkedBackend, ChunkedConfig
from plugins.attention.flex import FlexBackend, FlexConfig
from plugins.attention.sdpa import SDPABackend
from concept.kv_cache import ConceptCache
from concept.streaming.decoding import ConceptDecoder
from tests.conftest import assert_decoding_matches_teacher_forcing, mixed_model
from tests.reference import reference_logits
from tests.test_static_shapes import CAP, batch  # noqa: F401 (the budget that binds, and its batch: a fixture)
BACKENDS = {"sdpa": SDPABackend(), "chunked": ChunkedBackend(ChunkedConfig(4)), "flex": FlexBackend(FlexConfig(False))}


def random_layouts(emit: int, count: int = 12, seed: int = 0):
    """Static layouts of capped random decisions: padding on either side, several documents in a row."""
    g = torch.Generator().manual_seed(seed + emit)
    B, T = 3, 24
    for trial in range(count):
        keep = torch.rand(B, T, generator=g) < 0.35
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[1, 19:] = False
        valid[2, :3] = False
        doc = (torch.arange(T) >= 4 + trial % 15).long().expand(B, T).clone()
        keep = packing.cap_boundaries(keep, valid, 0.5, slack=1)
        yield packing.pack(keep, valid, doc, emit, 1, min(T, packing.budget(T, 0.5, 1)) * emit), valid


def elements(meta, b):
    """Row b's real elements as (time, is a concept, sub-index), sorted."""
    real = meta.valid[b]
    sub = meta.sub[b][real] if meta.sub is not None else torch.zeros(int(real.sum()), dtype=torch.long)
    return sorted(zip(meta.time[b][real].tolist(), meta.keep[b][real].tolist(), sub.tolist()))


@pytest.mark.parametrize("emit", [1, 2, 3])
def test_the_block_holds_the_layouts_elements_under_the_same_rule(emit):
    for layout, valid in random_layouts(emit):
        block = packing.deep_block(layout)
        C, T = layout.num_concepts, valid.shape[1]
        assert block.length == packing.deep_block_width(T, C, emit) == T + C - C // emit
        rule, block_rule = packing.allowed(layout.meta, layout.meta), packing.allowed(block.meta, block.meta)
        for b in range(valid.shape[0]):
            assert elements(block.meta, b) == elements(layout.meta, b)
            # the same element at every time, and the same rule between any two of them
            at, block_at = layout.slot_of_time[b][valid[b]], block.slot_of_time[b][valid[b]]
            assert torch.equal(layout.meta.time[b, at], block.meta.time[b, block_at])
            assert torch.equal(rule[b][at][:, at], block_rule[b][block_at][:, block_at])
            # concepts first: no real query sees a key at a later slot; a row's concepts end at its boundary
            assert not (block_rule[b] & block.meta.valid[b][:, None]).triu(1).any()
            n = int(block.concept_boundary[b])
            assert block.meta.keep[b, :n].all() and not block.meta.keep[b, n:].any()
            # its elements are the layout's: each slot's metadata is the layout's at ``src``
            real = block.meta.valid[b]
            assert torch.equal(block.meta.time[b][real], layout.meta.time[b, block.src[b][real]])


@pytest.mark.parametrize("emit", [1, 2])
def test_flex_ranges_over_the_block_are_the_rule(emit):
    """``slot_ranges`` reads each row's boundary: its two runs of keys are exactly the rule's keys; the negative
    control, the layout's static boundary C over the block, is not."""
    for layout, _ in random_layouts(emit, count=8):
        block = packing.deep_block(layout)
        k = torch.arange(block.length)
        lo, hi, tail_lo = (t[..., None] for t in flex.slot_ranges(block))
        ranges = ((k >= lo) & (k < hi)) | ((k >= tail_lo) & (k <= k[:, None]))
        assert torch.equal(ranges, packing.allowed(block.meta, block.meta))
    wrong = packing.DeepBlock(block.meta, block.src, block.slot_of_time, torch.full_like(block.concept_boundary,
                                                                                         layout.num_concepts), emit)
    k = torch.arange(wrong.length)
    lo, hi, tail_lo = (t[..., None] for t in flex.slot_ranges(wrong))
    assert not torch.equal(((k >= lo) & (k < hi)) | ((k >= tail_lo) & (k <= k[:, None])),
                           packing.allowed(block.meta, block.meta))


def deep_width(model, *args, **kwargs) -> int:
    """The slots the deep stack's first layer ran on in ``model(*args, **kwargs)``."""
    seen = []
    hook = model.deep[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        hook.remove()
    return seen[0]


@pytest.fixture
def capped():
    """The shared tiny model with a static budget that binds; its budget, backend and switch restored after."""
    model = mixed_model("null", attention="sdpa")
    saved = model.max_ratio, model.attention, model.deep_block
    model.max_ratio = CAP
    yield model
    model.max_ratio, model.attention, model.deep_block = saved


@pytest.mark.parametrize("name", list(BACKENDS))
def test_the_forward_over_the_block_equals_the_layout_and_the_reference(capped, batch, name):
    ids, mask = batch
    valid = mask.bool()
    capped.attention = BACKENDS[name]
    with torch.no_grad():
        ref, keep = reference_logits(capped, ids, mask)
        capped.deep_block = False
        wide = capped(ids, attention_mask=mask)
        capped.deep_block = True
        out = capped(ids, attention_mask=mask)
    assert torch.equal(out.keep, keep) and torch.equal(wide.keep, keep)
    torch.testing.assert_close(out.logits[valid], ref[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[valid], wide.logits[valid], atol=1e-5, rtol=1e-5)
    # the deep stack ran T slots, not the budget's C + T (negative control: the switch off)
    slots = capped.concept_slots(16)
    assert deep_width(capped, ids, attention_mask=mask) == 16
    capped.deep_block = False
    assert deep_width(capped, ids, attention_mask=mask) == slots + 16


@pytest.mark.parametrize("name", ["sdpa", "chunked"])
def test_gradients_over_the_block_equal_the_layouts(capped, batch, name):
    ids, mask = batch
    capped.attention = BACKENDS[name]
    grads = []
    for on in (True, False):
        capped.deep_block = on
        capped.zero_grad()
        capped(ids, attention_mask=mask).logits[mask.bool()].square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in capped.parameters() if p.grad is not None]))
    capped.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_a_backend_that_plans_no_block_gets_the_layout(capped, batch):
    """`cascade` splits the layout's static concept part from its tail: it declares no block, and the model hands it
    the layout (C + T slots), exact as before."""
    ids, mask = batch
    capped.attention = CascadeBackend(CascadeConfig(kernel="reference"))
    assert not capped.plans_deep_block() and capped.deep_block
    assert deep_width(capped, ids, attention_mask=mask) == capped.concept_slots(16) + 16
    with torch.no_grad():
        ref, _ = reference_logits(capped, ids, mask)
        out = capped(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_prefill_runs_the_block_and_keeps_the_layouts_cache(capped, name, monkeypatch):
    """A prefill's deep stack runs over the block too (its KV caches record T slots a row, not C + T), and the
    entries it keeps are the layout's, in the layout's order: each row's concepts, then its tail after the last
    one; decoding from them equals teacher forcing. Negative control: the block's records adopted by the layout's
    slots keep the wrong entries."""
    capped.attention = BACKENDS[name]
    prompts = [[5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 2, 1, 7, 3], [4, 4, 8, 3, 9]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    recorded, kept = {}, {}
    adopt = ConceptCache.adopt
    for on in (True, False):
        capped.deep_block = on

        def watch(cache, valid, layout, deep=None):
            recorded[on] = next(iter(cache.deep.k.values())).shape[2]  # the slots the deep stack ran over
            adopt(cache, valid, layout, deep)

        monkeypatch.setattr(ConceptCache, "adopt", watch)
        decoder = ConceptDecoder(capped)
        decoder.prefill(ids, valid)
        kept[on] = decoder.cache.deep
    assert recorded == {True: P, False: capped.concept_slots(P) + P}
    block, wide = kept[True], kept[False]
    assert torch.equal(block.valid, wide.valid) and torch.equal(block.tail, wide.tail)
    for layer in wide.k:
        real = wide.valid[:, None, :, None].expand_as(wide.k[layer])
        torch.testing.assert_close(block.k[layer][real], wide.k[layer][real], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(block.v[layer][real], wide.v[layer][real], atol=1e-6, rtol=1e-5)
    monkeypatch.undo()
    capped.deep_block = True
    assert_decoding_matches_teacher_forcing(capped, prompts, 6)

    def wrong(cache, valid, layout, deep=None):  # the block's records read by the layout's slots
        adopt(cache, valid, layout)

    monkeypatch.setattr(ConceptCache, "adopt", wrong)
    with pytest.raises(AssertionError, match="Mismatched elements"):  # (the logits, not a shape)
        assert_decoding_matches_teacher_forcing(capped, prompts, 6)


def test_flops_count_the_blocks_width():
    """The deep stack's linear layers over T slots (the block, one concept per boundary) instead of S + T; at
    SmolLM2's shape, the default vocabulary (4,096 concepts and NULL) and r = 0.125, with the old `auto` budget
    (0.25 + 4) the ideal rises from 2.28x to 2.42x at 8k tokens and from 1.37x to 1.49x at the demo recipe's 128,
    with today's (0.15625 + 6) to 2.55x and 1.58x (docs/benchmarks.md)."""
    shape = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)
    keep = torch.arange(40) % 5 == 4
    slots = packing.budget(40, 0.25)
    wide = forward_flops(shape, (1, 2, 1), keep, 16, static_slots=slots)
    block = forward_flops(shape, (1, 2, 1), keep, 16, static_slots=slots, deep_block=True)
    assert wide.deep - block.deep == pytest.approx(shape.linear(slots + 40) - shape.linear(40))
    assert block.middle == wide.middle and block.shallow == wide.shallow
    two = forward_flops(shape, (1, 2, 1), keep, 16, emit=2, static_slots=2 * slots, deep_block=True)
    assert two.deep == pytest.approx(shape.linear(40 + slots) + shape.attention(deep_pairs(keep, 2)))  # T + slots
    smollm2 = Shape(576, 9, 3, 64, 1536, 49152)
    for T, budget, wide_ideal, block_ideal in ((8192, (0.25, 4), 2.279, 2.421), (128, (0.25, 4), 1.375, 1.494),
                                               (8192, (0.15625, 6), 2.453, 2.554), (128, (0.15625, 6), 1.482, 1.580)):
        keep, slots = evenly_spaced_keep(T, 0.125), packing.budget(T, *budget)
        assert forward_flops(smollm2, (4, 18, 8), keep, 4097, static_slots=slots).speedup == pytest.approx(
            wide_ideal, abs=1e-3)
        assert forward_flops(smollm2, (4, 18, 8), keep, 4097, static_slots=slots, deep_block=True).speedup == \
            pytest.approx(block_ideal, abs=1e-3)
