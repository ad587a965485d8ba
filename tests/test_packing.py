"""The packed layout: one element per real token, concepts first, and the attention rule."""
import pytest
import torch

from concept.flops import deep_pairs, evenly_spaced_keep
from concept import packing
from concept.packing import allowed, pack


def naive_allowed(keep):
    """The rule written out in time order, element by element."""
    T = len(keep)
    seg = torch.cumsum(keep.long(), 0)
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            m[i, j] = j <= i and (bool(keep[j]) or (not keep[i] and seg[i] == seg[j]))
    return m


def test_layout_is_concepts_first_and_complete():
    keep = torch.tensor([[0, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    valid = torch.ones_like(keep)
    valid[1, 6:] = False
    layout = pack(keep, valid)
    assert layout.num_concepts == 3
    assert layout.concept_src[0].tolist() == [1, 4, 5]
    assert layout.concept_meta.valid[1].tolist() == [True, False, False]  # row 1 keeps only t=0 (t=7 is padding)
    # every real token appears exactly once, and slot_of_time points back to it
    for b in range(2):
        times = layout.meta.time[b][layout.meta.valid[b]].sort().values
        assert times.tolist() == valid[b].nonzero().flatten().tolist()
        real = valid[b]
        assert torch.equal(layout.meta.time[b, layout.slot_of_time[b][real]], torch.arange(8)[real])


def test_mask_in_packed_layout_equals_time_order_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        keep = torch.rand(16, generator=g) < 0.3
        layout = pack(keep[None], torch.ones(1, 16, dtype=torch.bool))
        m = allowed(layout.meta, layout.meta)[0]
        t = layout.meta.time[0]
        # reorder the packed mask into time order and compare with the element-by-element rule
        inv = torch.empty_like(t)
        inv[t] = torch.arange(16)
        assert torch.equal(m[inv][:, inv], naive_allowed(keep))
        assert int(m.sum()) == deep_pairs(keep)


def test_evenly_spaced_keep_ratio():
    for ratio in (0.1, 0.25, 0.5):
        assert int(evenly_spaced_keep(2048, ratio).sum()) == int(2048 * ratio)


def test_several_concepts_per_boundary_pack_in_time_then_slot_order():
    keep = torch.tensor([[False, True, False, False, True, False]])
    layout = pack(keep, torch.ones_like(keep), emit=3)
    C = layout.num_concepts
    assert C == 6 and layout.concept_src[0].tolist() == [1, 1, 1, 4, 4, 4]
    assert layout.concept_id_src[0].tolist() == [0, 0, 1, 2, 3, 4]  # t - 2 + sub, clamped at 0
    assert layout.meta.sub[0, :C].tolist() == [0, 1, 2, 0, 1, 2]
    assert layout.slot_of_time[0, [1, 4]].tolist() == [2, 5]  # the logits come from the last slot
    m = allowed(layout.meta, layout.meta)[0]
    assert torch.equal(m[:C, :C], torch.ones(C, C, dtype=torch.bool).tril())  # causal among the slots
    tail_after = C + 3  # tail slots hold t = 0, 2, 3, 5: the last sees all six concepts and itself
    assert m[tail_after, :C].all() and m[tail_after, tail_after] and not m[:C, C:].any()
    assert int(m.sum()) == deep_pairs(keep[0], emit=3)


def test_decode_flops_with_several_concepts_per_boundary_sum_to_the_forward():
    from concept.flops import Shape, decode_flops, forward_flops

    shape = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)
    keep = torch.arange(30) % 5 == 4
    one_pass = forward_flops(shape, (1, 2, 1), keep, 16, emit=3)
    assert one_pass.concepts == 18
    assert decode_flops(shape, (1, 2, 1), keep, 16, steps=30, emit=3).to_dict() == pytest.approx(one_pass.to_dict())


def test_a_static_layouts_flops_count_the_widths_it_computes():
    """``forward_flops(static_slots=S)``: the middle stack's linear layers over S slots, the deep stack's over S + T
    (``packing.pack``'s static widths, checked on a real layout), attention over the real pairs only; the
    decisions' own widths without it. At SmolLM2's shape, 8k tokens, r = 0.125 and the ``auto`` budget (0.25) the
    ideal falls from 2.63x to 2.30x (docs/benchmarks.md)."""
    from concept.flops import Shape, evenly_spaced_keep, forward_flops

    shape = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)
    keep = torch.arange(40) % 5 == 4
    T, kept, slots = 40, int(keep.sum()), packing.budget(40, 0.25)
    layout = packing.pack(keep[None], torch.ones(1, T, dtype=torch.bool), None, 1, 1, slots)
    assert (layout.num_concepts, layout.length) == (slots, slots + T)  # (the widths the formula assumes)
    dynamic, static = forward_flops(shape, (1, 2, 1), keep, 16), forward_flops(shape, (1, 2, 1), keep, 16,
                                                                                static_slots=slots)
    assert static.middle - dynamic.middle == pytest.approx(2 * (shape.linear(slots) - shape.linear(kept)))
    assert static.deep - dynamic.deep == pytest.approx(shape.linear(slots + T) - shape.linear(T))
    assert static.shallow == dynamic.shallow and static.dense == dynamic.dense and static.speedup < dynamic.speedup
    smollm2 = Shape(576, 9, 3, 64, 1536, 49152)
    keep = evenly_spaced_keep(8192, 0.125)
    assert forward_flops(smollm2, (4, 18, 8), keep, 2049).speedup == pytest.approx(2.632, abs=1e-3)
    assert forward_flops(smollm2, (4, 18, 8), keep, 2049, static_slots=packing.budget(8192, 0.25, 4)).speedup == \
        pytest.approx(2.301, abs=1e-3)
