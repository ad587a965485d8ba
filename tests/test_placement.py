"""Learned placement (``--placement``): the skip-middle forward, the labels, the objective, training."""
import pytest
import torch

import concept
from concept import ComponentRef
from concept.errors import ConfigError
from concept.objectives import next_token_pairs
from concept.streaming.objectives import PlacementObjective, depth_gain, top_fraction
from concept.teacher import teacher_forward
from concept.training import TrainConfig, Trainer
from tests.conftest import randomize_new_modules, tiny_config
from tests.test_objectives import batch, interrupted_at_three, rows, with_lora
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)


# -- skip_middle = the one-pass forward with no concept ------------------------------------------
@pytest.mark.parametrize("fusion", ["none", "update", "bridge"])
@pytest.mark.parametrize("positions", ["time", "per-type"])
def test_skip_middle_equals_the_forward_without_concepts(fusion, positions):
    model = randomize_new_modules(concept.build(tiny_config(positions=positions, tail_fusion=ComponentRef(fusion))))
    model = with_lora(model, random_b=True).eval()
    for b in (batch(), batch(pad=5), batch(docs=True, seed=3)):
        none = torch.zeros_like(b["input_ids"], dtype=torch.bool)
        with torch.no_grad():
            ref = model(b["input_ids"], b["attention_mask"], keep=none, document_ids=b["document_ids"]).logits
            got = model.skip_middle(b["input_ids"], b["attention_mask"], b["document_ids"])
            every = model(b["input_ids"], b["attention_mask"], keep=~none, document_ids=b["document_ids"]).logits
        real = b["attention_mask"].bool()
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)
        assert (got[real] - every[real]).abs().max() > 1e-2  # negative control: the middle stack matters


# -- labels ------------------------------------------------------------------------------------------
def test_top_fraction_keeps_the_highest_scores_of_each_row():
    score = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.8, 0.2, 0.7, 0.4],
                          [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    got = top_fraction(score, mask, 0.25)
    assert got[0].nonzero().flatten().tolist() == [1, 4]  # 2 of 8: the two largest
    assert got[1].nonzero().flatten().tolist() == [2]  # 1 of the 4 masked positions; the larger unmasked ones never
    assert not top_fraction(score, mask, 0.1)[1].any()  # round(0.4) = 0: nothing
    assert top_fraction(score, mask, 1.0).equal(mask)


def test_top_fraction_matches_a_per_row_sort():
    g = torch.Generator().manual_seed(0)
    score, mask = torch.randn(5, 40, generator=g), torch.rand(5, 40, generator=g) > 0.3
    for fraction in (0.125, 0.25, 0.5):
        got = top_fraction(score, mask, fraction)
        for row in range(5):
            idx = mask[row].nonzero().flatten()
            k = round(len(idx) * fraction)
            best = idx[score[row, idx].argsort(descending=True)[:k]]
            assert sorted(got[row].nonzero().flatten().tolist()) == sorted(best.tolist())


def test_depth_gain_is_a_kl():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    assert depth_gain(a, a).abs().max() < 1e-6
    ref = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(depth_gain(a, b), ref)
    assert (depth_gain(a, b) > 0).all()


# -- the objective -------------------------------------------------------------------------------------
def placement_setup(seed=0):
    model = randomize_new_modules(concept.build(tiny_config()), seed)
    model = with_lora(model)
    b = batch(B=3, T=24, pad=4, docs=True, seed=seed)
    return model, b


def test_placement_labels_are_the_rows_largest_depth_gains_and_reach_the_head():
    model, b = placement_setup()
    teacher = teacher_forward(model, b["input_ids"], b["attention_mask"], b["document_ids"], frozenset({"logits"}))
    out = model(b["input_ids"], b["attention_mask"], document_ids=b["document_ids"])
    objective = PlacementObjective(2.0, lambda: 0.25)
    loss = objective(model, b, out, teacher)
    # the same term from the definition: KL per position, top quarter of each row's pairs, BCE on keep_logit
    with torch.no_grad():
        skip = model(b["input_ids"], b["attention_mask"], keep=torch.zeros_like(b["input_ids"], dtype=torch.bool),
                     document_ids=b["document_ids"]).logits
    pair = next_token_pairs(b["attention_mask"].bool(), b["document_ids"])
    gain = depth_gain(teacher.logits[:, :-1], skip[:, :-1])
    labels = []
    for row in range(3):
        idx = pair[row].nonzero().flatten()
        top = set(idx[gain[row, idx].argsort(descending=True)[: round(len(idx) * 0.25)]].tolist())
        labels += [float(t in top) for t in idx.tolist()]
    logit = model.length_policy.keep_logit(out.head_logits)[:, :-1][pair]
    ref = 2.0 * torch.nn.functional.binary_cross_entropy_with_logits(logit, torch.tensor(labels))
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert model.vocabulary.head.weight.grad.abs().sum() > 0  # it trains the keep score ...
    lora = [p for n, p in model.backbone.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is None or not p.grad.any() for p in lora)  # ... and never the states it reads
    assert objective(model, b, out, teacher).requires_grad
    assert float(PlacementObjective(1.0, lambda: 1.0)(model, b, out, teacher)) == 0.0  # every token a concept


def test_training_the_keep_score_moves_concepts_to_where_depth_is_needed():
    """Can fail: the head alone, trained on the placement term, must rank the labelled positions of
    its batches first (precision of its top quarter: chance is 25%). A tiny random backbone on
    random tokens has no pattern that generalises; generalisation is measured on SmolLM2
    (docs/results.md)."""
    torch.manual_seed(0)
    model, _ = placement_setup(seed=1)
    batches = [batch(B=4, T=32, seed=s) for s in range(2)]
    objective = PlacementObjective(1.0, lambda: 0.25)

    def teacher(b):
        with torch.no_grad():
            return teacher_forward(model, b["input_ids"], b["attention_mask"], None, frozenset({"logits"}))

    def precision():
        hits = chosen_n = 0
        for b in batches:
            with torch.no_grad():
                out = model(b["input_ids"], b["attention_mask"])
                pair = next_token_pairs(b["attention_mask"].bool())
                gain = depth_gain(teacher(b).logits[:, :-1], model.skip_middle(b["input_ids"])[:, :-1])
                label = top_fraction(gain, pair, 0.25)
                chosen = top_fraction(model.length_policy.keep_logit(out.head_logits)[:, :-1], pair, 0.25)
            hits, chosen_n = hits + int((chosen & label).sum()), chosen_n + int(chosen.sum())
        return hits / chosen_n

    before = precision()
    opt = torch.optim.Adam(model.vocabulary.parameters(), lr=3e-2)
    losses = []
    for step in range(80):
        b = batches[step % 2]
        loss = objective(model, b, model(b["input_ids"], b["attention_mask"]), teacher(b))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    after = precision()
    assert before < 0.45 and after > 0.65, (before, after)
    assert sum(losses[-10:]) < sum(losses[:10]) / 3


# -- in the trainer ------------------------------------------------------------------------------------
def test_trainer_logs_placement_and_resumes_exactly(built, corpus, tmp_path):  # noqa: F811
    def cfg():
        return small(data=str(corpus), placement=1.0, eval_every=100, log_every=100)

    straight = Trainer.start(built, tmp_path / "straight", cfg())
    assert [o.name for o in straight.objectives] == ["temperature", "ratio_control", "ratio_loss", "placement"]
    assert straight.teacher_needs == {"logits"}
    straight.train()
    interrupted_at_three(built, tmp_path / "resumed", cfg()).train()
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert all(r["placement"] > 0 for r in a)
    for key in ("loss", "placement", "ratio", "null_bias"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_placement_bad_input(built, corpus, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="placement: must be >= 0"):
        Trainer.start(built, tmp_path / "neg", small(data=str(corpus), placement=-1.0))
    fixed = tmp_path / "fixed-build"
    concept.save(concept.build(tiny_config(policy=("fixed", {"every": 3}))), fixed)
    with pytest.raises(ConfigError, match="length policy 'fixed' has no per-token keep score"):
        Trainer.start(fixed, tmp_path / "out", small(data=str(corpus), placement=1.0))
    assert not (tmp_path / "out").exists() and not (tmp_path / "neg").exists()
    pruned = Trainer.start(built, tmp_path / "pruned", small(data=str(corpus), placement=1.0, baseline="pruned",
                                                             steps=1, eval_every=100))
    assert any("--placement does nothing" in n for n in pruned.notes) and pruned.objectives == []
    assert TrainConfig(ce_weight=0.0, placement=1.0).validate(num_layers=4) == []  # a router-only stage
