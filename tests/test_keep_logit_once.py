"""The length policy's keep score (``keep_logit``) is computed once per forward (issue 39: the streaming step's glue)
and handed to the three readers that each computed it: the decision, the ratio loss and the ratio controller's
statistics (``ConceptOutput.keep_logit``). The values and gradients are those of each reader computing it from the
forward's head logits, bit for bit (the same ops on the same inputs; a single differentiable reader, the ratio
loss). The `threshold` policy's straight-through gate (training) still computes its own: sharing it would add its
gradient and the ratio loss's before the score's backward instead of after, another summation order. Negative
controls: an output without the shared score makes the readers compute it three times, and a score
off by 0.5 is caught by the equality checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from concept.packing import document_starts
from concept.streaming.objectives import RatioControl, RatioObjective
from concept.streaming.ratio import PIController, RatioLoss
from tests.conftest import mixed_model

TARGET = 0.25


def batch_of(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 13 + [1] * 11])
    return {"input_ids": ids, "attention_mask": mask, "document_ids": doc}


def readers(model, batch, out):
    """What the step reads of the keep score: the ratio loss (when the policy has a boundary probability) and the
    PI controller's statistics."""
    loss = RatioObjective(1.0, lambda: TARGET)(model, batch, out) if hasattr(model.length_policy, "boundary_prob") \
        else None
    control = RatioControl(lambda: TARGET, TARGET, PIController(TARGET), tracking=True, calibration_batches=0)
    stats = control.stats(model, batch, out)
    return loss, stats["_quantile"], stats["_spread"]


def counting(monkeypatch, policy) -> list[int]:
    calls = [0]
    keep_logit = policy.keep_logit

    def counted(*args, **kwargs):
        calls[0] += 1
        return keep_logit(*args, **kwargs)

    monkeypatch.setattr(policy, "keep_logit", counted)
    return calls


@pytest.mark.parametrize("policy", ["null", "threshold", "mtp"])
def test_a_training_forward_computes_the_keep_logit_once(policy, monkeypatch):
    model, batch = mixed_model(policy).train(), batch_of()
    calls = counting(monkeypatch, model.length_policy)
    try:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"], document_ids=batch["document_ids"])
        readers(model, batch, out)
        once = 2 if policy == "threshold" else 1  # (threshold's training gate: its own graph, see the module)
        assert calls[0] == once, f"{policy}: keep_logit computed {calls[0]} times in one forward and its readers"

        # negative control: an output without the shared score, every reader computes its own (the step before)
        readers(model, batch, dataclasses.replace(out, keep_logit=None))
        assert calls[0] == once + {"null": 2, "threshold": 2, "mtp": 1}[policy]  # (mtp: no ratio loss)
    finally:
        model.eval()


@pytest.mark.parametrize("policy", ["null", "threshold", "mtp"])
def test_the_shared_keep_logit_gives_the_same_decision_ratio_loss_gradients_and_pi_statistics(policy):
    model, batch = mixed_model(policy).train(), batch_of(1)
    valid, doc = batch["attention_mask"].bool(), batch["document_ids"]
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        torch.manual_seed(0)
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"], document_ids=doc)
        assert out.keep_logit is not None and out.keep_logit.requires_grad == (policy != "mtp")
        # the decision: the policy's own, from the forward's head outputs (no budget in this build: chosen = kept)
        alone = model.length_policy.decide(out.shallow, out.head_logits, valid, document_starts(valid, doc))
        assert torch.equal(out.keep, alone.bool() & valid)

        loss, quantile, spread = readers(model, batch, out)
        # each reader computing the score itself from the forward's head logits (the code before)
        old = dataclasses.replace(out, keep_logit=None)
        old_loss, old_quantile, old_spread = readers(model, batch, old)
        assert torch.equal(quantile, old_quantile) and torch.equal(spread, old_spread)
        if loss is not None:
            assert torch.equal(loss, old_loss)
            grads = torch.autograd.grad(loss, trained, retain_graph=True, allow_unused=True)
            old_grads = torch.autograd.grad(old_loss, trained, retain_graph=True, allow_unused=True)
            assert sum(g is not None for g in grads) > 0
            for g, o in zip(grads, old_grads):
                assert (g is None and o is None) or torch.equal(g, o)

        # negative control: a score off by 0.5 is seen by the equality checks above
        off = dataclasses.replace(out, keep_logit=out.keep_logit + 0.5)
        off_loss, off_quantile, _ = readers(model, batch, off)
        assert not torch.equal(off_quantile, old_quantile)
        if loss is not None:
            assert not torch.equal(off_loss, old_loss)
    finally:
        model.eval()


def test_the_ratio_loss_reads_the_probability_of_the_shared_score():
    """``boundary_prob(..., keep_logit=s)`` is ``sigmoid(s)`` for the `null` policy (what RatioLoss then reads)."""
    model, batch = mixed_model("null"), batch_of(2)
    with torch.no_grad():
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    p = model.length_policy.boundary_prob(out.head_logits, out.shallow, keep_logit=out.keep_logit)
    assert torch.equal(p, torch.sigmoid(out.keep_logit))
    valid = batch["attention_mask"].bool()
    assert torch.equal(RatioLoss(TARGET)(out.keep, p, valid),
                       RatioLoss(TARGET)(out.keep, model.length_policy.boundary_prob(out.head_logits), valid))
