"""Training: exact resume, dense baseline, ratio control, and failures that keep the last checkpoint."""
import json
import pathlib
import warnings

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.errors import ConceptError, ConfigError, RunFolderError
from concept.training import TrainConfig, Trainer, TrainingError

STDLIB = pathlib.Path(warnings.__file__).parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus of small documents (stdlib functions), enough for a held-out split."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = []
    for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py", "fnmatch.py", "glob.py", "copy.py", "abc.py",
                 "string.py", "difflib.py", "calendar.py", "ftplib.py"):
        docs += [chunk for chunk in (STDLIB / name).read_text().split("\ndef ") if len(chunk) > 200]
    with open(folder / "code.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return folder / "code.jsonl"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}),
                      split="1,2,1", vocabulary=ComponentRef("embedding", {"size": 32}),
                      attention=ComponentRef("chunked", {"chunk": 16}))
    concept.save(concept.build(cfg), out)
    return out


def small(**kw):
    base = dict(steps=6, seq_len=32, batch=2, eval_every=3, eval_batches=1, checkpoint_every=3, log_every=2,
                warmup=2, lora=concept.lora.LoraSettings(rank=2))
    base.update(kw)
    return TrainConfig(**base)


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_interrupted_and_resumed(built, out, config) -> None:
    """A run stopped by Ctrl-C after step 3 (the checkpoint is written on the way out), then resumed to its end."""
    first = Trainer.start(built, out, config)

    def interrupt_at_three(row):
        if row["step"] == 3:
            first.loop.on_sigint(None, None)

    with pytest.raises(KeyboardInterrupt):
        first.train(progress=interrupt_at_three)
    again = Trainer.resume(out)
    assert again.step == 3
    again.train()


def test_resume_reproduces_the_uninterrupted_run_exactly(built, corpus, tmp_path):
    straight = Trainer.start(built, tmp_path / "straight", small(data=str(corpus)))
    straight.train()
    train_interrupted_and_resumed(built, tmp_path / "resumed", small(data=str(corpus)))
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")  # bit for bit
    a, b = concept.load(tmp_path / "straight"), concept.load(tmp_path / "resumed")
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)


def test_resume_from_a_ctrl_c_between_scheduled_checkpoints_is_exact(built, corpus, tmp_path):
    """Ctrl-C at step 3 of a run that checkpoints every 4 steps: the checkpoint written on the way out
    (not a scheduled one) resumes to the uninterrupted run, bit for bit."""
    cfg = dict(data=str(corpus), checkpoint_every=4)
    Trainer.start(built, tmp_path / "straight", small(**cfg)).train()
    train_interrupted_and_resumed(built, tmp_path / "resumed", small(**cfg))
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


@pytest.fixture(scope="module")
def straight_run(built, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    Trainer.start(built, out, small(data=str(corpus))).train()
    return out


def _optimizer_not_restored(monkeypatch):
    import torch.distributed.checkpoint.state_dict as state_dict

    monkeypatch.setattr(state_dict, "set_optimizer_state_dict", lambda *args, **kwargs: None)


def _scheduler_not_restored(monkeypatch):
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "load_state_dict", lambda self, state: None)


def _randomness_not_a_function_of_the_step(monkeypatch):
    """The micro-batch seed drawn from a counter of this process (so a resumed process starts it again)."""
    import itertools

    import concept.train_step as train_step

    counter = itertools.count()
    monkeypatch.setattr(train_step, "micro_seed", lambda seed, step, micro: seed + next(counter))


@pytest.mark.parametrize("broken", [_optimizer_not_restored, _scheduler_not_restored,
                                    _randomness_not_a_function_of_the_step])
def test_negative_control_resume_catches_state_that_is_not_restored(built, corpus, tmp_path, straight_run, broken,
                                                                    monkeypatch):
    """Resuming without the optimizer's moments, the scheduler's step or the step's own randomness breaks
    the bit-for-bit agreement the resume tests check."""
    broken(monkeypatch)
    train_interrupted_and_resumed(built, tmp_path / "resumed", small(data=str(corpus)))
    assert losses(straight_run)[:3] == losses(tmp_path / "resumed")[:3] or broken is _randomness_not_a_function_of_the_step
    assert losses(straight_run) != losses(tmp_path / "resumed")


def test_trained_run_loads_with_adapters_and_modules(built, corpus, tmp_path):
    trainer = Trainer.start(built, tmp_path / "run", small(data=str(corpus), steps=3, lr=1e-2, lr_new=1e-2))
    trainer.train()
    model = concept.load(tmp_path / "run")
    assert any("lora_" in n for n, _ in model.backbone.named_parameters())
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        trained = model(ids).logits
        untrained = concept.load(built)(ids).logits
    assert not torch.allclose(trained, untrained)
    assert float(model.length_policy.null_bias) != 0.0  # the ratio controller's bias is saved
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


def test_ratio_tracks_the_target(built, corpus, tmp_path):
    trainer = Trainer.start(built, tmp_path / "run", small(data=str(corpus), steps=12, batch=4, target_ratio=0.25,
                                                          eval_every=100, checkpoint_every=100))
    trainer.train()
    ratios = [r["ratio"] for r in trainer.metrics()]
    assert abs(sum(ratios[-6:]) / 6 - 0.25) < 0.05


def test_dense_baseline_trains_and_loads(built, corpus, tmp_path):
    trainer = Trainer.start(built, tmp_path / "dense", small(data=str(corpus), steps=2, baseline=True))
    result = trainer.train()
    assert "nll" in result and "ratio" not in result, (trainer.notes, trainer.metrics())
    model = concept.load(tmp_path / "dense")
    assert type(model).__name__ == "DenseModel"


def test_nan_loss_stops_with_last_checkpoint_intact(built, corpus, tmp_path, monkeypatch):
    trainer = Trainer.start(built, tmp_path / "run", small(data=str(corpus), steps=6))
    real = trainer.model.forward

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        if trainer.step >= 4:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(trainer.model, "forward", poisoned)
    with pytest.raises(TrainingError, match=r"nan at step 5.*checkpoint \(step 3\) is intact"):
        trainer.train()
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 3
    Trainer.resume(tmp_path / "run")  # still resumable


def test_full_disk_keeps_previous_checkpoint(built, corpus, tmp_path, monkeypatch):
    trainer = Trainer.start(built, tmp_path / "run", small(data=str(corpus), steps=6))
    import concept.checkpoint as ckpt

    real = ckpt.save_file
    calls = {"n": 0}

    def flaky(state, path, *a, **k):
        calls["n"] += 1
        if trainer.step >= 6:
            raise OSError(28, "No space left on device")
        return real(state, path, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", flaky)
    with pytest.raises(TrainingError, match="No space left on device.*previous checkpoint \\(step 3\\) is intact"):
        trainer.train()
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 3
    assert not list((tmp_path / "run").glob(".checkpoint-*"))


def test_interrupt_saves_a_checkpoint(built, corpus, tmp_path):
    trainer = Trainer.start(built, tmp_path / "run", small(data=str(corpus), steps=6, checkpoint_every=100))

    def stop_after_two(row):
        if row["step"] == 2:
            trainer.loop.on_sigint(None, None)  # what Ctrl-C does

    with pytest.raises(KeyboardInterrupt):
        trainer.train(progress=stop_after_two)
    # the log is read one step late: the stop comes after the step whose row asked for it, or the one queued next
    assert trainer.step in (2, 3)
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == trainer.step
    assert Trainer.resume(tmp_path / "run").step == trainer.step


def test_bad_training_input(built, corpus, tmp_path):
    with pytest.raises(ConfigError, match="above the backbone's maximum"):
        Trainer.start(built, tmp_path / "a", small(data=str(corpus), seq_len=10**6))
    assert not (tmp_path / "a").exists()  # nothing half-written
    (tmp_path / "short.txt").write_text("def f():\n    return 1\n")
    with pytest.raises(ConceptError, match="fewer than one sequence"):
        Trainer.start(built, tmp_path / "b", small(data=str(tmp_path / "short.txt"), seq_len=512))
    with pytest.raises(ConceptError, match="does not exist"):
        Trainer.start(built, tmp_path / "c", small(data=str(tmp_path / "missing")))
    if not torch.cuda.is_available():  # the adapters' Triton kernels run on CUDA: refused before anything is written
        with pytest.raises(ConfigError, match="--lora-kernel triton runs on CUDA devices.*--lora-kernel matmuls"):
            Trainer.start(built, tmp_path / "e", small(data=str(corpus),
                                                       lora=concept.lora.LoraSettings(rank=2, kernel="triton")))
        assert not (tmp_path / "e").exists()
    # --lora-kernel auto is never refused: the Triton kernels where they run, the matmuls here
    Trainer.start(built, tmp_path / "d", small(data=str(corpus), steps=3,
                                               lora=concept.lora.LoraSettings(rank=2, kernel="auto"))).train()
    assert json.loads((tmp_path / "d" / "train.json").read_text())["lora"]["kernel"] == "auto"
    with pytest.raises(ConfigError, match="seq_len: the run was trained with 32"):
        Trainer.resume(tmp_path / "d", seq_len=64)
    # how the adapters compute may change on resume, as the device may: a run trained with the Triton kernels (on a
    # GPU: its train.json says so) resumes here with the matmuls, and without them is refused before it writes
    saved = json.loads((tmp_path / "d" / "train.json").read_text())
    saved["lora"]["kernel"] = "triton"
    (tmp_path / "d" / "train.json").write_text(json.dumps(saved))
    if not torch.cuda.is_available():
        before = {p: p.read_bytes() for p in (tmp_path / "d").rglob("*") if p.is_file()}
        with pytest.raises(ConfigError, match="--lora-kernel triton runs on CUDA devices"):
            Trainer.resume(tmp_path / "d")
        assert {p: p.read_bytes() for p in (tmp_path / "d").rglob("*") if p.is_file()} == before
    resumed = Trainer.resume(tmp_path / "d", **{"lora.kernel": "matmuls"})
    assert resumed.config.lora.kernel == "matmuls"
    resumed.release()  # (its lock: held until training ends)
    with pytest.raises(RunFolderError, match="not empty"):
        Trainer.start(built, tmp_path / "d", small(data=str(corpus)))


def test_final_calibration_hits_the_target_on_training_batches(built, corpus, tmp_path):
    """At the end, the NULL bias is bisected so the realised ratio (forced concepts included) is the target."""
    cfg = small(data=str(corpus), steps=2, target_ratio=0.3, calibration_batches=8, eval_every=100)
    cfg.batch = 4
    trainer = Trainer.start(built, tmp_path / "run", cfg)
    trainer.train()
    from concept.packing import document_starts

    model, kept, total = trainer.model, 0, 0
    with torch.no_grad():
        for i in range(8):
            b = trainer.batch(trainer.step + i)
            valid = b["attention_mask"].bool()
            keep = model(b["input_ids"], attention_mask=valid, document_ids=b["document_ids"]).keep
            kept, total = kept + int(keep.sum()), total + int(valid.sum())
    assert abs(kept / total - 0.3) < 0.005


def test_training_from_a_trained_run_starts_from_its_weights(built, corpus, tmp_path):
    first = Trainer.start(built, tmp_path / "first", small(data=str(corpus), steps=2, lr=1e-2, lr_new=1e-2))
    first.train()
    second = Trainer.start(tmp_path / "first", tmp_path / "second", small(data=str(corpus), steps=1))
    ids = torch.randint(0, 256, (1, 16))
    trained = concept.load(tmp_path / "first")
    second.model.eval()
    with torch.no_grad():  # before any step, the new run is exactly the trained model (adapters and modules)
        torch.testing.assert_close(second.model(ids).logits, trained(ids).logits, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="continues those adapters"):
        Trainer.start(tmp_path / "first", tmp_path / "third", small(data=str(corpus), steps=1,
                                                                   lora=concept.lora.LoraSettings(rank=3)))
