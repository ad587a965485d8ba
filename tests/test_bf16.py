"""bf16 on the CPU: the autocast path a GPU run takes (``--dtype bf16``; ``auto`` on CUDA), proven before a
GPU is lent. Every backend with masks and padding against the fp32 naive reference, fully masked rows,
decoding against teacher forcing, and training that resumes exactly.

Training in bf16 stores the frozen base in bf16 (``concept.precision``): no frozen weight is cast inside a
training step (forward, the distillation teacher, backward and the optimizer step), for every model kind;
LoRA, the new modules and the optimizer state stay fp32; fp32 runs store nothing else; a bf16 run exports
as before. The count is a ``TorchDispatchMode`` (``benchmarks.step_counts.StepCounter``) over
``Trainer.train_step``: every ``_to_copy`` / ``copy_`` (and autocast's own cast ops) whose source is the
storage of a frozen parameter. Its negative control is the storage before issue 39 (an fp32 base under bf16
autocast: autocast re-casts every frozen matrix at every use).

bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); through a 6-layer tiny model the logits
move by a few tenths of a percent of their range, so the tolerance is 3% of the reference logits' range,
and the negative controls show that a real error (another decision pattern) is far outside it.
"""
import json

import pytest
import torch

import concept
from benchmarks.step_counts import StepCounter, frozen_parameters
from concept.precision import frozen_base, store_frozen_base
from concept.training import Trainer
from tests.conftest import mixed_model
from tests.reference import reference_logits
from tests.test_equivalence import FORWARD_BACKENDS, padded_batch, pattern
from tests.test_planner_executor import pe_run  # noqa: F401  (fixture)
from tests.test_planner_executor import small as pe_small
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
            first.loop.on_sigint(None, None)

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


KINDS = ["streaming", "pruned", "dense", "planner-executor"]


def trainer_of(kind, built, pe_run, corpus, out, **extra):  # noqa: F811
    if kind == "planner-executor":
        return Trainer.start(pe_run, out, pe_small(data=str(corpus), dtype="bf16", steps=2, **extra))
    baseline = None if kind == "streaming" else kind
    return Trainer.start(built, out, small(data=str(corpus), dtype="bf16", steps=2, distill=0.5,
                                           baseline=baseline, **extra))


def counted_step(trainer) -> StepCounter:
    """One training step (forward with the teacher, backward, clipping, AdamW) under the counter."""
    counter = StepCounter(frozen_parameters(trainer.model))
    with counter:
        trainer.train_step()
    return counter


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", KINDS)
def test_no_frozen_weight_is_cast_inside_a_bf16_step(kind, built, pe_run, corpus, tmp_path):  # noqa: F811
    trainer = trainer_of(kind, built, pe_run, corpus, tmp_path / kind)
    model = trainer.model
    base = frozen_base(model)
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())  # stored in bf16
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert any("lora_" in n for n, p in model.backbone.named_parameters() if p.requires_grad)
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # LoRA and new modules: fp32
    counter = counted_step(trainer)
    assert counter.total > 1000  # the counter saw the whole step (forward, backward, optimizer)
    assert sum(counter.frozen_casts.values()) == 0, counter.frozen_casts
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert state and all(v.dtype == torch.float32 for v in state)  # the AdamW moments
    assert all(p.dtype == torch.float32 for p in trainable)


@pytest.mark.usefixtures("one_thread")
def test_negative_control_an_fp32_base_under_bf16_autocast_is_cast_every_step(built, corpus, tmp_path,  # noqa: F811
                                                                              monkeypatch):
    """Before issue 39: the frozen base stays fp32 and autocast casts each frozen matrix at each use."""
    import concept.training as training

    monkeypatch.setattr(training, "store_frozen_base", lambda model, dtype: 0)
    trainer = trainer_of("streaming", built, None, corpus, tmp_path / "fp32-base")
    assert all(p.dtype == torch.float32 for p in frozen_base(trainer.model).values())
    casts = counted_step(trainer).frozen_casts
    layers = len(concept.backbone.decoder(trainer.model.backbone).layers)
    assert casts["_to_copy"] >= 7 * layers  # every projection of every layer, at least once


@pytest.mark.usefixtures("one_thread")
def test_fp32_training_stores_and_casts_nothing(built, corpus, tmp_path):  # noqa: F811
    """fp32 (and ``auto`` off CUDA): every weight stays fp32, autocast is off, no weight is cast."""
    trainer = Trainer.start(built, tmp_path / "fp32", small(data=str(corpus), dtype="auto", steps=1))
    assert trainer.dtype == torch.float32 and not trainer.autocast()._enabled
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert store_frozen_base(trainer.model, torch.float32) == 0
    assert all(m.cast_input_dtype_enabled for m in trainer.model.backbone.modules()
               if hasattr(m, "cast_input_dtype_enabled"))  # peft's own behaviour, untouched
    assert sum(counted_step(trainer).frozen_casts.values()) == 0


@pytest.mark.usefixtures("one_thread")
def test_a_bf16_run_exports_merged_as_before(built, corpus, tmp_path):  # noqa: F811
    """The checkpoint holds the fp32 adapters and modules; export loads the run in fp32 and merges there, so
    it writes an fp32 backbone as it did, and its own check (the reloaded export against the run) passes."""
    from safetensors.torch import load_file

    from concept.export import export

    trainer = Trainer.start(built, tmp_path / "run", small(data=str(corpus), dtype="bf16", steps=1, lr=1e-2))
    trainer.train_step()
    trainer.save_checkpoint()
    adapters = load_file(tmp_path / "run" / "checkpoint" / "adapter.safetensors")
    assert adapters and all(v.dtype == torch.float32 for v in adapters.values())
    result = export(tmp_path / "run", tmp_path / "export", merge_lora=True)
    assert result.lora == "merged" and result.check["max_abs_diff"] <= result.check["tolerance"]
    record = concept.builder.read_run(tmp_path / "export")
    assert record["config"]["backbone"]["params"]["dtype"] == "float32"
