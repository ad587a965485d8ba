"""The one-pass O(T) forward equals the naive per-t reference, logits and gradients; in fp32 for every
pattern, and in fp64 (atol 1e-10) where a small position or mask bug would otherwise hide in the fp32
tolerance. Negative controls: a wrong rule in every backend and a wrong position in every scheme are
caught, in this file."""
import copy

import pytest
import torch

import concept
import concept.packing as packing
import tests.reference as reference
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
FORWARD_BACKENDS = [*BACKENDS, "flex", "cascade"]  # FlexAttention has no backward on CPU; cascade's gradients
# (against sdpa's in fp64 for every scheme, and against the naive loop): tests/test_cascade.py
SCHEMES = ["time", "per-type"]
ALL_SCHEMES = [*SCHEMES, "compact"]
FP64_ATOL = 1e-10  # fp64 agreement is ~1e-16; an off-by-one position moves tiny-model logits by ~1e-5
SEEN_BY_POSITIONS = ["runs", "rate-0.5", "first"]  # patterns with concepts and tails (positions matter)


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


# every pattern, every backend; cascade with the time scheme only (positions are computed outside the backend,
# and the fp64 tests below run cascade with every scheme)
ONE_PASS = [(b, p) for b in FORWARD_BACKENDS for p in SCHEMES if b != "cascade" or p == "time"]


@pytest.mark.parametrize("backend,positions", ONE_PASS, ids=[f"{p}-{b}" for b, p in ONE_PASS])
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


def assert_padded_batch_matches_naive(model, atol=ATOL):
    """One-pass logits = the naive loop's on ``padded_batch`` (forced decisions). Returns the output."""
    ids, mask, keep = padded_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, keep=keep)
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)
    real = mask.bool()
    assert torch.equal(out.keep, keep & real)
    torch.testing.assert_close(out.logits[real], ref[real], atol=atol, rtol=0)
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
    from concept.losses import next_token_loss

    model.zero_grad(set_to_none=True)
    next_token_loss(logits, ids, valid).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_gradients_match_naive(model, training=False, atol=1e-5, rtol=1e-4) -> dict:
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
        torch.testing.assert_close(grads[name], ref_grads[name], atol=atol, rtol=rtol, msg=name)
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


# -- fp64: the same claims, far below any position or mask bug ---------------------------------------
@pytest.fixture(scope="module")
def fp64_models(tiny_models):
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = copy.deepcopy(tiny_models(**kw)).double().eval()
        return cache[key]

    return get


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", ALL_SCHEMES)
@pytest.mark.parametrize("name", SEEN_BY_POSITIONS)
def test_one_pass_matches_naive_in_fp64(fp64_models, backend, positions, name):
    model = fp64_models(attention=backend, positions=positions)
    ids, keep = inputs(), pattern(name)[None]
    with torch.no_grad():
        out = model(ids, keep=keep)
        ref, _ = reference_logits(model, ids, keep=keep)
    assert out.logits.dtype == torch.float64
    torch.testing.assert_close(out.logits, ref, atol=FP64_ATOL, rtol=0)


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
@pytest.mark.parametrize("positions", ALL_SCHEMES)
def test_padded_batch_matches_naive_in_fp64(fp64_models, backend, positions):
    assert_padded_batch_matches_naive(fp64_models(attention=backend, positions=positions), atol=FP64_ATOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positions", ALL_SCHEMES)
def test_gradients_match_naive_in_fp64(fp64_models, backend, positions):
    """transformers' RMSNorm normalises in float32 whatever the input's dtype, so gradients through the stacks
    carry float32 rounding (measured: up to 7.5e-10 on gradients of size ~1e-2); the tolerance is 2000 times
    tighter than the fp32 test's (the forward in fp64 agrees to ~1e-16: the tests above)."""
    assert_gradients_match_naive(fp64_models(attention=backend, positions=positions), atol=5e-9, rtol=1e-6)


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_packed_documents_equal_separate_rows_in_fp64(fp64_models, backend):
    model = fp64_models(attention=backend, positions="per-type")
    ids = inputs(B=1, T=16, seed=7)
    keep = torch.tensor([[0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)
    assert_packed_documents_equal_separate_rows(model, ids, keep, atol=FP64_ATOL)


# -- negative controls: the checks above see a wrong rule in every backend and every scheme ------------
def max_error(model, ids, keep, attention_mask=None, document_ids=None) -> float:
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask, keep=keep, document_ids=document_ids).logits
        ref, _ = reference_logits(model, ids, attention_mask=attention_mask, keep=keep)
    return float((out - ref).abs().max())


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_negative_control_every_backend_is_checked_against_the_rule(fp64_models, backend, monkeypatch):
    """A tail token that also sees the tails of earlier segments (the segment rule dropped from the packed
    metadata every backend reads) is caught by the one-pass test, whichever backend runs the rule."""
    model = fp64_models(attention=backend, positions="time")
    ids, keep = inputs(), pattern("runs")[None]
    assert max_error(model, ids, keep) < FP64_ATOL
    real_pack = packing.pack

    def one_segment(*args, **kwargs):
        layout = real_pack(*args, **kwargs)
        meta = layout.meta
        layout.meta = packing.SlotMeta(meta.time, meta.keep, torch.where(meta.valid, 0, meta.seg), meta.valid,
                                       meta.doc, meta.sub)
        return layout

    monkeypatch.setattr(packing, "pack", one_segment)
    assert max_error(model, ids, keep) > 1e4 * FP64_ATOL


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_negative_control_a_lost_document_mask_is_caught(fp64_models, backend, monkeypatch):
    """Documents packed in one row that see each other (the document ids dropped from the metadata) no
    longer give each document's logits alone."""
    model = fp64_models(attention=backend, positions="time")
    ids = inputs(B=1, T=16, seed=7)
    keep = torch.tensor([[0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)
    real_pack = packing.pack

    def one_document(*args, **kwargs):
        layout = real_pack(*args, **kwargs)
        meta = layout.meta
        layout.meta = packing.SlotMeta(meta.time, meta.keep, meta.seg, meta.valid, torch.zeros_like(meta.doc), meta.sub)
        return layout

    monkeypatch.setattr(packing, "pack", one_document)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_packed_documents_equal_separate_rows(model, ids, keep, atol=FP64_ATOL)


@pytest.mark.parametrize("positions", ALL_SCHEMES)
def test_negative_control_an_off_by_one_concept_position_is_caught_in_every_scheme(fp64_models, positions,
                                                                                  monkeypatch):
    """The oracle with every other concept one position later (in the middle stack, then in the deep stack)
    disagrees with the model far beyond the fp64 tolerance, in every scheme. (Shifting *every* position of
    a stack alike is no bug under RoPE, which sees only differences: the middle stack holds only concepts.)"""
    model = fp64_models(attention="sdpa", positions=positions)
    ids, keep = inputs(), pattern("runs")[None]
    real = reference.concept_position
    for stack in ("middle", "deep"):
        monkeypatch.setattr(reference, "concept_position",
                            lambda m, index, rank, s, stack=stack: real(m, index, rank, s) + (rank % 2) * (s == stack))
        assert max_error(model, ids, keep) > 1e4 * FP64_ATOL, stack
    monkeypatch.setattr(reference, "concept_position", real)
    assert max_error(model, ids, keep) < FP64_ATOL


def test_compiled_flex_the_default_path_matches_naive():
    """``flex`` compiles FlexAttention by default (tests elsewhere run it eagerly, ``compile=False``, for
    speed). The compiled forward against the naive reference on a tiny case (a few seconds of compiling).
    torch has no FlexAttention backward on the CPU, so training with it there is a clear error; the compiled
    backward is checked on CUDA (tests/test_cuda.py, every backend with its default configuration)."""
    from concept import ComponentRef
    from concept.errors import ConceptError
    from tests.conftest import randomize_new_modules, tiny_config

    cfg = tiny_config(attention="flex")
    cfg.attention = ComponentRef("flex", {})  # the defaults: compile=True
    model = randomize_new_modules(concept.build(cfg)).eval()
    assert model.resolution.components["attention"].config.compile
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        out = model(ids, keep=keep)
        ref, _ = reference_logits(model, ids, keep=keep)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
    with pytest.raises(ConceptError, match="no backward pass on CPU"):
        model(ids, keep=keep).logits.sum().backward()
