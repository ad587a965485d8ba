"""Integration: the real offline SmolLM2-135M backbone (short sequences)."""
import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from tests.reference import reference_logits

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smol():
    model = concept.build(BuildConfig(split="4,22,4", attention=ComponentRef("chunked", {"chunk": 16})))
    return model


@pytest.fixture(scope="module")
def text_ids(smol):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    ids = smol.tokenizer(text, return_tensors="pt").input_ids[:, :64]
    assert ids.shape[1] == 64
    return ids


def test_backbone_is_the_real_pretrained_model(smol, text_ids):
    """The dense backbone predicts code well (a random model would sit near ln(49152) ~ 10.8 nats)."""
    with torch.no_grad():
        logits = smol.backbone(text_ids).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], text_ids[0, 1:])
    assert smol.backbone.config.num_hidden_layers == 30 and smol.backbone.config.vocab_size == 49152
    assert nll < 2.5


def _keep():
    keep = torch.rand(1, 64, generator=torch.Generator().manual_seed(0)) < 0.25
    keep[0, 0] = True  # first token compressed
    return keep


def test_one_pass_matches_naive_on_smollm2(smol, text_ids):
    """fp32: SmolLM2's logits reach |37|; kernels sum in different orders, so compare relative to scale."""
    keep = _keep()
    with torch.no_grad():
        out = smol(text_ids, keep=keep)
        ref, _ = reference_logits(smol, text_ids, keep=keep)
        wrong, _ = reference_logits(smol, text_ids, keep=keep, deep_positions="packed-index")
    scale = ref.abs().max().item()
    err = (out.logits - ref).abs().max().item()
    assert err / scale < 1e-5
    # negative control: numbering the packed sequence instead of original positions
    wrong_err = (out.logits - wrong).abs().max().item()
    assert wrong_err > 1.0 and wrong_err > 1000 * err


def test_one_pass_matches_naive_on_smollm2_fp64(smol, text_ids):
    """In float64 the one-pass forward and the per-t loop agree to rounding (exact math)."""
    keep = _keep()
    smol.double()
    try:
        with torch.no_grad():
            out = smol(text_ids, keep=keep).logits
            ref, _ = reference_logits(smol, text_ids, keep=keep)
    finally:
        smol.float()
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)


def _decode_and_teacher_force(model, prompt):
    gen = model.generate([prompt], max_new_tokens=24, output_logits=True)
    keep = gen.keep[0]
    with torch.no_grad():
        seq = torch.tensor([prompt + gen.tokens[0]])
        free = model(seq[:, :-1])
        forced = model(seq, keep=torch.tensor([keep + [False]])).logits[0, len(prompt) - 1:-1]
    assert 0 < sum(keep) < len(keep)
    assert free.keep[0].tolist() == keep  # step-wise decisions = batched decisions
    assert gen.kv[0]["bytes"] < gen.kv[0]["dense_bytes"]
    return gen.logits[0], forced


def test_decoding_matches_teacher_forcing_on_smollm2(smol, text_ids):
    """Greedy decoding with the three caches gives the teacher-forced one-pass logits on the real
    backbone: to rounding in float64, and to fp32 accumulation-order noise in float32."""
    prompt = text_ids[0, :24].tolist()
    policy = smol.length_policy
    with torch.no_grad():
        bias = torch.quantile(policy.keep_logit(smol(text_ids).head_logits).flatten(), 0.7)  # ~30% keep
    policy.null_bias += bias
    try:
        decoded, forced = _decode_and_teacher_force(smol, prompt)
        assert (decoded - forced).abs().max().item() / forced.abs().max().item() < 1e-4
        smol.double()
        decoded, forced = _decode_and_teacher_force(smol, prompt)
        torch.testing.assert_close(decoded, forced, atol=1e-9, rtol=0)
    finally:
        smol.float()
        policy.null_bias -= bias


def test_identity_start_keep_all_is_the_backbone_on_smollm2(smol, text_ids):
    """Identity start, every token a concept: the streaming model is SmolLM2 itself (fp32 rounding),
    before training and with LoRA at its init; the purely discrete input is far from it."""
    from concept.lora import LoraSettings, add_lora

    keep = torch.ones_like(text_ids, dtype=torch.bool)  # (more than the default static budget holds: off for it)
    with torch.no_grad(), smol.budget_off():
        dense = smol.backbone(text_ids).logits
        scale = dense.abs().max().item()
        assert (smol(text_ids, keep=keep).logits - dense).abs().max().item() / scale < 1e-5
    lora = concept.build(BuildConfig(split="4,22,4", attention=ComponentRef("chunked", {"chunk": 16}),
                                     tail_fusion=ComponentRef("bridge"), max_ratio="none"))
    add_lora(lora.backbone, LoraSettings())
    discrete = concept.build(BuildConfig(split="4,22,4", concept_input="embedding", max_ratio="none"))
    with torch.no_grad():
        assert (lora(text_ids, keep=keep).logits - dense).abs().max().item() / scale < 1e-5
        assert (discrete(text_ids, keep=keep).logits - dense).abs().max().item() / scale > 1e-2
    with torch.no_grad():  # negative control: the default budget (auto, 0.15625) drops most of the forced concepts
        capped = smol(text_ids, keep=keep)
    assert smol.max_ratio == 0.15625 and int(capped.keep.sum()) == 10 + 6  # ceil(0.15625 * 64) + the slack
    assert (capped.logits - dense).abs().max().item() / scale > 1e-2


def test_mtp_verify_is_greedy_decoding_on_smollm2(text_ids):
    """`mtp` policy with its (untrained: logit-lens) heads drafting; verify keeps only what greedy
    decoding would have produced, and a block through the caches equals single steps."""
    from concept.streaming.decoding import ConceptDecoder

    model = concept.build(BuildConfig(split="4,22,4", attention=ComponentRef("chunked", {"chunk": 16}),
                                      length_policy=ComponentRef("mtp", {"heads": 3, "tau": 0.3, "max_chunk": 8})))
    prompt = text_ids[:, :24].tolist()
    plain = model.generate(prompt, max_new_tokens=12)
    verify = model.generate(prompt, max_new_tokens=12, mtp="verify")
    assert verify.tokens == plain.tokens and 0 < sum(verify.keep[0]) < len(verify.keep[0])
    cont = text_ids[:, 24:30]
    one, block = ConceptDecoder(model), ConceptDecoder(model)
    valid = torch.ones(1, 24, dtype=torch.bool)
    one.prefill(text_ids[:, :24], valid)
    block.prefill(text_ids[:, :24], valid)
    steps = torch.stack([one.step(cont[:, j]) for j in range(6)], 1)
    torch.testing.assert_close(block.extend(cont), steps, atol=1e-4, rtol=1e-4)


def test_demo_reports_the_models_own_numbers(smol, text_ids, monkeypatch, capsys, tmp_path):
    """`python -m concept.recipes.demo`: each number is recomputed here independently of the demo's code."""
    from concept.recipes import demo
    from concept.flops import Shape, forward_flops

    result = demo.compare(smol, text_ids, repeats=1)
    with torch.no_grad():
        dense = smol.backbone(text_ids).logits
        out = smol(text_ids)
    ln2 = torch.log(torch.tensor(2.0)).item()
    dense_bits = torch.nn.functional.cross_entropy(dense[0, :-1], text_ids[0, 1:]).item() / ln2
    concept_bits = torch.nn.functional.cross_entropy(out.logits[0, :-1], text_ids[0, 1:]).item() / ln2
    assert result["dense_bits"] == pytest.approx(dense_bits, rel=1e-5)
    assert result["concept_bits"] == pytest.approx(concept_bits, rel=1e-5)
    assert result["concept_bits"] > result["dense_bits"] + 0.5  # untrained new modules: clearly worse than dense
    assert result["ratio"] == out.keep.float().mean().item() and 0 < result["ratio"] < 1
    shape = Shape.from_hf_config(smol.backbone.config)
    assert result["ideal_speedup"] == forward_flops(shape, smol.split, out.keep[0], out.head_logits.shape[-1]).speedup
    assert result["ideal_speedup"] > 1 and result["dense_s"] > 0 and result["concept_s"] > 0

    monkeypatch.setattr(demo, "load", lambda run: smol)
    monkeypatch.setattr(demo, "compare", lambda model, ids: result)
    assert demo.main(["runs/x", "--tokens", "64"]) == 0
    shown = capsys.readouterr()
    assert f"{result['dense_bits']:.3f}" in shown.out and f"{result['concept_bits']:.3f}" in shown.out
    assert "running 64 tokens of Lib/textwrap.py" in shown.err


def test_demo_refuses_a_backbone_without_a_tokenizer(tmp_path, capsys):
    from concept.recipes import demo

    concept.save(concept.build(BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4}), split="1,2,1")),
                 tmp_path / "tiny")
    assert demo.main([str(tmp_path / "tiny")]) == 1
    assert "no tokenizer" in capsys.readouterr().err
    assert demo.main([str(tmp_path / "missing")]) != 0
