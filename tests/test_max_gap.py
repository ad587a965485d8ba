"""The maximum gap (``concept.streaming.gap``): ``max_run`` / ``max_chunk`` = ``auto`` derives the bound from
the target ratio, ``none`` switches the forcing off; the batched decisions equal the step rule and decoding
equals teacher forcing with either. Negative controls: without the bound (``none``, or an ``auto`` that ignores
the target) the gaps run past it."""
import pytest
import torch

import concept
from concept.streaming import gap
from tests.conftest import assert_decoding_matches_teacher_forcing, randomize_new_modules, tiny_config

BOUND_OPTION = {"null": "max_run", "threshold": "max_run", "entropy": "max_chunk", "mtp": "max_chunk"}
RARE = {"null": {"track": 0}, "threshold": {}, "entropy": {"tau": 1e-6}, "mtp": {"heads": 2, "track": 0}}


def test_auto_is_twice_the_mean_spacing_at_the_target():
    assert [gap.from_target(r) for r in (0.125, 0.25, 1 / 32, 0.3, 1.0, 4.0)] == [16, 8, 64, 7, 2, 1]
    assert gap.from_target(0.0) == gap.from_target(-0.5) == gap.from_target(float("nan")) == gap.UNBOUNDED
    assert gap.problems("max_run", "auto") == gap.problems("max_run", "none") == gap.problems("max_run", 3) == []
    for bad in (0, "many", True, 2.5):
        assert "max_run: expected an integer >= 1, 'auto'" in gap.problems("max_run", bad)[0]


def rare_model(policy: str, bound, target: float | None):
    """A tiny model whose own rule almost never emits a concept, so the gap bound does the work."""
    model = randomize_new_modules(concept.build(tiny_config(policy=(policy, {BOUND_OPTION[policy]: bound, **RARE[policy]}))))
    lp = model.length_policy
    with torch.no_grad():
        if hasattr(lp, "null_bias"):
            lp.null_bias.fill_(40.0)
        if target is not None and hasattr(lp, "target_ratio"):
            lp.target_ratio.fill_(target)
    return model.eval()


def longest_gap(keep: torch.Tensor) -> int:
    longest = 0
    for row in keep.tolist():
        run = 0
        for k in row:
            run = 0 if k else run + 1
            longest = max(longest, run)
    return longest


def step_decisions(model, x):
    with torch.no_grad():
        valid = torch.ones_like(x, dtype=torch.bool)
        h = model.shallow_states(x, valid, None)
        head_logits = model.vocabulary.logits(h)
        batched = model.length_policy.decide(h, head_logits, valid)
        state, steps = model.length_policy.init_state(x.shape[0], "cpu"), []
        for t in range(x.shape[1]):
            k, state = model.length_policy.step(h[:, t], head_logits[:, t], state)
            steps.append(k)
    return batched, torch.stack(steps, 1)


@pytest.mark.parametrize("policy", list(BOUND_OPTION))
def test_auto_bounds_the_gap_at_the_target_and_none_does_not(policy, monkeypatch):
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    # entropy has no target of its own: auto stands for the project's default target (16 tokens per chunk)
    target, expected = (None, 15) if policy == "entropy" else (0.5, 4 if BOUND_OPTION[policy] == "max_run" else 3)
    model = rare_model(policy, "auto", target)
    batched, stepped = step_decisions(model, x)
    assert torch.equal(batched, stepped)  # batched decide == the step rule (decoding = teacher forcing)
    assert longest_gap(batched) == expected  # forced exactly at the bound
    # negative controls: no bound, or an auto that ignores the target, let the gap run past it
    assert longest_gap(step_decisions(rare_model(policy, "none", target), x)[0]) > expected
    if policy != "entropy":
        monkeypatch.setattr(gap, "from_target", lambda target: 16)
        assert longest_gap(step_decisions(rare_model(policy, "auto", target), x)[0]) > expected


def test_none_is_the_rule_without_forcing_and_an_integer_is_as_before():
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    assert longest_gap(step_decisions(rare_model("null", "none", 0.5), x)[0]) == 40  # nothing natural, nothing forced
    assert longest_gap(step_decisions(rare_model("null", 5, 0.5), x)[0]) == 5


def test_decoding_equals_teacher_forcing_with_an_auto_gap():
    model = rare_model("null", "auto", 0.5)
    prompts = [[5, 9, 2, 40, 7], [11, 3]]
    gen = assert_decoding_matches_teacher_forcing(model, prompts, 9)
    assert any(k for row in gen.keep for k in row)  # the bound forced concepts while decoding too


def test_saved_threshold_weights_without_a_target_keep_the_old_bound():
    model = rare_model("threshold", "auto", 0.5)
    state = {k: v for k, v in model.length_policy.state_dict().items() if k != "target_ratio"}
    model.length_policy.load_state_dict(state)
    assert model.length_policy.max_run == 16  # the fixed default of weights saved before `auto`
