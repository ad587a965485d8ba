"""The `fsq` vocabulary (finite scalar quantization, docs/policies.md): argmax of its logits = FSQ's per-dimension
rounding, ids <-> digits; one pass = the naive per-step loop (one level and residual multi-level codes), decoding =
teacher forcing (streaming and planner-executor), gradients reach the projections, a few training steps, bad
configs. Negative controls: a digit order swapped in the input table and a rounding off by half a step are caught."""
import itertools
import json
import math

import pytest
import torch

import concept
from concept import ComponentRef
from concept.components import rms_normalize
from concept.errors import ConfigError
from concept.planner.model import Plan
from tests import reference
from tests.conftest import (
    assert_decoding_matches_teacher_forcing,
    mix_decisions,
    randomize_new_modules,
    tiny_config,
)
from tests.test_equivalence import (
    _new_module_grads,
    assert_gradients_match_naive,
    assert_padded_batch_matches_naive,
    padded_batch,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DIMS = [4, 3, 2]  # K = 24: uneven level counts, so a swapped digit order changes the codes
K = math.prod(DIMS)


# -- the definition, written out here (never through the module's methods) -------------------------------
def every_code(dims):
    """[K, d] the digits of ids 0..K-1: mixed radix, dimension 0 the most significant."""
    return torch.tensor(list(itertools.product(*(range(n) for n in dims))))


def grid_values(digits, dims):
    """FSQ's bounded levels: digit j of a dimension of n levels is -1 + 2 j / (n - 1)."""
    return torch.stack([-1 + 2 * digits[..., i].double() / (n - 1) for i, n in enumerate(dims)], -1)


def rounded_ids(vocab, h):
    """FSQ's quantiser by hand: z = tanh(W rms_norm(h)), rounded per dimension to the nearest level, as an id."""
    dims = list(vocab.levels_per_dim)
    z = torch.tanh(rms_normalize(h.double()) @ vocab.proj_down.weight.double().T)
    digits = torch.stack([torch.round((z[..., i] + 1) * (n - 1) / 2).clamp(0, n - 1) for i, n in enumerate(dims)], -1)
    strides = torch.tensor([math.prod(dims[i + 1:]) for i in range(len(dims))])
    return (digits.long() * strides).sum(-1), z


def fsq(**params):
    return ComponentRef("fsq", {"levels_per_dim": DIMS, **params})


def spread(model):
    """randomize_new_modules saturates tanh (z at the corners): scale proj_down so z spreads over the grid."""
    vocabs = getattr(model, "vocabularies", None) or [model.vocabulary]
    with torch.no_grad():
        for v in vocabs:
            v.proj_down.weight.mul_(0.12)
    return model


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(attention="chunked", positions="time", **params):
        key = (attention, positions, tuple(sorted((k, str(v)) for k, v in params.items())))
        if key not in cache:
            torch.manual_seed(0)
            cfg = tiny_config(attention=attention, positions=positions, vocabulary=fsq(**params))
            cache[key] = mix_decisions(spread(randomize_new_modules(concept.build(cfg)))).eval()
        return cache[key]

    return get


# -- the quantiser --------------------------------------------------------------------------------
def test_argmax_of_the_logits_is_fsq_rounding(models):
    vocab = models().vocabulary
    assert vocab.size == K and vocab.table.shape == (K, 3)
    h = torch.randn(4, 200, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = vocab.logits(h)
        expected, z = rounded_ids(vocab, h)
    assert logits.shape[-1] == K + 1  # the codes, then NULL
    assert torch.equal(logits[..., :K].argmax(-1), expected)
    assert torch.equal(vocab.quantize(vocab.bounded(h)), expected)
    assert len(expected.unique()) > K // 2  # the states really spread over the grid
    # per-dimension log-probabilities: the codes' logsumexp is 0, so P(NULL) is the NULL logit's alone
    torch.testing.assert_close(logits[..., :K].logsumexp(-1), torch.zeros(4, 200), atol=1e-5, rtol=0)
    # the softmax over the codes is that of the plain -sum_i (distance in grid steps)^2 / temperature
    digits = every_code(DIMS)
    steps = torch.stack([(z[..., i, None] + 1) * (n - 1) / 2 - digits[:, i] for i, n in enumerate(DIMS)], -1)
    plain = -(steps ** 2).sum(-1) / vocab.config.temperature
    torch.testing.assert_close(logits[..., :K].double().softmax(-1), plain.softmax(-1), atol=1e-5, rtol=0)


def test_negative_control_a_rounding_off_by_half_a_step_is_caught(models, monkeypatch):
    vocab = models().vocabulary
    h = torch.randn(4, 200, 64, generator=torch.Generator().manual_seed(1))
    bounded = vocab.bounded
    half_step = 1.0 / (torch.tensor(DIMS) - 1)
    monkeypatch.setattr(vocab, "bounded", lambda x: bounded(x) - half_step)  # floor instead of round
    with torch.no_grad():
        wrong = vocab.logits(h)[..., :K].argmax(-1)
        expected, _ = rounded_ids(vocab, h)
    assert (wrong != expected).float().mean() > 0.3


def test_ids_and_digits_round_trip(models):
    vocab = models().vocabulary
    ids = torch.arange(K)
    assert torch.equal(vocab.digits(ids), every_code(DIMS))  # id = mixed-radix number, dimension 0 first
    assert torch.equal(vocab.ids(vocab.digits(ids)), ids)
    assert torch.equal(vocab.ids(every_code(DIMS)), ids)
    torch.testing.assert_close(vocab.table.double(), grid_values(every_code(DIMS), DIMS))
    assert vocab.grid[0].tolist() == pytest.approx([-1, -1 / 3, 1 / 3, 1])  # fixed levels in [-1, 1]
    # the grid is fixed: buffers, not parameters, and not in the saved state
    names = {n for n, _ in vocab.named_parameters()}
    assert names == {"proj_down.weight", "proj_up.weight", "null.weight", "null.bias"}
    assert not any(k in vocab.state_dict() for k in ("grid", "table", "radix", "strides"))


def test_default_grid_and_a_grid_for_a_size():
    from concept_plugins.vocabularies.fsq import FSQVocabConfig, grid_for_size

    assert FSQVocabConfig().resolved_levels() == (8, 8, 8, 8)  # K = 4096
    assert FSQVocabConfig(size=1000).resolved_levels() == (8, 5, 5, 5)
    assert FSQVocabConfig(levels_per_dim=[8, 5, 5, 5], size=1000).validate() == []
    for size in (2, 8, 16, 240, 512, 2048, 4096):
        assert math.prod(grid_for_size(size)) == size and max(grid_for_size(size)) <= 8


# -- streaming: one pass = the naive loop, decoding = teacher forcing -------------------------------------
@pytest.mark.parametrize("attention,positions", [("chunked", "time"), ("sdpa", "compact")])
def test_one_pass_matches_naive(models, attention, positions):
    model = models(attention, positions)
    assert assert_padded_batch_matches_naive(model).keep.any()
    x = torch.randint(0, 97, (3, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the model's own decisions and codes
        out = model(x)
        ref, _ = reference.reference_logits(model, x, keep=out.keep)
    assert 0 < int(out.keep.sum()) < out.keep.numel()
    assert len(out.concept_ids[out.keep].unique()) > 3
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)


def test_negative_control_a_swapped_digit_order_is_caught(models):
    """The input table in the other digit order (last dimension the most significant): the check fails."""
    model = models()
    vocab = model.vocabulary
    ids = torch.arange(K)
    little = torch.stack([(ids // math.prod(DIMS[:i])) % n for i, n in enumerate(DIMS)], -1)
    right, vocab.table = vocab.table, grid_values(little, DIMS).float()  # (a buffer: monkeypatch would delete it)
    try:
        x, mask, keep = padded_batch()
        with torch.no_grad():
            wrong = model(x, attention_mask=mask, keep=keep).logits
            ref, _ = reference.reference_logits(model, x, attention_mask=mask, keep=keep)
        real = mask.bool()
        assert (wrong[real] - ref[real]).abs().max() > 1e-3
        with pytest.raises(AssertionError):
            assert_padded_batch_matches_naive(model)
    finally:
        vocab.table = right
    assert_padded_batch_matches_naive(model)


def test_decoding_matches_teacher_forcing(models):
    model = models()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (9, 1)]
    gen = assert_decoding_matches_teacher_forcing(model, prompts, 12)
    assert 0 < sum(k for row in gen.keep for k in row) < sum(len(row) for row in gen.keep)


# -- streaming: multi-level codes (residual FSQ) ----------------------------------------------------------
def test_multilevel_codes_match_naive_and_decode_exactly(models):
    model = models(levels=2, beam=3)
    assert model.levels == 2 and model.emit == 2
    out = assert_padded_batch_matches_naive(model)
    kept = out.keep
    assert len(out.codes[kept][:, 1].unique()) > 2  # level 1 varies
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 3)]
    assert_decoding_matches_teacher_forcing(model, prompts, 10)  # with the levels' beam


def test_level_one_rounds_what_level_zero_left(models):
    vocab = models(levels=2, beam=3).vocabulary
    h = torch.randn(50, 64, generator=torch.Generator().manual_seed(5))
    n = torch.tensor(DIMS, dtype=torch.float64)
    with torch.no_grad():
        first, z = rounded_ids(vocab, h)
        left = (z - grid_values(vocab.digits(first), DIMS)) * (n - 1)  # the residual, rescaled to [-1, 1]
        second = torch.round((left + 1) * (n - 1) / 2).clamp(torch.zeros_like(n), n - 1).long()
        strides = torch.tensor([math.prod(DIMS[i + 1:]) for i in range(3)])
        logits = vocab.logits(h, 1, first[:, None])
        assert torch.equal(logits[..., :K].argmax(-1), (second * strides).sum(-1))
        assert not torch.allclose(logits, vocab.logits(h, 1, (first[:, None] + 1) % K))


def test_multilevel_gradients_match_naive_and_reach_every_level(models):
    grads = assert_gradients_match_naive(models(levels=2, beam=3), training=True)
    for name in ("vocabulary.proj_down.weight", "vocabulary.proj_up.weight", "vocabulary.level_embed"):
        assert grads[name].abs().sum() > 0, name
    assert grads["vocabulary.level_embed"][1].abs().sum() > 0  # level 1's slots reach their own vector


# -- gradients and training -----------------------------------------------------------------------------
def test_gradients_reach_the_projections_with_the_default_sampler(models, monkeypatch):
    model = models()
    assert model.resolution.components["sampler"].name == "gumbel-st"
    grads = assert_gradients_match_naive(model, training=True)
    assert grads["vocabulary.proj_down.weight"].abs().sum() > 0  # through the soft probabilities
    assert grads["vocabulary.proj_up.weight"].abs().sum() > 0
    # the check fails when the soft path is cut: proj_down then gets no gradient at all
    embed_soft = model.vocabulary.embed_soft
    monkeypatch.setattr(model.vocabulary, "embed_soft", lambda probs, level=0: embed_soft(probs.detach(), level))
    ids, mask, keep = padded_batch()
    model.train()
    try:
        cut = _new_module_grads(model, model(ids, attention_mask=mask, keep=keep).logits, ids, mask.bool())
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert "vocabulary.proj_down.weight" not in cut and cut["vocabulary.proj_up.weight"].abs().sum() > 0


def test_a_few_training_steps(tmp_path):
    from concept.training import TrainConfig, Trainer

    cfg = tiny_config(vocabulary=fsq())
    cfg.backbone.params["vocab"] = 256  # byte-level tokenisation of the default corpus
    concept.save(concept.build(cfg), tmp_path / "build")
    Trainer.start(tmp_path / "build", tmp_path / "run",
                  TrainConfig(steps=3, seq_len=16, batch=2, eval_every=3, eval_batches=1, log_every=1, warmup=1,
                              lora=concept.lora.LoraSettings(rank=2))).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    trained, start = concept.load(tmp_path / "run").new_state_dict(), concept.load(tmp_path / "build").new_state_dict()
    assert not torch.equal(trained["vocabulary.proj_down.weight"], start["vocabulary.proj_down.weight"])
    assert not torch.equal(trained["vocabulary.proj_up.weight"], start["vocabulary.proj_up.weight"])


def test_training_resumes_exactly_and_generate_shows_the_concepts(tmp_path):
    """Ids are stable integers: a run interrupted by Ctrl-C between checkpoints resumes bit for bit, and
    `concept generate --show-concepts` marks the concepts of an fsq model like any other."""
    from click.testing import CliRunner

    from cli.main import cli
    from concept.training import TrainConfig
    from tests.test_objectives import interrupted_at_three

    cfg = tiny_config(vocabulary=fsq())
    cfg.backbone.params["vocab"] = 256
    concept.save(concept.build(cfg), tmp_path / "build")
    train = TrainConfig(steps=5, seq_len=16, batch=2, eval_every=100, eval_batches=1, log_every=1, warmup=1,
                        checkpoint_every=4, lora=concept.lora.LoraSettings(rank=2))
    straight = concept.training.Trainer.start(tmp_path / "build", tmp_path / "straight", train)
    straight.train()
    interrupted_at_three(tmp_path / "build", tmp_path / "resumed", train).train()

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(line)]

    assert len(losses(tmp_path / "straight")) == 5 and losses(tmp_path / "straight") == losses(tmp_path / "resumed")
    one, two = concept.load(tmp_path / "straight"), concept.load(tmp_path / "resumed")
    for key, value in one.new_state_dict().items():
        assert torch.equal(value, two.new_state_dict()[key]), key
    r = CliRunner().invoke(cli, ["generate", str(tmp_path / "resumed"), "-p", "def f(x):", "--max-new-tokens", "8",
                                 "--show-concepts"])
    assert r.exit_code == 0, r.output
    assert "token emitted a concept" in r.output
    r = CliRunner().invoke(cli, ["generate", str(tmp_path / "resumed"), "-p", "def f(x):", "--max-new-tokens", "8",
                                 "--json"])
    row = json.loads(r.stdout)
    assert r.exit_code == 0 and row["concept_positions"] and row["kv"]["concepts"] == len(row["concept_positions"])


# -- the planner-executor: a type's vocabulary --------------------------------------------------------------
@pytest.mark.parametrize("levels", [1, 2])
def test_planner_executor_types_plan_and_decode_exactly(levels):
    from tests.test_planner_executor import pe_config

    cfg = pe_config()  # types of 8 and 16 ids: grids [8] and [8, 2]
    cfg.vocabulary = ComponentRef("fsq", {"levels": levels})
    torch.manual_seed(0)
    m = spread(randomize_new_modules(concept.build(cfg))).eval()
    assert [v.size for v in m.vocabularies] == [8, 16] and [v.levels_per_dim for v in m.vocabularies] == [(8,), (8, 2)]
    assert all(v.levels == levels for v in m.vocabularies)
    u = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(u, dtype=torch.bool)
    valid[1, :3] = False
    with torch.no_grad():
        plan = m.planner(u, valid, sample=False)
        forced = m.planner_forced(u, valid, plan)
        a = plan.active
        # KV-cached = teacher forced (relative: the far codes' logits are ~ -(distance in steps)^2 / temperature)
        torch.testing.assert_close(plan.logits[a], forced.logits[a], atol=1e-5, rtol=1e-5)
        out = m.generate([[3, 1, 4, 1, 5]], max_new_tokens=4, output_logits=True)
        rows = Plan.from_rows([[(i, c) for i, p in enumerate(out.plans[0]) for c in p["ids"]]], (8, 16))
        y = torch.tensor(out.tokens)
        tf = m.executor(rows, y, torch.ones_like(y, dtype=torch.bool))
    assert torch.allclose(out.logits[0], tf[0], atol=1e-5)


def test_planner_type_sizes_must_match_explicit_levels():
    from tests.test_planner_executor import pe_config

    cfg = pe_config()
    cfg.vocabulary = ComponentRef("fsq", {"levels_per_dim": [4, 2]})  # K = 8: the 16-id type cannot use it
    with pytest.raises(ConfigError, match=r"size: 16 codes asked for .* levels_per_dim \[4, 2\] gives K = 8"):
        concept.build(cfg)


# -- bad configs ----------------------------------------------------------------------------------------
def test_bad_configs_are_refused_all_at_once():
    bad = {"levels_per_dim": [1, 4], "temperature": 0, "levels": 0, "beam": 0}
    with pytest.raises(ConfigError) as err:
        concept.build(tiny_config(vocabulary=ComponentRef("fsq", bad)))
    problems = "\n".join(err.value.problems)
    for message in ("levels_per_dim: every dimension needs an integer number of levels >= 2, got 1",
                    "temperature: a finite number > 0", "levels: at least 1", "beam: a beam width >= 1"):
        assert message in problems
    for params, message in (({"levels_per_dim": []}, "a non-empty list of level counts"),
                            ({"levels_per_dim": [8, 2.5]}, r"integer number of levels >= 2, got 2.5"),
                            ({"levels_per_dim": [1024, 1024, 2]}, r"K = prod\(\[1024, 1024, 2\]\) = 2097152 codes, above"),
                            ({"size": 509}, "prime factor 509"),
                            ({"size": 100, "levels_per_dim": [8, 8]}, "gives K = 64")):
        with pytest.raises(ConfigError, match=message):
            concept.resolve(tiny_config(vocabulary=ComponentRef("fsq", params)))


def test_cli_build_with_fsq(tmp_path):
    from click.testing import CliRunner
    from concept_cli.main import cli

    tiny = ["--backbone", "tiny-llama", "--set", "backbone.layers=4", "--set", "backbone.hidden=32", "--set",
            "backbone.heads=2", "--set", "backbone.kv_heads=1", "--split", "1,2,1", "--dry-run", "--json",
            "--vocabulary", "fsq"]
    r = CliRunner().invoke(cli, ["build", *tiny, "--set", "vocabulary.levels_per_dim=[8,5,5,5]"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["build", *tiny, "--set", "vocabulary.levels_per_dim=[1,4]"])
    assert r.exit_code == 2 and "vocabulary.levels_per_dim: every dimension needs an integer number of levels >= 2" in r.output
