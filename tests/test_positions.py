"""Position numbering on its own: the per-document concept ranks of the packed layout (what ``per-type``
and ``compact`` number concepts by), every scheme's rule against its definition, and ``per-type``'s offset
through a whole model against the independent oracle."""
import copy

import pytest
import torch

import concept
import concept.packing as packing
from concept import ComponentRef
from tests.conftest import randomize_new_modules, tiny_config
from tests.reference import concept_position, reference_logits, text_position


def test_concept_ranks_count_each_documents_concepts_from_zero():
    #          doc:  0  0  0  0  1  1  1  2  2  2  2  2
    keep = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]])
    valid = torch.ones_like(keep)
    layout = packing.pack(keep, valid, doc)
    assert layout.concept_src[0].tolist() == [1, 2, 4, 6, 9, 10, 11]
    assert layout.concept_rank[0].tolist() == [0, 1, 0, 1, 0, 1, 2]
    # two concept slots per boundary (emit = 2): each boundary's slots are consecutive ranks
    two = packing.pack(keep, valid, doc, emit=2)
    assert two.concept_rank[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]


def test_ranks_ignore_padding_and_restart_per_row():
    keep = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)  # right and left padding
    layout = packing.pack(keep & valid, valid)
    real = layout.concept_rank[layout.meta.valid[:, : layout.num_concepts]]
    assert real.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("scheme, params", [("time", {}), ("per-type", {"offset": 0}), ("per-type", {"offset": 5}),
                                            ("compact", {})])
def test_every_scheme_follows_its_definition(scheme, params):
    cfg = tiny_config(positions=scheme)
    cfg.position_scheme = ComponentRef(scheme, params)
    model = concept.build(cfg)
    index = torch.tensor([[0, 3, 4, 9, 12]])
    rank = torch.tensor([[0, 1, 2, 3, 4]])
    for stack in ("middle", "deep"):
        got = model.positions.concept_positions(index, rank, stack)
        assert torch.equal(got, concept_position(model, index, rank, stack)), (scheme, stack)
    assert torch.equal(model.positions.text_positions(index), text_position(model, index))


def test_per_type_offset_through_the_whole_model_in_fp64():
    cfg = tiny_config(positions="per-type")
    cfg.position_scheme = ComponentRef("per-type", {"offset": 7})
    model = copy.deepcopy(randomize_new_modules(concept.build(cfg))).double().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (1, 12), generator=g)
    keep = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        out = model(ids, keep=keep).logits
        ref, _ = reference_logits(model, ids, keep=keep)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
        model.resolution.components["position_scheme"].config.offset = 0  # the oracle reads another offset: caught
        wrong, _ = reference_logits(model, ids, keep=keep)
        model.resolution.components["position_scheme"].config.offset = 7
    assert (out - wrong).abs().max() > 1e-6
