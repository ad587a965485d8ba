"""bf16 on the CPU: the autocast path a GPU run takes (``--dtype bf16``; ``auto`` on CUDA), proven before a
GPU is lent. Every backend with masks and padding against the fp32 naive reference, fully masked rows,
decoding against teacher forcing, and training that resumes exactly.

bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); through a 6-layer tiny model the logits
move by a few tenths of a percent of their range, so the tolerance is 3% of the reference logits' range,
and the negative controls show that a real error (another decision pattern) is far outside it.
"""
import json

import pytest
import torch

from concept.training import Trainer
from tests.conftest import mixed_model
from tests.reference import reference_logits
from tests.test_equivalence import FORWARD_BACKENDS, padded_batch, pattern
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)

TOLERANCE = 0.03  # of the reference logits' range


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def within(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of ``out`` as a fraction of the range of ``ref``."""
    return float((out.float() - ref).abs().max() / (ref.max() - ref.min()))


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_every_backend_with_padding_in_bf16_matches_the_fp32_reference(tiny_models, backend):
    model = tiny_models(attention=backend)
    ids, mask, keep = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        ref, _ = reference_logits(model, ids, attention_mask=mask, keep=keep)
        with bf16():
            out = model(ids, attention_mask=mask, keep=keep)
            wrong = model(ids, attention_mask=mask, keep=keep ^ pattern("rate-0.5")[None])
    assert out.logits.dtype == torch.bfloat16  # autocast really ran the model in bf16
    assert torch.isfinite(out.logits).all()
    assert within(out.logits[real], ref[real]) < TOLERANCE
    assert within(wrong.logits[real], ref[real]) > 2 * TOLERANCE  # the tolerance tells a real error apart


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_a_fully_masked_row_gives_no_nan(tiny_models, backend, dtype):
    model = tiny_models(attention=backend)
    ids, mask, keep = padded_batch()
    mask[2] = 0  # a row of padding only
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        out = model(ids, attention_mask=mask, keep=keep)
    assert torch.isfinite(out.logits).all()
    assert not out.keep[2].any()


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "xformers"])
def test_bf16_decoding_equals_teacher_forcing_within_bf16(backend):
    model = mixed_model("fixed", attention=backend)  # decisions by position: bf16 cannot flip them
    prompts = [[5, 17, 3, 44, 9], [8, 2, 61]]
    with torch.no_grad(), bf16():
        gen = model.generate(prompts, max_new_tokens=7, output_logits=True)
        for b, p in enumerate(prompts):
            seq = torch.tensor([p + gen.tokens[b]])
            keep = torch.tensor([gen.keep[b] + [False]])
            forced = model(seq, keep=keep).logits[0].float()
            n = len(gen.tokens[b])
            step = gen.logits[b, :n].float()
            assert within(step, forced[len(p) - 1:len(p) - 1 + n]) < TOLERANCE
            shifted = forced[len(p) - 2:len(p) - 2 + n]  # an off-by-one cache position: caught
            assert within(step, shifted) > 2 * TOLERANCE


def test_bf16_training_is_finite_and_resumes_exactly(built, corpus, tmp_path):  # noqa: F811
    cfg = dict(data=str(corpus), dtype="bf16", steps=4, checkpoint_every=2, eval_every=4)
    straight = Trainer.start(built, tmp_path / "straight", small(**cfg))
    straight.train()
    first = Trainer.start(built, tmp_path / "resumed", small(**cfg))

    def interrupt_at_two(row):
        if row["step"] == 2:
            first._on_sigint(None, None)

    with pytest.raises(KeyboardInterrupt):
        first.train(progress=interrupt_at_two)
    Trainer.resume(tmp_path / "resumed").train()
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert [r["loss"] for r in rows] == [r["loss"] for r in again]  # bit for bit
    fp32 = Trainer.start(built, tmp_path / "fp32", small(**{**cfg, "dtype": "fp32", "steps": 1}))
    fp32.train()
    first_fp32 = json.loads((tmp_path / "fp32" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_fp32 != rows[0]["loss"]  # bf16 really changed the arithmetic
    assert abs(first_fp32 - rows[0]["loss"]) < 0.05 * first_fp32
