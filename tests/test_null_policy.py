"""`null` length policy: vectorised batched decisions equal the step-wise rule used in decoding."""
import pytest
import torch
from torch.utils._pytree import tree_map

from concept.components import BuildContext
from concept_plugins.length_policies.null import NullPolicy, NullPolicyConfig
from tests.conftest import assert_decoding_matches_teacher_forcing

K = 5  # NULL class index


def head_logits(index):
    """Head logits whose decision is ``index`` (NULL = K): the chosen class gets a large logit."""
    return torch.nn.functional.one_hot(index, K + 1).float() * 10.0


def policy(max_run):
    """The rule without the ratio tracker (``track=0``)."""
    ctx = BuildContext(hidden_size=8, vocab_size=10, num_layers=3, split=(1, 1, 1), concept_vocab_size=K)
    return NullPolicy(NullPolicyConfig(max_run=max_run, track=0.0), ctx)


def stepwise(p, index, valid):
    """Obviously correct loop: count NULLs, force a concept when max_run were seen in a row."""
    keep = torch.zeros_like(valid)
    for b in range(index.shape[0]):
        run = 0
        for t in range(index.shape[1]):
            if not valid[b, t]:
                run = 0
                continue
            k = bool(index[b, t] != K) or run >= p.max_run
            keep[b, t] = k
            run = 0 if k else run + 1
    return keep


@pytest.mark.parametrize("max_run", [1, 2, 3, 7])
@pytest.mark.parametrize("null_rate", [0.0, 0.5, 0.9, 1.0])
def test_batched_equals_stepwise_loop(max_run, null_rate):
    g = torch.Generator().manual_seed(max_run * 100 + int(null_rate * 10))
    index = torch.randint(0, K, (4, 40), generator=g)
    index[torch.rand(4, 40, generator=g) < null_rate] = K
    valid = torch.ones(4, 40, dtype=torch.bool)
    valid[1, 30:] = False  # right padding
    valid[2, :6] = False  # left padding
    p = policy(max_run)
    assert torch.equal(p.decide(None, head_logits(index), valid), stepwise(p, index, valid))


@pytest.mark.parametrize("max_run", [1, 3])
def test_step_api_equals_batched(max_run):
    g = torch.Generator().manual_seed(1)
    index = torch.randint(0, K + 1, (3, 30), generator=g)
    index[:, 5:20] = K  # a long NULL run
    p = policy(max_run)
    batched = p.decide(None, head_logits(index), torch.ones_like(index, dtype=torch.bool))
    state = p.init_state(3, index.device)
    steps = []
    for t in range(index.shape[1]):
        k, state = p.step(None, head_logits(index[:, t]), state)
        steps.append(k)
    assert torch.equal(torch.stack(steps, 1), batched)


def test_max_run_bounds_the_tail():
    p = policy(3)
    index = torch.full((1, 50), K)  # the head says NULL everywhere
    keep = p.decide(None, head_logits(index), torch.ones(1, 50, dtype=torch.bool))
    assert keep.sum() == 50 // 4
    runs, run = [], 0
    for k in keep[0].tolist():
        run = 0 if k else run + 1
        runs.append(run)
    assert max(runs) == 3


def test_document_starts_reset_the_run():
    """Packed documents: the NULL run restarts at each document, as if each were alone."""
    p = policy(2)
    index = torch.full((1, 12), K)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]])
    starts = torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    keep = p.decide(None, head_logits(index), torch.ones(1, 12, dtype=torch.bool), reset=starts)
    alone = [p.decide(None, head_logits(index[:, doc[0] == d]), torch.ones(1, int((doc[0] == d).sum()), dtype=torch.bool))
             for d in range(3)]
    assert torch.equal(keep, torch.cat(alone, dim=1))


def test_null_bias_moves_the_ratio():
    p = policy(100)
    logits = torch.randn(2, 200, K + 1, generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 200, dtype=torch.bool)
    rates = []
    for bias in (-3.0, 0.0, 3.0):
        p.null_bias.fill_(bias)
        rates.append(p.decide(None, logits, valid).float().mean().item())
    assert rates[0] > rates[1] > rates[2]
    probs = p.boundary_prob(logits)
    assert torch.all((probs >= 0.5) == p.decide(None, logits, valid))


def test_invalid_config():
    assert NullPolicyConfig(max_run=0).validate()


def test_invalid_track():
    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        assert any("track" in p for p in NullPolicyConfig(track=bad).validate())
    assert NullPolicyConfig(track=0).validate() == [] and NullPolicyConfig(track=2.5).validate() == []


# -- the ratio tracker ----------------------------------------------------------------------------
def tracked(max_run=16, track=0.5, target=0.25):
    ctx = BuildContext(hidden_size=8, vocab_size=10, num_layers=3, split=(1, 1, 1), concept_vocab_size=K)
    p = NullPolicy(NullPolicyConfig(max_run=max_run, track=track), ctx)
    p.target_ratio.fill_(target)
    return p


def tracker_loop(p, logit, valid, reset=None):
    """Obviously correct per-document loop of the tracker rule, in Python floats."""
    keep = torch.zeros_like(valid)
    r = float(p.target_ratio)
    for b in range(logit.shape[0]):
        run = tokens = concepts = 0
        for t in range(logit.shape[1]):
            if reset is not None and reset[b, t]:
                run = tokens = concepts = 0
            if not valid[b, t]:
                continue
            k = float(logit[b, t]) + p.track * (tokens - concepts / r) >= 0 or run >= p.max_run
            keep[b, t] = k
            run, tokens, concepts = (0 if k else run + 1), tokens + 1, concepts + int(k)
    return keep


def logits_with_keep_logit(keep_logit):
    """Head logits [.., K+1] whose keep logit is ``keep_logit`` (one concept class, NULL at 0)."""
    out = torch.full((*keep_logit.shape, K + 1), -1e4)
    out[..., 0] = keep_logit
    out[..., K] = 0.0
    return out


def stepped(p, logits, valid, reset=None):
    """The step API over t, with the decoder's rules (padding keeps the state, a start resets it)."""
    B, T = valid.shape
    state, steps = p.init_state(B, "cpu"), []
    for t in range(T):
        if reset is not None:
            fresh = p.init_state(B, "cpu")
            state = tree_map(lambda f, s: torch.where(reset[:, t], f, s), fresh, state)
        k, new = p.step(None, logits[:, t], state)
        steps.append(k & valid[:, t])
        state = tree_map(lambda n, s: torch.where(valid[:, t], n, s), new, state)
    return torch.stack(steps, 1), state


def padded_documents(B=4, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 35:] = False  # right padding
    valid[2, :7] = False  # left padding
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, [0, 11, 30]] = True  # packed documents
    reset[2, [7, 20]] = True
    reset[3, 0] = True
    return valid, reset, g


@pytest.mark.parametrize("track", [0.0, 0.3, 1.0, 4.0])
@pytest.mark.parametrize("max_run", [2, 5, 16])
@pytest.mark.parametrize("shift", [-3.0, 0.0, 2.0])
def test_tracker_batched_equals_loop_and_step_api(track, max_run, shift):
    valid, reset, g = padded_documents(seed=max_run)
    keep_logit = torch.randn(valid.shape, generator=g) * 2.0 + shift
    p = tracked(max_run, track, target=0.3)
    logits = logits_with_keep_logit(keep_logit)
    expect = tracker_loop(p, p.keep_logit(logits), valid, reset)
    assert torch.equal(p.decide(None, logits, valid, reset), expect)
    steps, step_state = stepped(p, logits, valid, reset)
    assert torch.equal(steps, expect)
    keep, state = p.decide_with_state(None, logits, valid, reset)
    assert torch.equal(keep, expect)
    pairs = zip(state, step_state) if track else [(state, step_state)]  # the tracker's state is a tuple
    for a, b in pairs:
        assert torch.equal(a, b)  # the final state too (what a prefill hands to decoding)


def test_track_zero_keeps_the_vectorised_rule_and_its_step_state():
    valid, reset, g = padded_documents(seed=3)
    index = torch.randint(0, K, valid.shape, generator=g)
    index[torch.rand(valid.shape, generator=g) < 0.7] = K
    p = tracked(3, 0.0)
    assert p.init_state(2, "cpu").shape == (2,)  # as before the tracker
    assert torch.equal(p.decide(None, head_logits(index), valid), stepwise(p, index, valid))
    keep, run = p.decide_with_state(None, head_logits(index), valid)
    assert torch.equal(keep, stepwise(p, index, valid))
    assert torch.equal(run, stepped(p, head_logits(index), valid)[1])  # the NULL run, without replaying the prompt
    q = tracked(3, 0.5)
    assert isinstance(q.decide_with_state(None, head_logits(index), valid)[1], tuple)
    q.track = 0.0  # switching the tracker off gives back the original policy
    assert torch.equal(q.decide(None, head_logits(index), valid), p.decide(None, head_logits(index), valid))
    assert torch.equal(q.decide_with_state(None, head_logits(index), valid)[1], run)


def test_tracker_forces_after_max_run_and_catches_up():
    """A head that says NULL everywhere: max_run still bounds the tail, and the lag makes
    the document emit at the target ratio even when max_run alone would give fewer."""
    p = tracked(max_run=7, track=1.0, target=0.25)
    logits = logits_with_keep_logit(torch.full((1, 400), -1.5))
    keep = p.decide(None, logits, torch.ones(1, 400, dtype=torch.bool))
    assert keep.float().mean() == pytest.approx(0.25, abs=0.01)
    untracked = tracked(max_run=7, track=0.0).decide(None, logits, torch.ones(1, 400, dtype=torch.bool))
    assert untracked.float().mean() == pytest.approx(1 / 8, abs=0.01)  # forced only
    huge = tracked(max_run=3, track=1.0).decide(None, logits_with_keep_logit(torch.full((1, 40), -1e6)),
                                               torch.ones(1, 40, dtype=torch.bool))
    assert keep.any() and huge.sum() == 10  # forced every 4th token, the lag cannot beat -1e6


@pytest.mark.parametrize("target", [0.5, 0.25, 0.125])
def test_tracker_lag_is_counted_in_tokens(target):
    """``track`` is per token of lag: a keep logit of -2 everywhere with track 0.5 waits until the
    document is 4 tokens behind its schedule, at every target; then one concept every 1 / target
    tokens (so the ratio error of a shifted domain, s / (track * N), does not grow as the target falls)."""
    p = tracked(max_run=1000, track=0.5, target=target)
    keep = p.decide(None, logits_with_keep_logit(torch.full((1, 64), -2.0)), torch.ones(1, 64, dtype=torch.bool))
    every = round(1 / target)
    assert keep[0].nonzero().flatten().tolist() == list(range(4, 64, every))


def test_tracker_resets_at_document_starts():
    """Packed documents decide as if each were alone (the lag restarts at 0)."""
    p = tracked(max_run=16, track=0.7)
    g = torch.Generator().manual_seed(5)
    lengths = [13, 30, 21]
    keep_logit = torch.randn(1, sum(lengths), generator=g) - 1.5
    starts = torch.zeros(1, sum(lengths), dtype=torch.bool)
    starts[0, [0, 13, 43]] = True
    valid = torch.ones_like(starts)
    packed = p.decide(None, logits_with_keep_logit(keep_logit), valid, reset=starts)
    alone = [p.decide(None, logits_with_keep_logit(x), torch.ones_like(x, dtype=torch.bool))
             for x in keep_logit.split(lengths, dim=1)]
    assert torch.equal(packed, torch.cat(alone, dim=1))


def test_tracker_holds_the_ratio_under_a_domain_shift():
    """Calibrated on one keep-logit distribution, evaluated on a shifted one (fewer natural
    boundaries, as prose is for a head trained on code): the tracker keeps the ratio near target."""
    from concept.streaming.ratio import PIController

    g = torch.Generator().manual_seed(0)
    valid = torch.ones(16, 256, dtype=torch.bool)
    home = torch.randn(16, 256, generator=g) * 2.0
    away = torch.randn(16, 256, generator=g) * 2.0 - 1.5
    ratios = {}
    for track in (0.0, 0.5):
        p = tracked(max_run=16, track=track, target=0.25)
        reached = PIController(0.25).calibrate_exact(p, logits_with_keep_logit(home), valid)
        assert reached == pytest.approx(0.25, abs=0.005)  # the bisection still works with the tracker
        ratios[track] = float(p.decide(None, logits_with_keep_logit(away), valid).float().mean())
    assert ratios[0.0] < 0.2  # the untracked ratio drifts
    assert ratios[0.5] == pytest.approx(0.25, rel=0.05)


def test_target_ratio_is_saved_and_old_weights_still_load():
    p = tracked(track=1.0, target=0.4)
    q = tracked(track=1.0, target=0.25)
    q.load_state_dict(p.state_dict())
    assert float(q.target_ratio) == pytest.approx(0.4)
    old = {k: v for k, v in p.state_dict().items() if k != "target_ratio"}  # saved before the tracker
    q.load_state_dict(old)  # loads, and decides as it was trained: without the tracker
    assert float(q.target_ratio) == pytest.approx(0.4) and q.track == 0
    assert isinstance(q.init_state(2, "cpu"), torch.Tensor)
    assert NullPolicyConfig().track == 0.25  # the measured default


# -- the tracker in a model: one pass = naive reference, decoding = teacher forcing ----------------
@pytest.fixture(scope="module")
def tracked_model():
    import concept
    from tests.conftest import mix_decisions, randomize_new_modules, tiny_config

    cfg = tiny_config(policy=("null", {"max_run": 3, "track": 1.5}))
    model = mix_decisions(randomize_new_modules(concept.build(cfg))).eval()
    model.length_policy.target_ratio.fill_(0.4)
    return model


def test_tracked_model_batched_stepwise_and_decoding_agree(tracked_model):
    from tests.reference import reference_logits

    model = tracked_model
    x = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(4))
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[0, :5] = False  # left padding
    doc = torch.zeros_like(x)
    doc[1, 7:] = 1
    doc[1, 15:] = 2  # three packed documents in row 1
    with torch.no_grad():
        out = model(x, attention_mask=valid.long(), document_ids=doc)
        from concept.packing import document_starts

        reset = document_starts(valid, doc)
        steps, _ = stepped(model.length_policy, out.head_logits, valid, reset)
        assert torch.equal(out.keep, steps)
        real = torch.ones(3, 14, dtype=torch.long)
        real[1, 10:] = 0
        real[2, :3] = 0
        out = model(x[:, :14], attention_mask=real)
        ref, _ = reference_logits(model, x[:, :14], attention_mask=real, keep=out.keep)
    decisions = out.keep[real.bool()]
    assert 0 < int(decisions.sum()) < len(decisions)
    torch.testing.assert_close(out.logits[real.bool()], ref[real.bool()], atol=1e-5, rtol=0)

    prompts = [x[0, :9].tolist(), x[2, :4].tolist()]
    assert_decoding_matches_teacher_forcing(model, prompts, 16)
