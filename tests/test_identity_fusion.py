"""Identity start and tail fusion (issue 10): exact against the backbone, the naive reference and
step-wise decoding."""
import pytest
import torch

import concept
from concept import ComponentRef
from concept.lora import LoraSettings, add_lora
from tests.conftest import (assert_decoding_matches_teacher_forcing, assert_packed_documents_equal_separate_rows,
                            mix_decisions, randomize_new_modules, tiny_config)
from tests.reference import reference_logits
from tests.test_equivalence import inputs, padded_batch, pattern

ATOL = 1e-5
FUSIONS = {"update": ComponentRef("update"), "bridge": ComponentRef("bridge", {"hidden": 16}),
           "bridge-linear": ComponentRef("bridge", {"hidden": 0, "base": "none"})}
_CACHE = {}


def fused(fusion="update", attention="sdpa", positions="time", backbone="tiny-llama", mixed=False):
    """A tiny model with a tail fusion and randomised new modules (bridge weights are not zero)."""
    key = (fusion, attention, positions, backbone, mixed)
    if key not in _CACHE:
        cfg = tiny_config(backbone=backbone, attention=attention, positions=positions, tail_fusion=FUSIONS[fusion])
        model = randomize_new_modules(concept.build(cfg))
        _CACHE[key] = (mix_decisions(model) if mixed else model).eval()
    return _CACHE[key]


def dense_logits(model, ids):
    with torch.no_grad():
        return model.backbone(ids).logits


# -- identity start ----------------------------------------------------------------------------

@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("fusion", ["none", "bridge"])
def test_keep_all_equals_the_backbone_at_init_and_with_lora(backbone, fusion):
    """Every token a concept: the identity start is exactly the dense backbone (before training,
    and with LoRA injected at its init), whatever the tail fusion (there is no tail)."""
    model = concept.build(tiny_config(backbone=backbone, tail_fusion=ComponentRef(fusion)))
    ids = inputs(B=2, seed=3)
    keep = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, keep=keep).logits, dense_logits(model, ids), atol=ATOL, rtol=0)
        add_lora(model.backbone, LoraSettings(rank=4))
        torch.testing.assert_close(model(ids, keep=keep).logits, dense_logits(model, ids), atol=ATOL, rtol=0)


def test_negative_controls_of_the_identity_invariant():
    """An open gate, or the purely discrete concept input, breaks keep-all == backbone."""
    ids = inputs(B=2, seed=3)
    keep = torch.ones_like(ids, dtype=torch.bool)
    opened = randomize_new_modules(concept.build(tiny_config()))
    discrete = concept.build(tiny_config(concept_input="embedding"))
    assert discrete.concept_gate is None and "concept_gate" not in discrete.new_modules()
    with torch.no_grad():
        for model in (opened, discrete):
            assert (model(ids, keep=keep).logits - dense_logits(model, ids)).abs().max() > 100 * ATOL


def test_the_gate_opens_with_training():
    """The discrete embedding gets a gradient through the gate's gradient: the gate moves first."""
    model = concept.build(tiny_config())
    model.train()
    ids = inputs(B=2, seed=4)
    keep = pattern("rate-0.5")[None].expand(2, -1)
    out = model(ids, keep=keep, labels=ids)
    out.loss.backward()
    assert model.concept_gate.gate.grad.abs().sum() > 0
    assert model.vocabulary.table.weight.grad is None or model.vocabulary.table.weight.grad.abs().sum() == 0


def test_identity_start_beats_the_discrete_input_on_a_pretrained_like_signal():
    """At keep-all the identity start reproduces the backbone's loss; the discrete input does not."""
    ids = inputs(B=1, seed=5)
    keep = torch.ones_like(ids, dtype=torch.bool)
    identity = concept.build(tiny_config())
    discrete = concept.build(tiny_config(concept_input="embedding"))
    with torch.no_grad():
        dense = torch.nn.functional.cross_entropy(dense_logits(identity, ids)[0, :-1], ids[0, 1:])
        assert abs(float(identity(ids, keep=keep, labels=ids).loss) - float(dense)) < 1e-4
        assert abs(float(discrete(ids, keep=keep, labels=ids).loss) - float(dense)) > 1e-3


# -- identity-scaled: the gate in units of the shallow state ------------------------------------------

def scaled(gate=None):
    model = randomize_new_modules(concept.build(tiny_config(concept_input="identity-scaled")))
    if gate is not None:
        with torch.no_grad():
            model.concept_gate.gate.fill_(gate)
    return model.eval()


def test_identity_scaled_keep_all_equals_the_backbone_at_init():
    model = concept.build(tiny_config(concept_input="identity-scaled"))
    ids = inputs(B=2, seed=3)
    keep = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, keep=keep).logits, dense_logits(model, ids), atol=ATOL, rtol=0)


def test_identity_scaled_adds_the_embedding_at_gate_times_the_states_rms():
    model = scaled(gate=0.25)
    h, e = torch.randn(2, 3, 64) * 9, torch.randn(2, 3, 64) * 0.05
    added = model.concept_gate(h, e) - h
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    torch.testing.assert_close(rms(added), 0.25 * rms(h), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cosine_similarity(added, e, dim=-1), torch.ones(2, 3))
    assert torch.equal(model.concept_gate(h, torch.zeros_like(e)), h)  # no embedding (codes removed): h alone
    absolute = concept.build(tiny_config()).concept_gate  # negative control: the absolute gate adds 0.25 * e
    absolute.gate.data.fill_(0.25)
    with torch.no_grad():
        assert float(rms(absolute(h, e) - h).max()) < 0.01 * float(rms(added).min())


@pytest.mark.parametrize("name", ["first", "runs", "rate-0.5"])
def test_identity_scaled_one_pass_and_gradients_match_naive(name):
    from tests.test_equivalence import _new_module_grads

    model = scaled()
    ids, keep = inputs(), pattern(name)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, keep=keep).logits, reference_logits(model, ids, keep=keep)[0],
                                   atol=ATOL, rtol=0)
    valid = torch.ones_like(ids, dtype=torch.bool)
    grads = _new_module_grads(model, model(ids, keep=keep).logits, ids, valid)
    ref = _new_module_grads(model, reference_logits(model, ids, keep=keep)[0], ids, valid)
    assert "concept_gate.gate" in grads
    for key in grads:
        torch.testing.assert_close(grads[key], ref[key], atol=1e-5, rtol=1e-4, msg=key)
    model.concept_gate.relative = False  # negative control: the reference sees the scale
    with torch.no_grad():
        wrong = model(ids, keep=keep).logits
    model.concept_gate.relative = True
    with torch.no_grad():
        assert (wrong - reference_logits(model, ids, keep=keep)[0]).abs().max() > 100 * ATOL


def test_identity_scaled_decoding_equals_teacher_forcing():
    from tests.test_decoding import prompts

    model = mix_decisions(scaled())
    gen = assert_decoding_matches_teacher_forcing(model, prompts(), 24)
    decisions = [k for row in gen.keep for k in row]
    assert 0 < sum(decisions) < len(decisions)


def test_bad_concept_input_is_reported():
    with pytest.raises(concept.ConfigError, match="concept_input"):
        concept.resolve(tiny_config(concept_input="shallow"))


# -- tail fusion: exact against the naive reference ---------------------------------------------------

ONE_PASS = [("update", backend) for backend in ("sdpa", "chunked", "flex")] + [("bridge", "chunked"),
                                                                                ("bridge-linear", "sdpa")]


@pytest.mark.parametrize("fusion,backend", ONE_PASS)
@pytest.mark.parametrize("name", ["none", "all", "first", "runs", "rate-0.5"])
def test_fusion_one_pass_matches_naive(fusion, backend, name):
    model = fused(fusion, attention=backend)
    ids, keep = inputs(), pattern(name)[None]
    with torch.no_grad():
        out = model(ids, keep=keep)
        ref, _ = reference_logits(model, ids, keep=keep)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fusion", ["update", "bridge"])
def test_negative_control_a_wrong_fusion_in_the_model_is_caught(fusion, monkeypatch):
    """The oracle fuses the tail from the rule's definition, not through the module: a module whose
    update is off by 0.1 disagrees with it (were the oracle to call the module, both would move)."""
    model = fused(fusion)
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        ref, _ = reference_logits(model, ids, keep=keep)
        torch.testing.assert_close(model(ids, keep=keep).logits, ref, atol=ATOL, rtol=0)
        module = type(model.tail_fusion)
        right = module.forward
        monkeypatch.setattr(module, "forward", lambda self, tail, update, has: right(self, tail, update + 0.1, has))
        wrong = model(ids, keep=keep).logits
        assert (wrong - reference_logits(model, ids, keep=keep)[0]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("fusion,positions", [("update", "per-type"), ("bridge", "time"), ("bridge-linear", "per-type")])
def test_fusion_padded_batch_and_gradients_match_naive(fusion, positions):
    from tests.test_equivalence import _new_module_grads

    model = fused(fusion, attention="chunked", positions=positions)
    ids, mask, keep = padded_batch()
    valid = mask.bool()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, keep=keep)
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)
    torch.testing.assert_close(out.logits[valid], ref[valid], atol=ATOL, rtol=0)
    grads = _new_module_grads(model, model(ids, attention_mask=mask, keep=keep).logits, ids, valid)
    ref_grads = _new_module_grads(model, reference_logits(model, ids, attention_mask=mask, keep=keep)[0], ids, valid)
    assert set(grads) == set(ref_grads)
    if fusion.startswith("bridge"):
        assert any(n.startswith("tail_fusion") for n in grads), "the bridge must get gradients"
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("fusion", ["update", "bridge"])
def test_fusion_never_crosses_packed_documents(fusion):
    """A document's tail before its first concept gets no update from the previous document's concept."""
    model = fused(fusion, attention="chunked")
    keep = torch.tensor([[0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    assert_packed_documents_equal_separate_rows(model, inputs(B=1, T=16, seed=7), keep)


def test_fusion_changes_the_logits_of_tail_tokens_only():
    """Negative control: the update really reaches the tail (and only the tail)."""
    plain = concept.build(tiny_config())
    fusing = concept.build(tiny_config(tail_fusion=ComponentRef("update")))
    fusing.load_state_dict(plain.state_dict(), strict=False)
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        a, b = plain(ids, keep=keep).logits, fusing(ids, keep=keep).logits
    seg = torch.cumsum(keep.long(), 1)
    tail_after_concept = ~keep & (seg > 0)
    assert (a - b).abs()[tail_after_concept].amax(-1).min() > 100 * ATOL
    torch.testing.assert_close(a[~tail_after_concept], b[~tail_after_concept], atol=ATOL, rtol=0)


def test_a_fresh_bridge_is_its_base_rule():
    """Zero-initialised output: a new bridge equals `update` (base=update) exactly."""
    update = concept.build(tiny_config(tail_fusion=ComponentRef("update")))
    bridge = concept.build(tiny_config(tail_fusion=ComponentRef("bridge")))
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        torch.testing.assert_close(bridge(ids, keep=keep).logits, update(ids, keep=keep).logits, atol=0, rtol=0)


def test_bad_bridge_options_are_reported_at_once():
    with pytest.raises(concept.ConfigError) as err:
        concept.resolve(tiny_config(tail_fusion=ComponentRef("bridge", {"base": "x", "hidden": -1})))
    assert "base" in str(err.value) and "hidden" in str(err.value)


# -- decoding = teacher forcing --------------------------------------------------------------------

@pytest.mark.parametrize("fusion", ["update", "bridge"])
@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-qwen2"])
def test_fusion_decoding_equals_teacher_forcing(fusion, backbone):
    from tests.test_decoding import prompts

    model = fused(fusion, attention="chunked", backbone=backbone, mixed=True)
    gen = assert_decoding_matches_teacher_forcing(model, prompts(), 24)
    decisions = [k for row in gen.keep for k in row]
    assert 0 < sum(decisions) < len(decisions)


def test_fusion_saves_and_loads(tmp_path):
    model = fused("bridge")
    concept.save(model, tmp_path / "run")
    again = concept.load(tmp_path / "run")
    ids, keep = inputs(), pattern("runs")[None]
    with torch.no_grad():
        torch.testing.assert_close(again(ids, keep=keep).logits, model(ids, keep=keep).logits, atol=0, rtol=0)


def test_a_bridge_pre_trained_alone_moves_the_tail_towards_the_backbones_deep_inputs():
    """`--train-only new --align 1`: the bridge alone is fitted to the backbone's own layer Ls+Lm
    inputs of the tail tokens (a dense per-token target); the alignment loss falls."""
    from concept.objectives import AlignObjective
    from concept.teacher import teacher_forward

    model = concept.build(tiny_config(tail_fusion=ComponentRef("bridge", {"hidden": 32})))
    ids = inputs(B=2, T=16, seed=11)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, 1::4] = True
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "document_ids": None}
    teacher = teacher_forward(model, ids, b["attention_mask"], None, needs={"deep_input"})
    align = AlignObjective(1.0)
    opt = torch.optim.Adam(model.tail_fusion.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = align(model, b, model(ids, keep=keep), teacher)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
