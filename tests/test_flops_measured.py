"""The matmuls a forward runs are the ones ``concept.flops`` counts: the ideal FLOP ratios in every speed row and in
``docs/benchmarks.md`` (``static_ideal_speedup``) are the model's own work, not a formula beside it.

Counted by torch's ``FlopCounterMode`` (matrix products: ``mm``, ``addmm``, ``bmm``; the attention kernels aside,
``concept.flops`` counts their allowed pairs, which no dense kernel matches) over a no-grad forward whose logits
are read (the LM head runs when they are), against ``concept.flops.forward_flops`` with the attention left out: the
default static build (its budget ``auto``, the deep stack over one block of T slots), with the policy deciding, a
tail fusion that computes, and the dense baseline. Negative control: a backend that does not plan the deep block
(``cascade``) runs the deep stack over the budget's concept slots plus T, and the block's count no longer
matches (the wide layout's does)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from concept.dense import DenseModel
from concept.flops import Shape, forward_flops, fusion_flops, head_classes
from tests.conftest import mixed_model

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm")


class LinearOnly(Shape):
    """A backbone shape whose attention costs nothing: ``forward_flops`` then counts the matrix products alone."""

    def attention(self, pairs: float) -> float:
        return 0.0


def matmul_flops(counts: dict) -> float:
    return float(sum(v for op, v in counts.items() if str(op) in MATMULS))


def measured(model, ids) -> tuple[float, object]:
    """The matrix products' FLOPs of a no-grad forward of ``model`` with its logits read, and its output. The RoPE
    tables' outer product (frequencies x positions: a ``bmm`` under torch 2.11, none under 2.13) is not a layer's
    work, and ``concept.flops`` does not count it."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(ids)
        out.logits.sum()
    counts = counter.get_flop_counts()
    tables = sum(matmul_flops(c) for module, c in counts.items() if module.endswith("rotary_emb"))
    return matmul_flops(counts["Global"]) - tables, out


def ideal(model, keep, T: int, deep_block: bool):
    shape = LinearOnly(**vars(Shape.from_hf_config(model.backbone.config)))
    split = tuple(len(s) for s in (model.shallow, model.middle, model.deep))
    return forward_flops(shape, split, keep, head_classes(model), emit=model.emit, fusion=fusion_flops(model),
                         static_slots=model.concept_slots(T), deep_block=deep_block)


@pytest.mark.parametrize("fusion", ["none", "bridge"])
def test_a_forward_runs_the_matmuls_its_ideal_counts(fusion):
    model = copy.deepcopy(mixed_model("null", tail_fusion=fusion))
    model.max_ratio = 0.25  # (a static budget, as the default build's `auto`: the deep stack over its block)
    T = 40
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    flops, out = measured(model, ids)
    keep = out.keep[0]
    assert 0 < int(keep.sum()) < T  # (concepts and a tail)
    report = ideal(model, keep, T, deep_block=True)
    assert flops == pytest.approx(report.concept, rel=1e-9)
    dense_flops, _ = measured(DenseModel(model.backbone, static=True).eval(), ids)
    assert dense_flops == pytest.approx(report.dense, rel=1e-9)


def test_negative_control_the_wide_deep_layout_is_not_the_blocks_count():
    model = copy.deepcopy(mixed_model("null", attention="cascade"))
    model.max_ratio = 0.25
    T = 40
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    flops, out = measured(model, ids)
    keep = out.keep[0]
    assert flops != pytest.approx(ideal(model, keep, T, deep_block=True).concept, rel=1e-3)
    assert flops == pytest.approx(ideal(model, keep, T, deep_block=False).concept, rel=1e-9)
