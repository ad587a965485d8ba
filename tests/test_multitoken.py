"""Multi-token decoding: a block of tokens through the three caches in one forward equals that many
single steps, a rejected suffix leaves no trace, `verify` is token for token greedy decoding, and
`confadapt` keeps what its heads are confident about."""
from __future__ import annotations

import pytest
import torch

from concept import multitoken
from concept.streaming.decoding import ConceptDecoder
from concept.errors import ConceptError, ConfigError
from tests.conftest import mixed_model

CASES = [dict(policy="mtp"), dict(policy="null"), dict(policy="threshold"), dict(policy="entropy"),
         dict(policy="mtp", positions="per-type"), dict(policy="mtp", backbone="tiny-qwen2"),
         dict(policy="null", tail_fusion=__import__("concept").ComponentRef("update"))]
IDS = ["mtp", "null", "threshold", "entropy", "mtp-per-type", "mtp-qwen2", "null-update-fusion"]


def prompts_and_continuation(seed=1):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (3, 7), generator=g)
    valid = torch.ones_like(prompt, dtype=torch.bool)
    valid[1, :3] = False  # a shorter (left-padded) prompt
    return prompt, valid, torch.randint(0, 97, (3, 10), generator=g)


def sequential(model, prompt, valid, cont):
    d = ConceptDecoder(model)
    d.prefill(prompt, valid)
    return d, [d.step(cont[:, j]) for j in range(cont.shape[1])]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_block_equals_single_steps_and_a_rejected_suffix_leaves_no_trace(case):
    model = mixed_model(attention="chunked", **case)
    prompt, valid, cont = prompts_and_continuation()
    ref, logits = sequential(model, prompt, valid, cont)
    assert 0 < sum(ref.keep[0][7:]) < 10  # both kinds of step happen in the continuation

    d = ConceptDecoder(model)
    d.prefill(prompt, valid)
    block = d.extend(cont[:, :5])
    for j in range(5):
        torch.testing.assert_close(block[:, j], logits[j], atol=1e-5, rtol=1e-5)
    d.accept(torch.tensor([2, 5, 0]))  # each row keeps a different prefix (row 2: nothing)
    done = [2, 5, 0]
    while min(done) < 10:  # then single steps; each row continues from where it stopped
        active = torch.tensor([n < 10 for n in done])
        token = torch.stack([cont[b, min(n, 9)] for b, n in enumerate(done)])
        out = d.step(token, active)
        for b, n in enumerate(done):
            if n < 10:
                torch.testing.assert_close(out[b], logits[n][b], atol=1e-5, rtol=1e-5)
        done = [n + 1 if n < 10 else n for n in done]
    assert d.keep == ref.keep
    assert [r["entries"] for r in d.kv_stats()] == [r["entries"] for r in ref.kv_stats()]
    assert torch.equal(d.num_concepts, ref.num_concepts) and torch.equal(d.pos, ref.pos)


def test_blocks_back_to_back_equal_single_steps():
    model = mixed_model("mtp", "chunked")
    prompt, valid, cont = prompts_and_continuation(seed=4)
    _, logits = sequential(model, prompt, valid, cont)
    d = ConceptDecoder(model)
    d.prefill(prompt, valid)
    at = 0
    for n in (3, 1, 4, 2):
        block = d.extend(cont[:, at:at + n])
        for j in range(n):
            torch.testing.assert_close(block[:, j], logits[at + j], atol=1e-5, rtol=1e-5)
        d.accept(torch.full((3,), n))
        at += n


def test_multi_token_steps_need_one_concept_per_boundary():
    model = mixed_model("fixed-emit2", "chunked")
    prompt, valid, cont = prompts_and_continuation()
    d = ConceptDecoder(model)
    d.prefill(prompt, valid)
    with pytest.raises(ConceptError, match="one concept slot per boundary"):
        d.extend(cont[:, :2])


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [60, 61, 62, 63]]


def oracle_drafts(monkeypatch, greedy, wrong_every=None, confidence=1.0):
    """Heads that draft the true greedy continuation (wrong at every ``wrong_every``-th draft)."""
    calls = {"n": 0}

    def draft(model, decoder, first):
        k = model.mtp_heads.k
        block = torch.zeros(len(first), k, dtype=torch.long)
        for b in range(len(first)):
            done = int(decoder.pos[b]) - len(PROMPTS[b])  # new tokens kept so far
            row = greedy[b] + [0] * (k + 1)
            block[b] = torch.tensor([int(first[b])] + row[done + 1: done + k])
            calls["n"] += 1
            if wrong_every and calls["n"] % wrong_every == 0:
                block[b, 1 + calls["n"] % (k - 1)] = (block[b, 1 + calls["n"] % (k - 1)] + 1) % 97
        return block, torch.full((len(first), k - 1), confidence)

    monkeypatch.setattr(multitoken, "draft", draft)


def test_verify_is_greedy_decoding_token_for_token(monkeypatch):
    model = mixed_model("mtp", "chunked")
    plain = model.generate(PROMPTS, max_new_tokens=20, output_logits=True)
    untrained = model.generate(PROMPTS, max_new_tokens=20, mtp="verify")  # the heads' own (poor) drafts
    assert untrained.tokens == plain.tokens
    oracle_drafts(monkeypatch, plain.tokens, wrong_every=3)  # right drafts, and some wrong ones
    out = model.generate(PROMPTS, max_new_tokens=20, mtp="verify", output_logits=True)
    assert out.tokens == plain.tokens
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=1e-5)
    assert out.steps <= 0.75 * plain.steps  # accepted drafts: fewer forwards (13 vs 19 here)
    assert all(o[:len(p)] == p for o, p in zip(out.keep, plain.keep))  # (the last new token is fed too)


def test_confadapt_keeps_confident_drafts_unchecked(monkeypatch):
    model = mixed_model("mtp", "chunked")
    plain = model.generate(PROMPTS, max_new_tokens=12)
    k = model.mtp_heads.k
    oracle_drafts(monkeypatch, plain.tokens, confidence=0.95)
    out = model.generate(PROMPTS, max_new_tokens=12, mtp="confadapt", mtp_tau=0.9)
    assert out.tokens == plain.tokens and out.steps == -(-12 // k)  # k tokens per forward
    oracle_drafts(monkeypatch, plain.tokens, confidence=0.5)
    low = model.generate(PROMPTS, max_new_tokens=12, mtp="confadapt", mtp_tau=0.9)
    assert low.tokens == plain.tokens and low.steps == 12  # nothing confident: one token per forward
    oracle_drafts(monkeypatch, [[(t + 1) % 97 for t in row] for row in plain.tokens], confidence=0.95)
    wrong = model.generate(PROMPTS, max_new_tokens=12, mtp="confadapt", mtp_tau=0.9)
    assert wrong.tokens != plain.tokens  # unchecked: confident wrong drafts are kept (lossy by design)


def test_stops_inside_a_block(monkeypatch):
    model = mixed_model("mtp", "chunked")
    plain = model.generate(PROMPTS, max_new_tokens=10)
    eos = plain.tokens[0][4]
    ref = model.generate(PROMPTS, max_new_tokens=10, eos_token_id=eos)
    oracle_drafts(monkeypatch, plain.tokens)
    out = model.generate(PROMPTS, max_new_tokens=10, eos_token_id=eos, mtp="verify")
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    short = model.generate(PROMPTS, max_new_tokens=5, mtp="verify")
    assert all(len(t) == 5 for t in short.tokens) and short.finish_reasons == ["length"] * 3


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ConceptError, match="no MTP heads; build it with --length-policy mtp"):
        mixed_model("null", "chunked").generate(PROMPTS, max_new_tokens=4, mtp="verify")
    model = mixed_model("mtp", "chunked")
    with pytest.raises(ConceptError, match="exact speculative sampling is not built"):
        model.generate(PROMPTS, max_new_tokens=4, mtp="verify", do_sample=True)
    with pytest.raises(ConfigError, match="mtp: verify or confadapt"):
        model.generate(PROMPTS, max_new_tokens=4, mtp="medusa")
    with pytest.raises(ConfigError, match=r"mtp_tau: must be in \(0, 1\]"):
        model.generate(PROMPTS, max_new_tokens=4, mtp="confadapt", mtp_tau=0)


# -- the dense baseline with MTP heads --------------------------------------------------------------
def dense_with_heads(k=3, removed=None):
    from concept.dense import DenseModel

    model = mixed_model("mtp", "chunked")
    dense = DenseModel(model.backbone, removed=removed, mtp_heads=k).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in dense.mtp_heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return dense


@pytest.mark.parametrize("removed", [None, (2, 4)], ids=["dense", "pruned"])
def test_dense_block_equals_single_steps_and_verify_is_greedy(removed, monkeypatch):
    from concept.decoding import DenseDecoder

    dense = dense_with_heads(removed=removed)
    prompt, valid, cont = prompts_and_continuation()
    with dense.pruned_backbone():
        one = DenseDecoder(dense.backbone, dense.layers[-1])
        one.prefill(prompt, valid)
        logits = [one.step(cont[:, j]) for j in range(8)]
        d = DenseDecoder(dense.backbone, dense.layers[-1])
        d.prefill(prompt, valid)
        block = d.extend(cont[:, :4])
        for j in range(4):
            torch.testing.assert_close(block[:, j], logits[j], atol=1e-5, rtol=1e-5)
        d.accept(torch.tensor([1, 4, 2]))
        done = [1, 4, 2]
        for _ in range(4):  # single steps from there (each row where it stopped)
            token = torch.stack([cont[b, n] for b, n in enumerate(done)])
            out = d.step(token)
            for b, n in enumerate(done):
                torch.testing.assert_close(out[b], logits[n][b], atol=1e-5, rtol=1e-5)
            done = [n + 1 for n in done]
        # the heads' state is the last fed token's final hidden state
        ref = dense(torch.cat([prompt, cont[:, :8]], 1), attention_mask=torch.cat([valid, torch.ones(3, 8, dtype=torch.bool)], 1))
        torch.testing.assert_close(one.draft_state(), ref.hidden[:, -1], atol=1e-5, rtol=1e-5)
    plain = dense.generate(PROMPTS, max_new_tokens=16)
    assert dense.generate(PROMPTS, max_new_tokens=16, mtp="verify").tokens == plain.tokens
    oracle_drafts(monkeypatch, plain.tokens, wrong_every=3)
    fast = dense.generate(PROMPTS, max_new_tokens=16, mtp="verify")
    assert fast.tokens == plain.tokens and fast.steps < plain.steps


def test_dense_baseline_trains_saves_and_loads_its_heads(tmp_path):
    import concept
    from concept.training import TrainConfig, Trainer
    from tests.test_training import STDLIB

    corpus = tmp_path / "code.txt"
    corpus.write_text((STDLIB / "textwrap.py").read_text())
    cfg = concept.BuildConfig(backbone=concept.ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2,
                                                                          "kv_heads": 1, "intermediate": 64}),
                              split="1,2,1", vocabulary=concept.ComponentRef("embedding", {"size": 32}))
    concept.save(concept.build(cfg), tmp_path / "m")
    train = TrainConfig(steps=3, seq_len=32, batch=2, eval_every=3, eval_batches=1, checkpoint_every=3, log_every=1,
                        warmup=1, data=str(corpus), baseline="dense", mtp_heads=2,
                        lora=concept.lora.LoraSettings(rank=2))
    trainer = Trainer.start(tmp_path / "m", tmp_path / "d", train)
    trainer.train()
    rows = [__import__("json").loads(line) for line in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert all("mtp" in r for r in rows if "loss" in r)
    model = concept.load(tmp_path / "d")
    assert model.mtp_heads is not None and model.mtp_heads.k == 2
    torch.testing.assert_close(model.new_state_dict(), trainer.model.new_state_dict())
    assert model.new_state_dict()["mtp_heads.blocks.1.weight"].abs().sum() > 0  # trained away from zero
    out = model.generate([[5, 6, 7]], max_new_tokens=5, mtp="verify")
    assert out.tokens == model.generate([[5, 6, 7]], max_new_tokens=5).tokens
    problems = TrainConfig(mtp_heads=2).validate(2048, 4)
    assert any("only for --baseline" in p and "--length-policy mtp" in p for p in problems)
