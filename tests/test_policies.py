"""Every length policy, sampler and position scheme, interchangeable: the one-pass forward equals
the naive per-t reference, decoding equals teacher forcing, and batched decisions equal
step-wise ones (docs/policies.md)."""
import pytest
import torch

import concept
from concept import ComponentRef
from concept.errors import ConfigError
from tests.conftest import POLICIES, assert_decoding_matches_teacher_forcing, mixed_model as make, tiny_config
from tests.reference import reference_logits

BACKENDS = ["sdpa", "chunked"]  # with gradients
FORWARD_BACKENDS = [*BACKENDS, "flex"]  # FlexAttention has no backward on CPU
SCHEMES = ["time", "per-type", "compact"]


def ids(B=3, T=14, seed=0):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", SCHEMES)
def test_one_pass_matches_naive(policy, backend, positions):
    model = make(policy, backend, positions)
    x = ids()
    mask = torch.ones_like(x)
    mask[1, 10:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    with torch.no_grad():
        out = model(x, attention_mask=mask)
        ref, _ = reference_logits(model, x, attention_mask=mask, keep=out.keep)
    real = mask.bool()
    decisions = out.keep[real]
    assert 0 < int(decisions.sum()) < len(decisions)
    torch.testing.assert_close(out.logits[real], ref[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", SCHEMES)
def test_decoding_matches_teacher_forcing(policy, backend, positions):
    model = make(policy, backend, positions)
    prompts = [ids(1, 9, seed=2)[0].tolist(), ids(1, 4, seed=3)[0].tolist()]
    assert_decoding_matches_teacher_forcing(model, prompts, 12)


@pytest.mark.parametrize("policy", POLICIES)
def test_batched_and_stepwise_decisions_agree_with_padding_and_documents(policy):
    model = make(policy)
    x = ids(3, 20, seed=4)
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[0, :5] = False  # left padding
    reset = torch.zeros_like(valid)
    reset[1, [0, 7, 15]] = True  # three packed documents in row 1
    reset[0, 5] = reset[2, 0] = True
    with torch.no_grad():
        h = model.shallow_states(x, valid, torch.cumsum(reset.long(), 1))
        head_logits = model.vocabulary.logits(h)
        batched = model.length_policy.decide(h, head_logits, valid, reset)
        state = model.length_policy.init_state(3, "cpu")
        steps = []
        for t in range(x.shape[1]):
            fresh = model.length_policy.init_state(3, "cpu")
            state = torch.utils._pytree.tree_map(lambda f, s: torch.where(reset[:, t], f, s), fresh, state)
            k, new = model.length_policy.step(h[:, t], head_logits[:, t], state)
            steps.append(k & valid[:, t])
            state = torch.utils._pytree.tree_map(lambda n, s: torch.where(valid[:, t], n, s), new, state)
        keep, final = model.length_policy.decide_with_state(h, head_logits, valid, reset)
    assert torch.equal(batched, torch.stack(steps, 1))
    # every built-in policy gives a prefill its final step state without replaying the prompt,
    # and it is the step loop's, leaf for leaf
    assert torch.equal(keep, batched)
    leaves = torch.utils._pytree.tree_leaves
    assert len(leaves(final)) == len(leaves(state))
    same = lambda a, b: torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, atol=1e-6)  # noqa: E731
    assert all(same(a, b) for a, b in zip(leaves(final), leaves(state)))  # float leaves: the score's matmul
    # negative control: the state one token earlier (the last token not counted) is told apart
    early = model.length_policy.decide_with_state(h[:, :-1], head_logits[:, :-1], valid[:, :-1], reset[:, :-1])[1]
    assert not all(same(a, b) for a, b in zip(leaves(early), leaves(state)))


def test_tail_is_bounded_by_each_policy():
    for policy, bound in (("null", 3), ("threshold", 3), ("fixed", 2), ("entropy", 3), ("mtp", 3)):
        model = make(policy)
        keep = model(ids(4, 64, seed=7)).keep
        longest = 0
        for row in keep.tolist():
            run = 0
            for k in row:
                run = 0 if k else run + 1
                longest = max(longest, run)
        assert longest <= bound, policy


def test_fixed_policy_emits_every_n_tokens_per_document():
    model = make("fixed")
    x = ids(1, 12)
    reset = torch.zeros(1, 12, dtype=torch.bool)
    reset[0, [0, 5]] = True
    keep = model.length_policy.decide(None, None, torch.ones_like(reset), reset)
    assert keep[0].tolist() == [False, False, True, False, False] + [False, False, True, False, False, True, False]
    out = model(x, document_ids=torch.cumsum(reset.long(), 1))
    assert torch.equal(out.keep, keep)


# -- samplers -------------------------------------------------------------------------------------
SAMPLERS = {"soft": ("soft", "soft"), "hidden-projection": ("hidden-projection", "argmax")}


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_samplers_match_naive_in_eval_and_training(name, backend):
    from concept.losses import next_token_loss

    train_s, eval_s = SAMPLERS[name]
    model = make("null", backend, "per-type", sampler=ComponentRef(train_s), eval_sampler=ComponentRef(eval_s))
    x = ids()
    with torch.no_grad():
        out = model(x)
        ref, _ = reference_logits(model, x, keep=out.keep)
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    model.train()
    try:
        grads = []
        for fn in (lambda: model(x, keep=out.keep).logits, lambda: reference_logits(model, x, keep=out.keep)[0]):
            model.zero_grad(set_to_none=True)
            next_token_loss(fn(), x, torch.ones_like(x, dtype=torch.bool)).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        model.eval()
    assert set(grads[0]) == set(grads[1])
    assert any(n.startswith("vocabulary.table") for n in grads[0])
    if name == "hidden-projection":
        assert {"sampler.proj.weight", "sampler.gate", "sampler.scale"} <= set(grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4, msg=n)


def test_hidden_projection_starts_near_the_plain_embedding():
    model = concept.build(tiny_config(sampler=ComponentRef("hidden-projection", {"gate_init": 0.99, "lr": 5e-4})))
    sampler = model.sampler
    e = model.vocabulary.embed_hard(torch.arange(8))
    h = torch.randn(8, 64)
    mixed = sampler.mix(e, h)
    cos = torch.nn.functional.cosine_similarity(mixed, e, dim=-1)
    assert torch.all(cos > 0.95)
    assert sampler.scale.item() == pytest.approx(float(model.backbone.get_input_embeddings().weight.norm(dim=-1).mean()))
    assert sampler.learning_rate == 5e-4


def test_compact_positions_number_concepts_in_the_middle_stack_only():
    model = make("fixed", positions="compact")
    pos, rank = torch.tensor([[2, 5, 8]]), torch.tensor([[0, 1, 2]])
    assert model.positions.concept_positions(pos, rank, "middle").tolist() == [[0, 1, 2]]
    assert model.positions.concept_positions(pos, rank, "deep").tolist() == [[2, 5, 8]]


# -- threshold: the straight-through path ----------------------------------------------------------
def test_threshold_gate_passes_lm_gradients_to_the_score_and_leaves_the_forward_unchanged():
    from concept.losses import next_token_loss

    model = make("threshold", "chunked")
    x = ids()
    model.train()
    try:
        torch.manual_seed(0)
        out = model(x)
        torch.manual_seed(0)
        with torch.no_grad():
            plain = model(x)  # no grad: no gate
        torch.testing.assert_close(out.logits, plain.logits, atol=0, rtol=0)
        model.zero_grad(set_to_none=True)
        next_token_loss(out.logits, x, torch.ones_like(x, dtype=torch.bool)).backward()
    finally:
        model.eval()
    grad = model.length_policy.score.weight.grad
    assert grad is not None and grad.abs().sum() > 0


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, options, messages", [
    ("threshold", {"threshold": 0}, ["threshold: must be > 0"]),
    ("fixed", {"every": 0}, ["every: must be >= 1"]),
    ("entropy", {"tau": 1.0, "min_chunk": 5, "max_chunk": 3}, ["tau: must be in (0, 1)", "min_chunk (5) must be <= max_chunk (3)"]),
    ("entropy", {"tau": 0}, ["tau: must be in (0, 1)"]),
])
def test_out_of_range_policy_parameters_are_rejected_at_build_time(policy, options, messages):
    with pytest.raises(ConfigError) as err:
        concept.build(tiny_config(policy=(policy, options)))
    for m in messages:
        assert any(m in p for p in err.value.problems), (m, err.value.problems)


def test_cli_builds_every_policy_and_scheme(tmp_path):
    from click.testing import CliRunner

    from concept_cli.main import cli

    tiny = ["--backbone", "tiny-llama", "--set", "backbone.layers=4", "--set", "backbone.hidden=32", "--set",
            "backbone.heads=2", "--set", "backbone.kv_heads=1", "--split", "1,2,1", "--dry-run", "--json"]
    for args in (["--length-policy", "threshold", "--set", "length_policy.threshold=1.5"],
                 ["--length-policy", "fixed", "--set", "length_policy.every=8"],
                 ["--length-policy", "entropy", "--set", "length_policy.tau=0.9", "--set", "length_policy.max_chunk=16"],
                 ["--rope", "compact"], ["--sampler", "soft", "--eval-sampler", "soft"], ["--sampler", "hidden-projection"]):
        r = CliRunner().invoke(cli, ["build", *tiny, *args])
        assert r.exit_code == 0, (args, r.output)
    r = CliRunner().invoke(cli, ["build", *tiny, "--length-policy", "fixed", "--set", "length_policy.every=0"])
    assert r.exit_code == 2 and "every: must be >= 1" in r.output


# -- training with each component --------------------------------------------------------------
TRAIN_CASES = {
    "threshold": dict(length_policy=ComponentRef("threshold", {"max_run": 8})),
    "fixed": dict(length_policy=ComponentRef("fixed", {"every": 4})),
    "entropy": dict(length_policy=ComponentRef("entropy", {"tau": 0.05, "max_chunk": 8})),
    "mtp": dict(length_policy=ComponentRef("mtp", {"heads": 2, "max_chunk": 8, "lr": 2e-3})),
    "soft": dict(sampler=ComponentRef("soft"), eval_sampler=ComponentRef("soft")),
    "hidden-projection": dict(sampler=ComponentRef("hidden-projection", {"lr": 3e-3})),
    "codebook": dict(vocabulary=ComponentRef("codebook", {"size": 32, "code_dim": 8}), position_scheme=ComponentRef("compact")),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_every_component_trains_saves_loads_and_generates(case, tmp_path):
    from concept.training import TrainConfig, Trainer
    from tests.test_training import STDLIB

    corpus = tmp_path / "code.txt"
    corpus.write_text("\n\n".join((STDLIB / n).read_text() for n in ("textwrap.py", "shlex.py")))
    cfg = concept.BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                                  "intermediate": 64}),
                              split="1,2,1", attention=ComponentRef("chunked", {"chunk": 16}),
                              **{"vocabulary": ComponentRef("embedding", {"size": 32}), **TRAIN_CASES[case]})
    concept.save(concept.build(cfg), tmp_path / "m")
    train = TrainConfig(steps=4, seq_len=32, batch=2, eval_every=4, eval_batches=1, checkpoint_every=4, log_every=2,
                        warmup=1, data=str(corpus), usage_weight=0.1 if case == "codebook" else 0.0,
                        lora=concept.lora.LoraSettings(rank=2))
    trainer = Trainer.start(tmp_path / "m", tmp_path / "run", train)
    before = {k: v.clone() for k, v in trainer.model.new_state_dict().items()}
    trainer.train()
    after = trainer.model.new_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the new modules learned something
    if case in ("fixed", "entropy"):
        assert any("sets its ratio by its own parameters" in n for n in trainer.notes)
    if case == "hidden-projection":
        group = next(g for g in trainer.optimizer.param_groups if g["name"] == "sampler")
        assert group["initial_lr"] == 3e-3
    rows = [__import__("json").loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    if case == "codebook":
        assert "usage_kl" in rows[-1]
    if case == "mtp":  # the heads train by self-distillation (named in metrics), at their own learning rate
        assert all("mtp" in r for r in rows if "loss" in r)
        group = next(g for g in trainer.optimizer.param_groups if g["name"] == "length_policy")
        assert group["initial_lr"] == 2e-3
        assert not torch.equal(before["length_policy.heads.blocks.1.weight"], after["length_policy.heads.blocks.1.weight"])
    model = concept.load(tmp_path / "run")
    torch.testing.assert_close(model.new_state_dict(), after)
    out = model.generate([[5, 6, 7, 8]], max_new_tokens=6, output_logits=True)
    assert len(out.tokens[0]) == 6


def test_codebook_gradients_reach_the_codebook_from_the_head_and_from_the_input():
    model = make("null", "chunked", "time", vocabulary=ComponentRef("codebook", {"size": 32, "code_dim": 8}))
    x = ids()
    out = model(x)
    head_only = torch.nn.functional.cross_entropy(out.head_logits[..., :32].flatten(0, 1), torch.zeros(x.numel(), dtype=torch.long))
    model.zero_grad(set_to_none=True)
    head_only.backward()
    assert model.vocabulary.codebook.grad.abs().sum() > 0  # the head's CE reaches the codebook (dot-product logits)
    emb = model.vocabulary.embed_hard(torch.tensor([3]))
    model.zero_grad(set_to_none=True)
    emb.sum().backward()
    assert model.vocabulary.codebook.grad[3].abs().sum() > 0 and model.vocabulary.codebook.grad[4].abs().sum() == 0


def test_usage_kl_is_zero_for_uniform_use_and_log_k_for_collapse():
    from concept.objectives import usage_kl

    keep = torch.ones(1, 4, dtype=torch.bool)
    uniform = torch.log(torch.eye(4))[None] * 1.0  # each token certain of a different concept
    assert usage_kl(uniform.nan_to_num(neginf=-1e4), keep).item() == pytest.approx(0.0, abs=1e-5)
    collapsed = torch.tensor([[[10.0, -1e4, -1e4, -1e4]] * 4])
    assert usage_kl(collapsed, keep).item() == pytest.approx(torch.log(torch.tensor(4.0)).item(), abs=1e-4)


def test_combinations_a_component_cannot_support_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="use --eval-sampler soft"):
        concept.resolve(tiny_config(sampler=ComponentRef("soft")))
    with pytest.raises(ConfigError, match="as --eval-sampler it has nothing to add"):
        concept.resolve(tiny_config(eval_sampler=ComponentRef("hidden-projection")))


def test_fixed_with_several_concepts_holds_the_kv_of_the_formula():
    model = make("fixed-emit2")
    gen = model.generate([ids(1, 7)[0].tolist()], max_new_tokens=20)
    kv = gen.kv[0]
    keep = gen.keep[0]
    Ls, Lm, Ld = model.split
    tail = len(keep) - 1 - max(i for i, k in enumerate(keep) if k)
    assert kv["concepts"] == 2 * sum(keep) and kv["tail"] == tail
    assert kv["entries"] == {"shallow": Ls * len(keep), "middle": Lm * kv["concepts"], "deep": Ld * (kv["concepts"] + tail)}


def test_fixed_policy_refuses_more_concepts_than_chunk_tokens():
    with pytest.raises(ConfigError, match=r"emit \(4\) must be <= every \(3\)"):
        concept.resolve(tiny_config(policy=("fixed", {"every": 3, "emit": 4})))


@pytest.mark.parametrize("backend", BACKENDS)
def test_codebook_vocabulary_matches_naive_and_decodes_exactly(backend):
    model = make("threshold", backend, "per-type", vocabulary=ComponentRef("codebook", {"size": 32, "code_dim": 8}))
    x = ids()
    with torch.no_grad():
        out = model(x)
        ref, _ = reference_logits(model, x, keep=out.keep)
    assert 0 < int(out.keep.sum()) < out.keep.numel()
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    p = x[0, :6].tolist()
    gen = model.generate([p], max_new_tokens=10, output_logits=True)
    with torch.no_grad():
        forced = model(torch.tensor([p + gen.tokens[0]]), keep=torch.tensor([gen.keep[0] + [False]])).logits[0]
    torch.testing.assert_close(gen.logits[0], forced[len(p) - 1:-1], atol=1e-5, rtol=1e-5)


def test_threshold_controller_aims_at_the_mean_score_and_reports_unreachable_targets():
    from concept.streaming.ratio import PIController

    model = make("threshold")
    policy = model.length_policy
    x = ids(4, 64, seed=11)
    valid = torch.ones_like(x, dtype=torch.bool)
    with torch.no_grad():
        out = model(x)
        bias = policy.bias_for_ratio(out.head_logits, out.shallow, valid, 0.25)
        saved = policy.null_bias.clone()
        policy.null_bias.fill_(bias)
        mean_score = policy.boundary_prob(out.head_logits, out.shallow).mean().item()
        policy.null_bias.copy_(saved)
    assert mean_score == pytest.approx(0.25 * policy.threshold, abs=1e-3)
    reached = PIController(0.25).calibrate_exact(policy, out.head_logits, valid, h=out.shallow)
    assert reached == pytest.approx(0.25, abs=0.02)
    policy.null_bias.copy_(saved)
    far = concept.build(tiny_config(policy=("threshold", {"max_run": 3})))  # a concept every 4th token at least
    with torch.no_grad():
        out = far(x)
    reached = PIController(0.1).calibrate_exact(far.length_policy, out.head_logits, valid, h=out.shallow)
    assert reached >= 0.25  # 0.1 is out of reach: the bisection ends at the nearest bound


def test_controls_perturb_mixture_inputs_too():
    """The controls replace the concepts' whole inputs, so they are defined for mixtures as well."""
    from concept.diagnostics import evaluate

    model = make("null", "sdpa", "per-type", sampler=ComponentRef("soft"), eval_sampler=ComponentRef("soft"))
    x = ids(2, 16)
    result = evaluate(model, [{"input_ids": x, "attention_mask": torch.ones_like(x)}])
    assert result["delta_nll_shuffle"] != 0 and result["delta_nll_random"] != 0
    emit2 = make("fixed-emit2")
    result = evaluate(emit2, [{"input_ids": x, "attention_mask": torch.ones_like(x)}])
    assert result["delta_nll_random"] != 0 and result["ratio"] == pytest.approx(2 * 5 / 16)


def test_flex_refuses_training_on_cpu_with_the_reason(tmp_path):
    from concept.training import TrainConfig, Trainer
    from concept_plugins.attention.flex import FlexBackend

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = make("null", "flex")
    model.train()
    try:
        with pytest.raises(concept.ConceptError, match="no backward pass on CPU"):
            model(ids()).logits.sum()
    finally:
        model.eval()
    assert "forward only" in FlexBackend.unavailable_reason()
    concept.save(concept.build(tiny_config(attention="flex")), tmp_path / "m")
    with pytest.raises(ConfigError, match="attention 'flex' cannot train on cpu"):
        Trainer.start(tmp_path / "m", tmp_path / "run", TrainConfig(steps=1, device="cpu"))
    assert not (tmp_path / "run").exists()


def test_auto_attention_chooses_per_device_and_records_the_choice(tmp_path):
    from concept.training import TrainConfig, Trainer
    from concept_plugins.attention.auto import AutoBackend
    from tests.test_training import STDLIB

    assert AutoBackend.choice("cpu") == "chunked" and AutoBackend.choice("cuda") == "flex"
    corpus = tmp_path / "code.txt"
    corpus.write_text((STDLIB / "textwrap.py").read_text())
    cfg = concept.BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                                  "intermediate": 64}),
                              split="1,2,1", attention=ComponentRef("auto"), vocabulary=ComponentRef("embedding", {"size": 32}))
    concept.save(concept.build(cfg), tmp_path / "m")
    trainer = Trainer.start(tmp_path / "m", tmp_path / "run", TrainConfig(steps=1, seq_len=32, batch=2, eval_every=1,
                                                                          eval_batches=1, data=str(corpus), device="cpu"))
    trainer.train()
    record = __import__("json").loads((tmp_path / "run" / "train.json").read_text())
    assert record["attention_resolved"] == "chunked"
    assert Trainer.resume(tmp_path / "run").attention == "chunked"  # the record does not break --resume


@pytest.mark.slow
def test_compiled_flex_matches_chunked_on_cpu():
    """The compiled FlexAttention path (what `flex` runs by default), forward only on CPU (~20 s of compiling)."""
    chunked = make("null", "chunked")
    cfg = tiny_config(attention="flex", policy=POLICIES["null"])
    cfg.attention = ComponentRef("flex", {"compile": True})
    flex = concept.build(cfg)
    flex.load_state_dict(chunked.state_dict())
    flex.eval()
    x = ids(2, 300)
    with torch.no_grad():
        a = chunked(x)
        b = flex(x, keep=a.keep)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)
