"""Multi-level codes in the streaming family (docs/policies.md): a concept is L consecutive concept slots, one
code level each, read from one shallow state (level l from the query that levels < l left). The fast
paths against their references: one pass = the naive per-step loop (logits and gradients, every
backend), decoding = teacher forcing, the levels' beam = exhaustive search; gradients reach every
level's codebook; usage per level; bad input."""
import itertools
import json
import math

import pytest
import torch

import concept
from concept import ComponentRef
from concept.diagnostics import evaluate
from concept.errors import ConfigError
from tests.conftest import (assert_decoding_matches_teacher_forcing, assert_packed_documents_equal_separate_rows,
                            mix_decisions, randomize_new_modules, tiny_config)
from tests.reference import reference_logits
from tests.test_equivalence import (_new_module_grads, assert_gradients_match_naive, assert_padded_batch_matches_naive,
                                    padded_batch)

K = 8  # codes per level


def build(levels=2, beam=1, policy=("null", {"max_run": 3}), attention="sdpa", positions="time", sampler=None):
    extra = {} if sampler is None else {"sampler": ComponentRef(sampler)}
    cfg = tiny_config(attention=attention, positions=positions, policy=policy,
                      vocabulary=ComponentRef("codebook", {"size": K, "code_dim": 8, "levels": levels, "beam": beam}),
                      **extra)
    torch.manual_seed(0)
    model = randomize_new_modules(concept.build(cfg))
    with torch.no_grad():
        model.vocabulary.log_scale.fill_(1.5)  # spread the logits: every level's choice matters
    return mix_decisions(model).eval()


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(**kw):
        key = tuple(sorted((k, str(v)) for k, v in kw.items()))
        if key not in cache:
            cache[key] = build(**kw)
        return cache[key]

    return get


def test_a_boundary_emits_one_slot_per_level(models):
    model = models()
    assert model.levels == 2 and model.emit == 2
    ids, mask, keep = padded_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, keep=keep)
    kept = keep & mask.bool()
    assert out.layout.num_concepts == 2 * int(kept.sum(1).max())
    # slot 2i is level 0 and slot 2i+1 level 1 of the same token's concept, at that token's time
    level, src = out.layout.concept_level[0], out.layout.concept_id_src[0]
    n = 2 * int(kept[0].sum())
    assert level[:n].tolist() == [0, 1] * (n // 2)
    assert torch.equal(src[:n:2], src[1:n:2])
    assert torch.equal(out.codes[..., 0], out.concept_ids)
    assert ((out.codes >= 0) == kept[..., None]).all()


@pytest.mark.parametrize("attention", ["sdpa", "chunked", "xformers", "flex"])
@pytest.mark.parametrize("positions", ["time", "per-type"])
def test_one_pass_matches_naive(models, attention, positions):
    assert assert_padded_batch_matches_naive(models(attention=attention, positions=positions)).layout.emit == 2


def test_several_concepts_per_boundary_with_levels_match_naive(models):
    """`fixed` with emit 2 and 2 levels: 4 slots per boundary, concept m's levels from token t - 1 + m."""
    model = models(policy=("fixed", {"every": 3, "emit": 2}), attention="chunked")
    assert model.emit == 4
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=out.keep)
    valid = mask.bool()
    assert out.keep.any()
    torch.testing.assert_close(out.logits[valid], ref[valid], atol=1e-5, rtol=0)


def test_packed_documents_equal_separate_rows(models):
    model = models(attention="chunked")
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(6))
    keep = torch.tensor([[i % 3 == 1 for i in range(16)]])
    assert_packed_documents_equal_separate_rows(model, ids, keep)


@pytest.mark.parametrize("attention", ["sdpa", "chunked"])
def test_gradients_match_naive_and_reach_every_level(models, attention, monkeypatch):
    model = models(attention=attention)
    grads = assert_gradients_match_naive(model)
    books = ("vocabulary.codebook", "vocabulary.deeper.0")
    assert all(grads[b].abs().sum() > 0 for b in books)
    # the check fails when a level is cut off: detach level 1's codebook
    vocab_class = type(model.vocabulary)
    original = vocab_class.book
    monkeypatch.setattr(vocab_class, "book", lambda self, level: original(self, level).detach() if level == 1 else
                        original(self, level))
    ids, mask, keep = padded_batch()
    cut = _new_module_grads(model, model(ids, attention_mask=mask, keep=keep).logits, ids, mask.bool())
    assert cut["vocabulary.codebook"].abs().sum() > 0 and "vocabulary.deeper.0" not in cut
    model.zero_grad(set_to_none=True)


def test_gumbel_training_gradients_match_naive(models):
    """Training mode: the same noise in both passes (every level sampled in the same order)."""
    assert_gradients_match_naive(models(attention="chunked"), training=True)


def test_deeper_levels_code_what_the_earlier_ones_left(models):
    model = models()
    vocab = model.vocabulary
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first = vocab.logits(h, 1, torch.zeros(5, 1, dtype=torch.long))
        other = vocab.logits(h, 1, torch.ones(5, 1, dtype=torch.long))
        # the query left after removing level 0's code has no component along that code
        code = torch.nn.functional.normalize(vocab.codebook[0], dim=-1)
        query = torch.nn.functional.normalize(vocab.proj_out(concept.components.rms_normalize(h)), dim=-1)
        left = query - (query @ code)[:, None] * code
    assert not torch.allclose(first, other)
    assert (torch.nn.functional.normalize(left, dim=-1) @ code).abs().max() < 1e-5


@pytest.mark.parametrize("levels", [2, 3])
def test_level_beam_finds_the_best_codes(models, levels):
    model = models(levels=levels)
    h = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        head = model.vocabulary.logits(h)
        greedy = model.codes(h, head)[1]
        beam1 = model.level_search(h, head, 1)
        exhaustive = model.level_search(h, head, K ** (levels - 1))

        def score(ids):  # sum over levels of log p_l(id_l | ids_<l), the brute-force way
            total = head[..., :K].log_softmax(-1).gather(-1, ids[..., :1])[..., 0]
            for level in range(1, levels):
                logp = model.vocabulary.logits(h, level, ids[..., :level])[..., :K].log_softmax(-1)
                total = total + logp.gather(-1, ids[..., level:level + 1])[..., 0]
            return total

        every = torch.tensor(list(itertools.product(range(K), repeat=levels)))  # [K^L, L]
        scores = torch.stack([score(c.expand(2, 3, levels)) for c in every], -1)
    assert torch.equal(beam1, greedy)  # width 1 is the greedy choice
    torch.testing.assert_close(score(exhaustive), scores.max(-1).values)
    assert (score(exhaustive) >= score(greedy) - 1e-6).all()


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("attention", ["sdpa", "chunked"])
def test_decoding_matches_teacher_forcing(models, beam, attention):
    model = models(beam=beam, attention=attention)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 13, 1)]
    gen = assert_decoding_matches_teacher_forcing(model, prompts, 16)
    assert 0 < sum(k for row in gen.keep for k in row) < sum(len(row) for row in gen.keep)


def test_decoding_several_concepts_per_boundary_with_levels(models):
    model = models(policy=("fixed", {"every": 3, "emit": 2}), beam=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 2)]
    assert_decoding_matches_teacher_forcing(model, prompts, 12)


def test_beam_changes_codes_not_decisions(models):
    greedy, searched = models(beam=1), build(beam=K)
    ids = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a, b = greedy(ids), searched(ids)
    assert torch.equal(a.keep, b.keep) and a.keep.any()
    kept = a.keep
    assert not torch.equal(a.codes[kept], b.codes[kept])  # the search finds other codes somewhere


def test_usage_and_ratio_per_level(models):
    model = models()
    ids, mask, _ = padded_batch()
    result = evaluate(model, [{"input_ids": ids, "attention_mask": mask}], controls=True)
    assert result["usage_perplexity/level0"] >= 1.0 and result["usage_perplexity/level1"] >= 1.0
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    # the ratio counts concepts (boundaries), not their L code slots
    assert result["ratio"] == pytest.approx(float(out.keep.sum()) / float(mask.sum()))
    assert math.isfinite(result["delta_nll_random"])  # the random control runs with levels (NaN fails)
    assert math.isfinite(result["delta_nll_shuffle"])


def test_training_and_loading_with_levels(tmp_path):
    from concept.training import TrainConfig, Trainer

    cfg = tiny_config(vocabulary=ComponentRef("codebook", {"size": K, "code_dim": 8, "levels": 2}))
    cfg.backbone.params["vocab"] = 256  # byte-level tokenisation of the default corpus
    concept.save(concept.build(cfg), tmp_path / "build")
    Trainer.start(tmp_path / "build", tmp_path / "run",
                  TrainConfig(steps=2, seq_len=16, batch=2, eval_every=2, eval_batches=1, log_every=1, warmup=1,
                              lora=concept.lora.LoraSettings(rank=2))).train()
    loaded, built = concept.load(tmp_path / "run"), concept.load(tmp_path / "build")
    assert loaded.levels == 2 and loaded.emit == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    trained, start = loaded.new_state_dict(), built.new_state_dict()
    deeper = [k for k in trained if "deeper" in k]  # level 1's codebook: trained through level-1 slots
    assert deeper and all(not torch.equal(trained[k], start[k]) for k in deeper)


def test_bad_levels_and_beam():
    with pytest.raises(ConfigError, match="beam: a beam width >= 1"):
        concept.resolve(tiny_config(vocabulary=ComponentRef("codebook", {"levels": 2, "beam": 0})))
    from .test_planner_executor import pe_config

    cfg = pe_config()
    cfg.vocabulary = ComponentRef("codebook", {"levels": 2, "beam": 2})
    with pytest.raises(ConfigError, match="searches its plans, levels included, with --beam"):
        concept.resolve(cfg)


def test_ideal_flops_count_every_level_slot(models):
    from concept.flops import Shape, evenly_spaced_keep, forward_flops, head_classes, ideal_ratio

    model = models()
    report = ideal_ratio(model, 0.25, 64)
    shape = Shape.from_hf_config(model.backbone.config)
    keep = evenly_spaced_keep(64, 0.25)  # the ratio counts concepts: one boundary per 4 tokens ...
    assert report.to_dict() == forward_flops(shape, model.split, keep, head_classes(model), emit=2).to_dict()
    one_level = forward_flops(shape, model.split, keep, head_classes(model))
    assert report.concept > one_level.concept  # ... each of 2 slots
