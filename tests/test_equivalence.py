"""The one-pass O(T) forward equals the naive per-t reference (SPEC §2.1), logits and gradients."""
import pytest
import torch

from tests.conftest import PACKED_DOC, assert_packed_documents_equal_separate_rows
from tests.reference import reference_logits

T = 12
ATOL = 1e-5


def pattern(name: str, T: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    fixed = {
        "none": torch.zeros(T, dtype=torch.bool),
        "all": torch.ones(T, dtype=torch.bool),
        "first": torch.arange(T) == 0,
        "last": torch.arange(T) == T - 1,
        "runs": torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.bool)[:T],
    }
    if name in fixed:
        return fixed[name]
    rate = float(name.split("-")[1])
    return torch.rand(T, generator=g) < rate


PATTERNS = ["none", "all", "first", "last", "runs", "rate-0.1", "rate-0.5", "rate-0.9"]
BACKENDS = ["sdpa", "chunked", "auto", "xformers"]  # with gradients (auto: chunked on CPU; xformers: its
# gathered layout with the materialised bias, kernel = "reference"; the CUDA kernel: tests/test_xformers.py)
FORWARD_BACKENDS = [*BACKENDS, "flex"]  # FlexAttention has no backward on CPU
SCHEMES = ["time", "per-type"]


def inputs(B=1, T=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (B, T), generator=g)


def padded_batch():
    """Rows of different lengths and patterns; right padding and one left-padded row."""
    ids = inputs(B=4, seed=1)
    mask = torch.ones(4, T, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 9:] = 0
    mask[3, :4] = 0  # left padding
    keep = torch.stack([pattern("runs"), pattern("rate-0.5"), pattern("first"), pattern("rate-0.9")])
    return ids, mask, keep


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", SCHEMES)
@pytest.mark.parametrize("name", PATTERNS)
def test_one_pass_matches_naive(tiny_models, backend, positions, name):
    model = tiny_models(attention=backend, positions=positions)
    ids, keep = inputs(), pattern(name)[None]
    with torch.no_grad():
        out = model(ids, keep=keep)
        ref, _ = reference_logits(model, ids, keep=keep)
    assert torch.equal(out.keep, keep)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", SCHEMES)
def test_padded_batch_matches_naive(tiny_models, backend, positions):
    assert_padded_batch_matches_naive(tiny_models(attention=backend, positions=positions))


def assert_padded_batch_matches_naive(model):
    """One-pass logits = the naive loop's on ``padded_batch`` (forced decisions). Returns the output."""
    ids, mask, keep = padded_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, keep=keep)
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)
    real = mask.bool()
    assert torch.equal(out.keep, keep & real)
    torch.testing.assert_close(out.logits[real], ref[real], atol=ATOL, rtol=0)
    return out


@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-qwen2"])
def test_policy_decisions_match_naive(tiny_models, backbone):
    """keep decided by the model itself (null policy + max-run forcing), on both architectures."""
    model = tiny_models(backbone=backbone, attention="chunked")
    ids = inputs(B=3, seed=5)
    with torch.no_grad():
        out = model(ids)
        ref, _ = reference_logits(model, ids, keep=out.keep)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


def _new_module_grads(model, logits, ids, valid):
    from concept.model import next_token_loss

    model.zero_grad(set_to_none=True)
    next_token_loss(logits, ids, valid).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_gradients_match_naive(model, training=False) -> dict:
    """The new modules' gradients of the one-pass loss equal the naive loop's on ``padded_batch``
    (``training``: train mode, the same sampler noise in both passes). Returns the one-pass gradients."""
    ids, mask, keep = padded_batch()
    valid = mask.bool()
    model.train(training)
    try:
        torch.manual_seed(3)
        grads = _new_module_grads(model, model(ids, attention_mask=mask, keep=keep).logits, ids, valid)
        torch.manual_seed(3)
        ref_grads = _new_module_grads(model, reference_logits(model, ids, attention_mask=mask, keep=keep)[0], ids, valid)
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    return grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positions", SCHEMES)
def test_gradients_match_naive(tiny_models, backend, positions):
    grads = assert_gradients_match_naive(tiny_models(attention=backend, positions=positions))
    assert any(n.startswith("vocabulary.head") for n in grads), "the straight-through path must reach the head"


def test_gumbel_training_gradients_match_naive(tiny_models):
    """Training mode (gumbel-st): the same noise in both passes gives the same logits and gradients."""
    assert_gradients_match_naive(tiny_models(attention="chunked", positions="time"), training=True)


def test_negative_control_packed_index_positions_in_one_pass(tiny_models, monkeypatch):
    """Numbering the packed sequence 0..L-1 instead of original positions is wrong: large error."""
    model = tiny_models(attention="sdpa", positions="time")
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        ref, _ = reference_logits(model, ids, keep=keep)
        monkeypatch.setattr(model, "deep_positions", lambda pos, concept_pos, layout: torch.arange(layout.length)[None])
        wrong = model(ids, keep=keep).logits
    # ~100x the equivalence tolerance on a tiny random model (much larger on SmolLM2, see test_smollm2)
    assert (wrong - ref).abs().max() > 50 * ATOL


def test_negative_control_reference_is_sensitive(tiny_models):
    """The oracle itself distinguishes position rules, so agreement above is not vacuous."""
    model = tiny_models(attention="sdpa", positions="time")
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        out = model(ids, keep=keep).logits
        wrong, _ = reference_logits(model, ids, keep=keep, deep_positions="packed-index")
    assert (out - wrong).abs().max() > 50 * ATOL


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", SCHEMES)
def test_packed_documents_equal_separate_rows(tiny_models, backend, positions):
    """Several documents packed in one row (document_ids) give each document's logits alone."""
    model = tiny_models(attention=backend, positions=positions)
    ids = inputs(B=1, T=16, seed=7)
    doc = torch.tensor(PACKED_DOC)
    keep = torch.tensor([[0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    assert_packed_documents_equal_separate_rows(model, ids, keep, ATOL)
    with torch.no_grad():
        # and with decisions made by the policy (runs of NULLs restart per document)
        decided = model(ids, document_ids=doc)
        for d in range(3):
            cols = doc[0] == d
            assert torch.equal(decided.keep[:, cols], model(ids[:, cols]).keep)
