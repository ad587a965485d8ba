"""The streaming forward's small per-forward glue (issue 39): the middle and deep stacks' RoPE tables built in one
call of the backbone's rotary embedding (``concept.backbone.rope_tables``; the shallow stack's comes before the
decisions, so it keeps its own) instead of one per stack, and the ratio objectives reading the forward's mask of
real tokens (``out.valid``) instead of casting the attention mask again. Same math: logits, loss and gradients
bit for bit equal to the per-stack tables (each stack building its own in ``run_layers``, as before), with a
position scheme whose middle and deep positions differ (``compact``: ranks in the middle; every scheme's forward
against the slow oracle: tests/test_equivalence.py). Negative control: a table of positions one off is caught.
The aten-op counts: ``tests/test_step_ops.py`` and docs/benchmarks.md."""
import pytest
import torch

import concept.streaming.stacks as streaming_stacks
from concept.objectives import real_tokens

from .conftest import PACKED_DOC, mixed_model

pytestmark = pytest.mark.usefixtures("one_thread")


def forward_and_grads(model, ids, mask, doc):
    """(logits, loss, {parameter: gradient}, rotary calls) of a training forward and its backward."""
    calls = []
    hook = model.inner.rotary_emb.register_forward_hook(lambda *a: calls.append(1))
    model.zero_grad()
    try:
        out = model(ids, attention_mask=mask, labels=ids, document_ids=doc)
        out.loss.backward()
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, len(calls)


def test_one_rope_table_for_the_middle_and_deep_stacks_is_bit_identical(monkeypatch):
    model = mixed_model(positions="compact")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    doc = torch.tensor(PACKED_DOC * 2)
    out, grads, calls = forward_and_grads(model, ids, mask, doc)
    with monkeypatch.context() as m:  # the reference: every stack builds its own table (run_layers), as before
        m.setattr(streaming_stacks, "rope_tables", lambda rotary, x, position_ids: [None] * len(position_ids))
        ref, ref_grads, ref_calls = forward_and_grads(model, ids, mask, doc)
    assert out.keep.any() and (calls, ref_calls) == (2, 3)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    assert grads.keys() == ref_grads.keys() and len(grads) >= 3  # (the new modules: the backbone is frozen)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    # the ratio objectives' mask: the forward's own, the attention mask's real tokens
    assert real_tokens({"input_ids": ids, "attention_mask": mask}, out) is out.valid
    assert torch.equal(out.valid, mask.bool())
    with monkeypatch.context() as m:  # negative control: a table of positions one off
        m.setattr(streaming_stacks, "rope_tables",
                  lambda rotary, x, position_ids: [rotary(x, p + 1) for p in position_ids])
        off, _, _ = forward_and_grads(model, ids, mask, doc)
    assert not torch.equal(off.logits, ref.logits)
