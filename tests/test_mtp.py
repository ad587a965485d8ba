"""MTP heads and their self-distillation objective, against naive per-position loops; the `mtp`
length policy's own behaviour (its decisions and decoding are covered with every other policy in
test_policies / test_equivalence)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import concept
from concept import ComponentRef
from concept.mtp import mtp_pairs
from concept.objectives import MTPObjective
from concept.teacher import teacher_forward
from tests.conftest import mixed_model, randomize_new_modules, tiny_config


def batch_with_documents_and_padding():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 97, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    doc = torch.zeros(3, 12, dtype=torch.long)
    doc[0, 5:] = 1  # two documents in row 0
    return {"input_ids": ids, "attention_mask": mask, "document_ids": doc}


def test_mtp_pairs_match_a_naive_loop():
    b = batch_with_documents_and_padding()
    valid, doc = b["attention_mask"].bool(), b["document_ids"]
    for i in range(4):
        pairs = mtp_pairs(valid, doc, i)
        for row in range(3):
            for t in range(12 - 1 - i):
                span = range(t, t + 2 + i)
                ok = all(valid[row, s] for s in span) and all(doc[row, s] == doc[row, t] for s in span)
                assert bool(pairs[row, t]) == ok, (i, row, t)


def test_objective_matches_a_naive_per_position_sum():
    """Head i at t against the teacher's distribution at t+i and the real token t+1+i."""
    model = mixed_model("mtp")
    b = batch_with_documents_and_padding()
    with torch.no_grad():
        out = model(b["input_ids"], attention_mask=b["attention_mask"], document_ids=b["document_ids"])
        teacher = teacher_forward(model, b["input_ids"], b["attention_mask"], b["document_ids"])
        value = MTPObjective(weight=0.7, ce=0.3)(model, b, out, teacher)
    heads, valid, doc, ids = model.mtp_heads, b["attention_mask"].bool(), b["document_ids"], b["input_ids"]
    expected = 0.0
    for i in range(heads.k):
        kl, ce, n = 0.0, 0.0, 0
        for row in range(3):
            for t in range(12 - 1 - i):
                span = range(t, t + 2 + i)
                if not all(valid[row, s] and doc[row, s] == doc[row, t] for s in span):
                    continue
                log_p = F.log_softmax(heads.logits(out.shallow[row, t], i).double(), -1)
                log_q = F.log_softmax(teacher.logits[row, t + i].double(), -1)
                kl += float((log_q.exp() * (log_q - log_p)).sum().detach())
                ce += float(-log_p[ids[row, t + 1 + i]].detach())
                n += 1
        expected += (kl + 0.3 * ce) / n
    assert math.isclose(float(value), 0.7 * expected / heads.k, rel_tol=1e-4)


def test_heads_start_as_the_logit_lens_and_the_policy_as_entropy():
    """Zero-initialised blocks: head 0's confidence is exactly the `entropy` policy's lens, and
    with the same tau both policies decide the same boundaries."""
    mtp = concept.build(tiny_config(policy=("mtp", {"heads": 2, "tau": 0.03, "max_chunk": 5, "track": 0})))
    ent = concept.build(tiny_config(policy=("entropy", {"tau": 0.03, "max_chunk": 5})))
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = mtp.shallow_states(x, torch.ones_like(x, dtype=torch.bool))
        conf = mtp.length_policy.confidence(h)
        torch.testing.assert_close(conf, ent.length_policy.confidence(h), atol=0, rtol=0)
        assert math.isclose(mtp.length_policy.tau, 0.03, rel_tol=1e-5)
        tau = float(conf.median())  # about half the tokens unsure (a tiny random model is never confident)
        ent.length_policy.config.tau = tau
        mtp.length_policy.null_bias.fill_(math.log((1 - tau) / tau))
        keep = mtp(x).keep
        assert torch.equal(keep, ent(x).keep) and 0 < int(keep.sum()) < keep.numel()


def test_heads_train_towards_later_tokens():
    """A few steps of the objective alone: the loss falls and head 1 learns something head 0 does not
    (its logits move away from the lens)."""
    model = randomize_new_modules(concept.build(tiny_config(policy=("mtp", {"heads": 2}))))
    with torch.no_grad():
        for block in model.mtp_heads.blocks:
            block.weight.zero_()
            block.bias.zero_()
    b = {"input_ids": torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2)),
         "attention_mask": torch.ones(4, 16, dtype=torch.long), "document_ids": None}
    objective = MTPObjective(1.0, 0.5)
    opt = torch.optim.Adam(model.mtp_heads.parameters(), lr=1e-2)
    with torch.no_grad():
        out = model(b["input_ids"])
        teacher = teacher_forward(model, b["input_ids"], b["attention_mask"])
    losses = []
    for _ in range(30):
        loss = objective(model, b, out, teacher)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0]
    assert all(p.grad is None for p in model.backbone.parameters())  # the heads read detached states
    h = out.shallow
    assert not torch.allclose(model.mtp_heads.logits(h, 1), model.mtp_heads.logits(h, 0))


@pytest.mark.parametrize("params,fragment", [
    ({"heads": 0}, "heads: must be >= 1"),
    ({"tau": 1.0}, "tau: must be in (0, 1)"),
    ({"min_chunk": 4, "max_chunk": 2}, "min_chunk (4) must be <= max_chunk (2)"),
    ({"lr": -1}, "lr: must be >= 0"),
])
def test_bad_policy_config_is_one_clear_error(params, fragment):
    with pytest.raises(concept.ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        concept.build(tiny_config(policy=("mtp", params)))


def test_bad_mtp_weights_are_refused():
    from concept.training import TrainConfig

    problems = TrainConfig(mtp=-1, mtp_ce=float("nan")).validate(2048, 6)
    assert any("mtp: must be >= 0" in p for p in problems) and any("mtp-ce: must be a finite number" in p for p in problems)


def test_model_without_heads_has_none():
    model = mixed_model("null")
    assert model.mtp_heads is None
    assert isinstance(mixed_model("mtp").length_policy.heads, torch.nn.Module)
    assert ComponentRef("mtp").name == "mtp"


def test_eval_reports_each_heads_accuracy_against_a_naive_count():
    from concept.diagnostics import evaluate

    model = mixed_model("mtp")
    b = batch_with_documents_and_padding()
    result = evaluate(model, [b], controls=False)
    with torch.no_grad():
        out = model(b["input_ids"], attention_mask=b["attention_mask"], document_ids=b["document_ids"])
    valid, doc, ids = b["attention_mask"].bool(), b["document_ids"], b["input_ids"]
    for i, acc in enumerate(result["mtp_accuracy"]):
        hits = n = 0
        for row in range(3):
            for t in range(12 - 1 - i):
                if all(valid[row, s] and doc[row, s] == doc[row, t] for s in range(t, t + 2 + i)):
                    n += 1
                    hits += int(model.mtp_heads.logits(out.shallow[row, t], i).argmax() == ids[row, t + 1 + i])
        assert acc == round(hits / n, 4)
    assert 0 < result["mtp_tau"] < 1


def test_ratio_tracker_holds_the_target_when_confidences_shift():
    """A bias set for other text (every token 'confident': only max_chunk forcing) gives 1/max_chunk
    concepts per token without the tracker; with it, each document pulls itself to the target."""
    ids = torch.randint(0, 97, (4, 96), generator=torch.Generator().manual_seed(3))
    ratios = {}
    for track in (0.0, 1.0):
        model = concept.build(tiny_config(policy=("mtp", {"heads": 2, "max_chunk": 16, "track": track})))
        policy = model.length_policy
        with torch.no_grad():
            policy.null_bias.zero_()
            raw = policy.keep_logit(None, model.shallow_states(ids, torch.ones_like(ids, dtype=torch.bool)))
            policy.null_bias.fill_(float(raw.max()) + 0.5)  # just above every token: nothing is unsure
            policy.target_ratio.fill_(0.25)
            ratios[track] = float(model(ids).keep.float().mean())
    assert abs(ratios[0.0] - 1 / 16) < 0.01
    assert abs(ratios[1.0] - 0.25) < 0.03
