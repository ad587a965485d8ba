"""`chunked` on a static layout (issue 39, fewer ops per step): the concept block's queries join the first tail
chunk's SDPA call (their keys are a prefix of its keys), so a deep layer makes one call per chunk of tail slots,
and a single call returns its output without a concatenation. The one-pass logits and gradients still equal
the naive per-t loop's, with one chunk and with several. Negative control: a merged mask that lets the concept
queries see tail keys is caught."""
import dataclasses

import pytest
import torch

import concept
import concept_plugins.attention.chunked as chunked  # (the module the registry loads)
from concept import ComponentRef
from tests.conftest import randomize_new_modules, tiny_config
from tests.reference import reference_logits
from tests.test_equivalence import ATOL, assert_gradients_match_naive, padded_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(chunk: int, max_ratio: float = 1.0):
    """The tiny model, ``chunked`` with ``chunk`` tail queries per call; ``max_ratio`` 1.0: a static layout
    that holds every forced decision (0: the dynamic layout)."""
    cfg = dataclasses.replace(tiny_config(attention="chunked", max_ratio=max_ratio),
                              attention=ComponentRef("chunked", {"chunk": chunk}))
    return randomize_new_modules(concept.build(cfg))


def calls_per_layer(model, monkeypatch) -> tuple[float, int]:
    """(SDPA calls of a deep layer, the chunks of tail slots) in a forward of ``padded_batch``."""
    calls = []
    real = chunked.sdpa
    monkeypatch.setattr(chunked, "sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask, keep = padded_batch()
    with torch.no_grad():
        layout = model(ids, attention_mask=mask, keep=keep).layout
    monkeypatch.setattr(chunked, "sdpa", real)
    chunk = model.attention.config.chunk
    return len(calls) / len(model.deep), -(-(layout.length - layout.num_concepts) // chunk)


@pytest.mark.parametrize("chunk", [64, 4])  # one chunk of the 12 tail slots (a single call), three
def test_static_chunked_matches_naive_with_one_call_per_chunk(chunk, monkeypatch):
    model = model_of(chunk)
    ids, mask, keep = padded_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, keep=keep)
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)
    assert out.layout.static
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref[real], atol=ATOL, rtol=0)
    assert_gradients_match_naive(model)
    calls, chunks = calls_per_layer(model, monkeypatch)
    assert calls == chunks == -(-ids.shape[1] // chunk)
    calls, chunks = calls_per_layer(model_of(chunk, max_ratio=0.0), monkeypatch)
    assert calls == chunks + 1  # the dynamic layout keeps its own call for the concept block


def test_negative_control_concept_queries_that_see_tail_keys_are_caught(monkeypatch):
    model = model_of(64)
    ids, mask, keep = padded_batch()
    real_allowed, real_blocks = chunked.allowed, chunked.RuleBlocks.__call__
    monkeypatch.setattr(chunked, "allowed", lambda q, k: real_allowed(q, k) | q.keep[:, :, None])
    # (a static layout's chunks: the rule's blocks, ``packing.RuleBlocks``)
    monkeypatch.setattr(chunked.RuleBlocks, "__call__",
                        lambda self, a, b, kb: real_blocks(self, a, b, kb) | self.meta.keep[:, a:b, None])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, keep=keep)
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)
    real = mask.bool()
    assert (out.logits[real] - ref[real]).abs().max() > 100 * ATOL
