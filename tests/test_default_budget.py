"""The static concept budget is the default (``BuildConfig.max_ratio = "auto"``, ``concept.streaming.budget``):
``auto`` is 1.25 times the length policy's target ratio plus 6 boundaries where its per-document tracker holds each
row near it (twice it plus 4 without one), following the trainer's target as it moves, a `fixed` policy's own
rate, none for a policy with neither; ``none`` / 0 switch it off; runs saved before it load as they were built
(no budget). The default build's forward has one declared host sync (the policy scan) and no hidden one, with
an injected ``.item()`` and the budget switched off as negative controls (its training step and compiled
training: ``tests/test_host_syncs.py``, ``tests/test_compile.py``, both on the default build)."""
import json
import math

import pytest
import torch
from click.testing import CliRunner

import concept
from concept_cli.main import cli
from concept import BuildConfig, ComponentRef, ConfigError, resolve
from concept.streaming.operating_point import has_budget, max_ratio_problem
from concept import packing
from concept.streaming import budget, gap
from concept.streaming.model import ConceptModel
from concept.syncs import HostSyncs
from tests.conftest import assert_decoding_matches_teacher_forcing, randomize_new_modules
from tests.test_static_shapes import budgeted

TINY = {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 97}


def tiny(**extra):
    """A default build of the tiny backbone (the `null` policy with its tracker, `chunked`, max_ratio auto)."""
    return BuildConfig(backbone=ComponentRef("tiny-llama", TINY), split="2,2,2",
                       vocabulary=ComponentRef("embedding", {"size": 32}), **extra)


@pytest.fixture(scope="module")
def default_model():
    model = randomize_new_modules(concept.build(tiny())).eval()
    gap.set_target(model.length_policy, 0.125)  # (randomize_new_modules drew the policy's buffers too)
    model.length_policy.null_bias.fill_(0.0)  # a random head: ~26% of the tokens would emit, so the cap binds
    return model


def test_auto_is_the_default_and_none_or_zero_switch_it_off():
    assert BuildConfig().max_ratio == "auto"
    for word, parsed in (("auto", "auto"), ("none", "none"), ("None", "none"), ("0", 0.0), ("0.3", 0.3)):
        cfg = BuildConfig(backbone="tiny-llama").apply_overrides([f"max_ratio={word}"])
        assert cfg.max_ratio == parsed and max_ratio_problem(parsed) is None
        assert BuildConfig.from_json(cfg.to_json()).max_ratio == parsed
    assert [has_budget(v) for v in ("auto", 0.3, 1, "none", 0, 0.0)] == [True, True, True, False, False, False]
    for bad in ("sometimes", 1.5, -0.1, True, float("nan")):
        assert "max_ratio: a number in [0, 1], 'auto'" in max_ratio_problem(bad)
    with pytest.raises(ConfigError, match="max_ratio: a number in \\[0, 1\\], 'auto'"):
        resolve(BuildConfig(backbone="tiny-llama", max_ratio="sometimes"))


def test_the_build_command_takes_a_number_auto_or_none():
    base = ["build", "--backbone", "tiny-llama", "--dry-run", "--json"]
    for given, saved in ((None, "auto"), ("none", "none"), ("0.3", 0.3), ("AUTO", "auto")):
        result = CliRunner().invoke(cli, base + ([] if given is None else ["--max-ratio", given]))
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["config"]["streaming"]["max_ratio"] == saved
    result = CliRunner().invoke(cli, base + ["--max-ratio", "lots"])
    assert result.exit_code == 2 and "error: " in result.stderr and "max_ratio: a number in [0, 1]" in result.stderr
    assert "Traceback" not in result.output


def test_auto_is_a_quarter_over_the_policys_target_and_follows_it(default_model):
    policy = default_model.length_policy
    assert default_model.budget_setting == "auto" and default_model.max_ratio == 0.15625  # 1.25 x the default 0.125
    try:
        gap.set_target(policy, 0.3)  # what the trainer does each step (its curriculum's target)
        assert default_model.max_ratio == 0.375
        gap.set_target(policy, 0.9)
        assert default_model.max_ratio == 1.0
    finally:
        gap.set_target(policy, 0.125)
    with default_model.budget_off():
        assert default_model.max_ratio == 0.0
    assert default_model.max_ratio == 0.15625


def test_auto_without_a_per_document_tracker_is_twice_the_target():
    """Nothing holds a row near the target (`threshold`, `null` with ``track`` 0): twice it, slack 4; the
    tracked rule's slots against it at the default target (negative control: the tracked rule on `threshold`)."""
    tracked = randomize_new_modules(concept.build(tiny()))
    for policy in (ComponentRef("threshold"), ComponentRef("null", {"track": 0.0})):
        model = randomize_new_modules(concept.build(tiny(length_policy=policy)))
        gap.set_target(model.length_policy, 0.125)
        assert not budget.tracks_documents(model.length_policy)
        assert (model.max_ratio, model.budget_slack) == (0.25, 4) and budget.rule(model.length_policy) == budget.UNTRACKED
        assert model.concept_slots(128) == 36
    gap.set_target(tracked.length_policy, 0.125)
    assert budget.tracks_documents(tracked.length_policy)
    assert (tracked.max_ratio, tracked.budget_slack, tracked.concept_slots(128)) == (0.15625, 6, 26)
    assert tracked.concept_slots(8192) == 1286


def test_auto_reads_the_capabilities_a_policy_declares_not_attributes_of_the_same_names():
    """``auto`` asks the contract (``concept.contracts``): a target ratio and a tracker's gain come with
    ``TracksRatio`` (``track`` declared there, 0 by default: no tracker), a rate bound is ``LengthPolicy``'s
    ``max_boundary_rate`` (None by default). A third-party policy with a ``track`` gain and a ``target_ratio`` but
    not the capability gets no budget from them (negative control: the same class declaring ``TracksRatio`` gets
    the tracked rule), and setting a target on it says why it cannot."""
    from concept.contracts import LengthPolicy, TracksRatio

    class Undeclared(LengthPolicy):
        track, target_ratio = 0.8, torch.tensor(0.125)

    class Declared(Undeclared, TracksRatio):
        pass

    class Untracked(LengthPolicy, TracksRatio):
        target_ratio = torch.tensor(0.125)

    assert LengthPolicy.max_boundary_rate is None and TracksRatio.track == 0.0
    assert not budget.tracks_documents(Undeclared()) and budget.auto(Undeclared()) == 0.0
    assert gap.target_of(Undeclared()) == gap.DEFAULT_TARGET_RATIO
    with pytest.raises(TypeError, match="not a TracksRatio"):
        gap.set_target(Undeclared(), 0.3)
    assert budget.tracks_documents(Declared()) and budget.auto(Declared()) == 0.15625
    assert not budget.tracks_documents(Untracked()) and budget.auto(Untracked()) == 0.25  # (no gain: twice r)


def test_auto_for_fixed_is_its_own_rate_and_never_binds():
    model = randomize_new_modules(concept.build(tiny(length_policy=ComponentRef("fixed", {"every": 2}))))
    assert model.max_ratio == 0.5  # where the tracked rule (0.15625) would drop most boundaries
    ids = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 7 + [1] * 11 + [2] * 15, [0] * 33])
    with torch.no_grad():
        out = model(ids, document_ids=doc)
        with model.budget_off():
            free = model(ids, document_ids=doc)
    assert out.layout.static and not free.layout.static
    assert torch.equal(out.keep, free.keep) and int(out.capped) == 0
    torch.testing.assert_close(out.logits, free.logits, atol=1e-5, rtol=1e-5)
    entropy = concept.build(tiny(length_policy=ComponentRef("entropy", {"min_chunk": 2, "max_chunk": 4})))
    assert entropy.max_ratio == 0.0  # neither a target nor a bound: no budget


def test_runs_saved_before_keep_their_layout(default_model, tmp_path):
    """A run saved with max_ratio 0 keeps it; one saved before the option existed (no key) loads without a budget,
    as it was built, and computes what it did (the dynamic layout)."""
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    old = randomize_new_modules(concept.build(tiny(max_ratio=0.0)))
    concept.save(old, tmp_path / "zero")
    concept.save(old, tmp_path / "older")
    record = json.loads((tmp_path / "older" / "concept.json").read_text())
    streaming = record["config"].pop("streaming")  # format 2: the streaming keys at the top, no max_ratio yet
    del streaming["max_ratio"]
    record.update(format=2, config=record["config"] | streaming)
    (tmp_path / "older" / "concept.json").write_text(json.dumps(record))
    with torch.no_grad():
        want = old(ids)
        for name in ("zero", "older"):
            loaded = concept.load(tmp_path / name)
            assert loaded.max_ratio == 0.0 and loaded.budget_setting == 0.0
            out = loaded(ids)
            assert not out.layout.static and out.capped is None and torch.equal(out.keep, want.keep)
            torch.testing.assert_close(out.logits, want.logits, atol=0, rtol=0)


def forward_inputs(T=128):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, T), generator=g)
    doc = torch.tensor([[0] * 50 + [1] * 30 + [2] * (T - 80), [0] * T])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), document_ids=doc)


def count(model, **inputs) -> HostSyncs:
    with torch.no_grad(), HostSyncs() as seen:
        model(**inputs)
    return seen


def test_the_default_forward_reads_the_device_once(default_model, monkeypatch):
    """T = 128, packed documents, `chunked`: the policy scan and nothing else (negative controls: no budget, and
    an ``.item()`` injected into the forward)."""
    inputs = forward_inputs()  # (made from Python data: outside the counted forward)
    with torch.no_grad(), HostSyncs() as seen:
        out = default_model(**inputs)
    assert out.layout.static and int(out.capped) > 0  # the cap bound (so its path ran)
    assert seen.hidden == 0, dict(seen.syncs)
    assert dict(seen.declared) == {"policy scan": 1}
    with default_model.budget_off():
        assert count(default_model, **forward_inputs()).hidden > 0  # the dynamic layout reads its widths back
    fuse = ConceptModel.fuse_tail

    def fuse_and_read(self, tail, updates, layout):
        tail.sum().item()  # a data-dependent read slipped into the forward
        return fuse(self, tail, updates, layout)

    monkeypatch.setattr(ConceptModel, "fuse_tail", fuse_and_read)
    seen = count(default_model, **forward_inputs())
    assert seen.hidden == 1 and dict(seen.syncs) == {"_local_scalar_dense": 1}


def test_auto_leaves_a_slack_and_the_cap_is_still_its_step_rule(default_model):
    """``auto``'s budget is ``ceil(1.25 r n) + 6`` (a burst at a row's start: docs/results.md); the one-pass cap with
    a slack equals the cap applied token by token, and the decoder applies it too (decoding = teacher forcing)."""
    g = torch.Generator().manual_seed(0)
    keep, valid = torch.rand(6, 40, generator=g) < 0.4, torch.rand(6, 40, generator=g) < 0.9
    for slack in (0, 2):
        want = torch.zeros_like(keep)
        for b in range(6):
            count = n = 0
            for t in range(40):
                n += int(valid[b, t])
                if valid[b, t] and keep[b, t] and count < math.ceil(n * 0.25) + slack:
                    want[b, t], count = True, count + 1
        assert torch.equal(packing.cap_boundaries(keep, valid, 0.25, slack=slack), want)
    model = default_model
    assert model.budget_slack == budget.TRACKED[1] == 6
    assert model.concept_slots(16) == math.ceil(16 * 0.15625) + 6
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    model.length_policy.null_bias.fill_(-20.0)  # every token's head says keep: the tracker lets ~10 ahead
    try:
        gen = assert_decoding_matches_teacher_forcing(model, prompts, 10)
        with torch.no_grad():
            capped = [int(model(torch.tensor([p + gen.tokens[b][:-1]])).capped) for b, p in enumerate(prompts)]
    finally:
        model.length_policy.null_bias.fill_(0.0)
    assert min(capped) > 0  # the cap bound on the decoded text
    with budgeted(model, 0.25):
        assert model.budget_slack == 0  # (a number is the budget as given)
