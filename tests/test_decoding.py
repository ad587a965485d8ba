"""Online decoding with three KV caches against the teacher-forced one-pass forward (docs/architecture.md)."""
import copy
import warnings

import pytest
import torch

from concept.streaming import decoding as streaming_decoding
from concept.streaming.decoding import ConceptDecoder
from concept.errors import ConceptError, ConfigError
from concept.flops import Shape, decode_flops, deep_keys, forward_flops
from concept.generation import left_pad
from tests.conftest import assert_decoding_matches_teacher_forcing, mixed_model

MAX_RUN = 3  # tiny_config's null policy


@pytest.fixture(scope="module")
def mixed():
    """Tiny models whose `null` policy lets about 30% of tokens emit a concept (see conftest)."""
    return lambda **kw: mixed_model("null", **kw)


def prompts(lengths=(5, 13, 1), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


def teacher_forced(model, prompt, out_tokens, keep):
    """One-pass logits on the final sequence with the decoding's decisions (the last token's is unknown)."""
    seq = torch.tensor(prompt + out_tokens)[None]
    forced = torch.tensor(keep + [False])[None]
    return model(seq, keep=forced).logits[0]


@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "chunked", "xformers"])
@pytest.mark.parametrize("positions", ["time", "per-type"])
def test_decode_logits_equal_teacher_forcing(mixed, backbone, attention, positions):
    model = mixed(backbone=backbone, attention=attention, positions=positions)
    ps = prompts()
    out = model.generate(ps, max_new_tokens=24, output_logits=True)
    decisions = [k for row in out.keep for k in row]
    assert 0 < sum(decisions) < len(decisions)  # both kinds of step happen
    with torch.no_grad():
        for b, p in enumerate(ps):
            n = len(out.tokens[b])
            assert n == 24 and len(out.keep[b]) == len(p) + n - 1
            # the step-wise decisions are the batched decisions on the final sequence
            free = model(torch.tensor(p + out.tokens[b][:-1])[None])
            assert free.keep[0].tolist() == out.keep[b]
            logits = teacher_forced(model, p, out.tokens[b], out.keep[b])
            torch.testing.assert_close(out.logits[b, :n], logits[len(p) - 1:len(p) - 1 + n], atol=1e-5, rtol=1e-5)


def test_negative_control_a_tail_kept_past_its_concept_is_caught(mixed, monkeypatch):
    """Decoding whose deep cache keeps the tail when a concept is emitted (``drop_tail`` a no-op) no longer
    equals teacher forcing: the comparison above can fail."""
    from concept.kv_cache import SlotCache

    model = mixed(attention="sdpa", positions="time")
    ps = prompts()
    assert_decoding_matches_teacher_forcing(model, ps, 12)
    monkeypatch.setattr(SlotCache, "drop_tail", lambda self, rows: None)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_decoding_matches_teacher_forcing(model, ps, 12)


@pytest.mark.parametrize("attention", ["sdpa", "chunked"])
@pytest.mark.parametrize("positions", ["time", "per-type", "compact"])
def test_decode_logits_equal_teacher_forcing_in_fp64(mixed, attention, positions, monkeypatch):
    """The same claim in float64 at atol 1e-10 (agreement is ~1e-15), where a tail kept one step too long
    is ten orders of magnitude above the tolerance."""
    from concept.kv_cache import SlotCache

    model = copy.deepcopy(mixed(attention=attention, positions=positions)).double().eval()
    ps = prompts()
    gen = assert_decoding_matches_teacher_forcing(model, ps, 16, atol=1e-10)
    assert gen.logits.dtype == torch.float64
    monkeypatch.setattr(SlotCache, "drop_tail", lambda self, rows: None)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_decoding_matches_teacher_forcing(model, ps, 16, atol=1e-10)


def test_batched_generation_equals_one_by_one(mixed):
    model = mixed(attention="chunked")
    ps = prompts((7, 2, 12, 4), seed=3)
    batched = model.generate(ps, max_new_tokens=16)
    for b, p in enumerate(ps):
        alone = model.generate([p], max_new_tokens=16)
        assert alone.tokens[0] == batched.tokens[b]
        assert alone.keep[0] == batched.keep[b]
        assert alone.kv[0]["entries"] == batched.kv[b]["entries"]


def test_right_padded_tensor_input_is_the_same_as_lists(mixed):
    model = mixed()
    ps = prompts((6, 3))
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for b, p in enumerate(ps):
        ids[b, :len(p)] = torch.tensor(p)
        mask[b, :len(p)] = 1
    assert model.generate(ids, attention_mask=mask, max_new_tokens=8).tokens == model.generate(ps, max_new_tokens=8).tokens


def test_prefill_without_left_padding_reads_each_rows_last_token(mixed):
    model = mixed()
    ps = prompts((6, 3))
    ids, valid = left_pad(ps, 0)
    right = torch.stack([torch.cat([i[v], i[~v]]) for i, v in zip(ids, valid)])
    right_valid = torch.stack([torch.cat([v[v], v[~v]]) for v in valid])
    torch.testing.assert_close(ConceptDecoder(model).prefill(right, right_valid), ConceptDecoder(model).prefill(ids, valid))


def kv_formula(split, tokens, concepts, tail):
    shallow, middle, deep = split
    return shallow * tokens + (middle + deep) * concepts + deep * tail


def test_kv_memory_matches_the_formula_and_the_tail_stays_bounded(mixed):
    model = mixed()
    decoder = ConceptDecoder(model)
    ids, valid = left_pad(prompts((9, 4)), 0)
    logits = decoder.prefill(ids, valid)
    tails = []
    for _ in range(150):
        logits = decoder.step(logits.argmax(-1))
        tails.append(decoder.cache.deep.tail_entries().clone())
        for b, row in enumerate(decoder.kv_stats()):
            keep = decoder.keep[b]
            trailing = len(keep) - 1 - max((i for i, k in enumerate(keep) if k), default=-1)
            assert row["tail"] == trailing
            # the keys the new deep query saw are the ones the FLOP model counts
            assert row["entries"]["deep"] == model.split[2] * int(deep_keys(torch.tensor(keep))[-1])
            assert sum(row["entries"].values()) == kv_formula(model.split, len(keep), sum(keep), trailing)
    tails = torch.stack(tails)  # [steps, B]
    # bounded by max_run, and each row's tail empties at each of its concepts
    assert tails.max() <= MAX_RUN and decoder.max_tail == tails.max() and bool((tails.min(0).values == 0).all())
    for row in decoder.kv_stats():
        expected = kv_formula(model.split, row["tokens"], row["concepts"], row["tail"]) / (sum(model.split) * row["tokens"])
        assert row["bytes"] / row["dense_bytes"] == pytest.approx(expected)
        assert row["bytes"] < 0.8 * row["dense_bytes"]  # ratio ~0.3 on a 2,2,2 split: ~0.55 of dense
    # slots are reused: the deep cache holds concepts + tail, not every token that went through it
    assert decoder.cache.deep.capacity < decoder.cache.shallow.capacity


def test_decoding_every_token_costs_what_one_forward_costs():
    shape = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)
    keep = torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.3
    whole = decode_flops(shape, (2, 3, 1), keep, 33, steps=200)
    one_pass = forward_flops(shape, (2, 3, 1), keep, 33)
    assert whole.to_dict() == pytest.approx(one_pass.to_dict())
    last = decode_flops(shape, (2, 3, 1), keep, 33, steps=50)
    assert last.concepts == int(keep[150:].sum()) and 1 < last.speedup


def test_dense_generation_matches_transformers_generate(tiny_models):
    from concept.dense import DenseModel

    model = tiny_models()
    dense = DenseModel(model.backbone).eval()
    p = prompts((6,))[0]
    ours = dense.generate([p], max_new_tokens=12, output_logits=True)
    with torch.no_grad():
        theirs = model.backbone.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        one_pass = dense(torch.tensor([p + ours.tokens[0]])).logits[0]
    assert ours.tokens[0] == theirs[0, len(p):].tolist()
    torch.testing.assert_close(ours.logits[0], one_pass[len(p) - 1:-1], atol=1e-5, rtol=1e-5)
    assert ours.kv[0]["bytes"] == ours.kv[0]["dense_bytes"]


# -- sampling ------------------------------------------------------------------------------------
def test_seed_reproducibility_and_sampling_settings(mixed):
    model = mixed()
    p = prompts((5,))
    a = model.generate(p, max_new_tokens=12, do_sample=True, temperature=1.5, seed=0)
    b = model.generate(p, max_new_tokens=12, do_sample=True, temperature=1.5, seed=0)
    c = model.generate(p, max_new_tokens=12, do_sample=True, temperature=1.5, seed=1)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    greedy = model.generate(p, max_new_tokens=12)
    assert model.generate(p, max_new_tokens=12, do_sample=True, top_k=1, seed=5).tokens == greedy.tokens
    assert model.generate(p, max_new_tokens=12, do_sample=True, top_p=1e-6, seed=5).tokens == greedy.tokens


def test_repetition_penalty_follows_transformers_and_ignores_padding(mixed):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = mixed()
    ps = prompts((5, 11))
    out = model.generate(ps, max_new_tokens=8, repetition_penalty=1.3, output_logits=True)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    for b, p in enumerate(ps):
        for i, token in enumerate(out.tokens[b]):
            seen = torch.tensor([p + out.tokens[b][:i]])
            assert penalty(seen, out.logits[b, i][None].clone()).argmax().item() == token
        assert model.generate([p], max_new_tokens=8, repetition_penalty=1.3).tokens[0] == out.tokens[b]
    assert out.tokens != model.generate(ps, max_new_tokens=8).tokens  # the penalty changed something


def test_eos_and_stop_strings(mixed):
    model = mixed()
    p = prompts((5,))
    free = model.generate(p, max_new_tokens=10)
    eos = free.tokens[0][3]
    stopped = model.generate(p, max_new_tokens=10, eos_token_id=eos)
    first = free.tokens[0].index(eos)
    assert stopped.tokens[0] == free.tokens[0][:first + 1] and stopped.finish_reasons == ["eos"]
    assert free.finish_reasons == ["length"]

    class Letters:  # id -> one letter
        eos_token_id = pad_token_id = None

        def decode(self, ids, **_):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    tok = Letters()
    text = tok.decode(free.tokens[0])
    stop = text[4:6]
    cut = model.generate(p, max_new_tokens=10, stop_strings=[stop], tokenizer=tok)
    assert cut.finish_reasons == ["stop"] and cut.texts[0] == text[:text.index(stop)]
    assert len(cut.tokens[0]) <= 6


def test_streamer_sees_prompt_then_every_token(mixed):
    model = mixed()
    seen = []

    class Collect:
        def put(self, ids):
            seen.append(ids.tolist())

        def end(self):
            seen.append("end")

    out = model.generate(prompts((4,)), max_new_tokens=5, streamer=Collect())
    assert seen[0] == [prompts((4,))[0]] and seen[-1] == "end"
    assert [s[0] for s in seen[1:-1]] == out.tokens[0]


# -- bad input -----------------------------------------------------------------------------------
def test_bad_generation_input_is_reported_clearly(mixed):
    model = mixed()
    with pytest.raises(ConceptError, match="prompt is empty"):
        model.generate([[]], max_new_tokens=4)
    with pytest.raises(ConfigError) as err:
        model.generate([[1, 2]], max_new_tokens=0, temperature=-1, top_p=0, top_k=-2, repetition_penalty=0)
    assert len(err.value.problems) == 5
    with pytest.raises(ConfigError, match="not a generation setting"):
        model.generate([[1, 2]], max_new_token=3)
    with pytest.raises(ConceptError, match="context limit is 4096"):
        model.generate([[1] * 4096], max_new_tokens=1)
    with pytest.warns(UserWarning, match="context limit"):
        out = model.generate([[1] * 4094], max_new_tokens=5)
    assert len(out.tokens[0]) == 2 and out.finish_reasons == ["context"]


def test_a_policy_whose_steps_disagree_with_its_batched_rule_is_refused(mixed, monkeypatch):
    model = mixed()
    policy = model.length_policy
    monkeypatch.setattr(policy, "track", 0.0)  # the plain rule: a single-tensor state
    # a policy with only the step rule (not a DecidesWithState): prefill replays it
    monkeypatch.setattr(streaming_decoding, "DecidesWithState", type("NoPolicyHasIt", (), {}))
    monkeypatch.setattr(policy, "step", lambda h, logits, run: (torch.zeros_like(run, dtype=torch.bool), run + 1))
    with warnings.catch_warnings(), pytest.raises(ConceptError, match="step-wise decision differs"):
        model.generate(prompts((12,)), max_new_tokens=2)


def test_a_row_that_stops_early_keeps_nothing_of_the_later_steps(mixed):
    model = mixed()
    ps = prompts((7, 2))
    alone = model.generate([ps[1]], max_new_tokens=10)
    eos = alone.tokens[0][1]  # row 1 stops at its second token
    batched = model.generate(ps, max_new_tokens=10, eos_token_id=eos)
    stopped = model.generate([ps[1]], max_new_tokens=10, eos_token_id=eos)
    assert batched.finish_reasons[1] == "eos" and batched.tokens[1] == stopped.tokens[0]
    assert batched.keep[1] == stopped.keep[0]
    assert batched.kv[1]["entries"] == stopped.kv[0]["entries"] and batched.kv[1]["tokens"] == stopped.kv[0]["tokens"]


def test_a_sampled_row_does_not_depend_on_its_batch(mixed):
    model = mixed()
    a, b = prompts((5, 8))
    together = model.generate([a, b], max_new_tokens=8, do_sample=True, seed=4)
    assert together.tokens[0] == model.generate([a], max_new_tokens=8, do_sample=True, seed=4).tokens[0]
    assert together.tokens[1] == model.generate([b], max_new_tokens=8, do_sample=True, seed=5).tokens[0]  # row 1: seed + 1
