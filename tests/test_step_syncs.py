"""No host sync hidden in a training step of a run on several ranks or with a teacher, or in a decoded token
(``concept.syncs``, issue 39).

* Several ranks: the ranks agree on a Ctrl-C that one of them saw through the step's own sums (the flag summed
  over the ranks on the device with the step's logged values, read with the step log): no per-step collective
  read back. Counted in one process on torch's fake process group (a 2-rank world whose collectives do nothing;
  ``Dist`` as under torchrun, without the DDP wrapper); the real 2-process runs are ``tests/test_distributed.py``.
* The teacher (``--distill``, ``--align``, ``--mtp``): timed with CUDA events read with the step log, its mask
  built without looking at the data, the terms masked means.
* The dynamic decoder: one declared read of the step's tokens per decoded token (the host ends the rows).
"""
import time

import pytest
import torch
import torch.distributed as td

import concept
from concept.distributed import Dist
from concept.generation import generate
from concept.streaming.decoding import ConceptDecoder
from concept.syncs import HostSyncs, declared
from concept.training import TrainConfig, Trainer

from .conftest import mixed_model
from .test_host_syncs import static_run  # noqa: F401  (a tiny default build and its corpus)

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeRanks(Dist):
    """Rank 0 of a 2-rank world on torch's fake process group: every collective runs (and is counted), none
    moves data."""

    @property
    def active(self) -> bool:
        return True


@pytest.fixture
def two_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    td.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield FakeRanks(mode="none", rank=0, world_size=2)
    finally:
        td.destroy_process_group()


def loop_counted(trainer, monkeypatch) -> HostSyncs:
    """``TrainingLoop.loop`` to the end under the counter, its checkpoint a declared point (it reads everything)."""
    save = trainer.save_checkpoint

    def declared_save():
        with declared("checkpoint"):
            save()

    monkeypatch.setattr(trainer, "save_checkpoint", declared_save)
    with HostSyncs() as seen:
        trainer.loop.loop(None)
    return seen


def ranked_trainer(static_run, dist, name):  # noqa: F811
    config = TrainConfig(steps=5, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=2, warmup=1,
                         data=str(static_run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2), baseline="dense")
    trainer = Trainer.start(static_run / "built", static_run / name, config, force=True, dist=dist)
    trainer.train_step()  # (the first step calibrates the NULL bias, and the data's first epoch is shuffled)
    return trainer


def test_the_ranks_agree_on_stopping_without_a_sync_per_step(static_run, two_ranks, monkeypatch):  # noqa: F811
    trainer = ranked_trainer(static_run, two_ranks, "ranks")
    assert trainer.dist.world_size == 2 and td.get_world_size() == 2
    seen = loop_counted(trainer, monkeypatch)
    assert seen.hidden == 0, dict(seen.syncs)
    # steps 2-5: the log read at step 3 (one step late, every --log-every 2) and at the end, before the checkpoint
    assert dict(seen.declared) == {"step log": 2, "step diagnostics": 2, "checkpoint": 1} and trainer.step == 5


def test_negative_control_a_collective_read_every_step_is_counted(static_run, two_ranks, monkeypatch):  # noqa: F811
    """What the loop did before: ``Dist.any(flag)``, an all-reduce of a tensor made from the flag, read back."""
    trainer = ranked_trainer(static_run, two_ranks, "ranks-read")
    queue = Trainer.queue_step

    def queue_and_agree(self):
        queue(self)
        self.loop.stopping = self.dist.sum([float(self.runner.interrupted)])[0] > 0

    monkeypatch.setattr(Trainer, "queue_step", queue_and_agree)
    seen = loop_counted(trainer, monkeypatch)
    assert dict(seen.syncs) == {"tensor from host data": 4, "tolist": 4}


def test_a_ctrl_c_on_one_rank_stops_every_rank_at_the_next_log_read(static_run, two_ranks, monkeypatch):  # noqa: F811
    """Alone, the trainer stops after the step a Ctrl-C came in (``tests/test_objectives.py``); on several ranks at
    the next read of the log: step 3 for a Ctrl-C in step 2 (the flag, summed over the ranks with step 2's values,
    is read there by every rank alike); the steps' logs are read and a checkpoint written on the way out."""
    trainer = ranked_trainer(static_run, two_ranks, "ctrl-c")
    queue = Trainer.queue_step

    def ctrl_c_at_step_2(self):
        if self.step == 1:  # (while step 2 is queued)
            self.loop.on_sigint(None, None)
        queue(self)

    monkeypatch.setattr(Trainer, "queue_step", ctrl_c_at_step_2)
    seen = loop_counted(trainer, monkeypatch)
    assert seen.hidden == 0 and trainer.loop.stop and not trainer.runner.queued
    assert trainer.step == 3 and seen.declared["checkpoint"] == 1
    assert concept.checkpoint.read_meta(trainer.out)["step"] == trainer.step


# -- the teacher (--distill, --align, --mtp) -------------------------------------------------------------------
def teacher_trainer(static_run, baseline, name, **objectives):  # noqa: F811
    config = TrainConfig(steps=8, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100, warmup=1,
                         data=str(static_run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2),
                         **({"baseline": baseline} if baseline else {}), **objectives)
    trainer = Trainer.start(static_run / "built", static_run / name, config, force=True)
    trainer.train_step()  # (the first step calibrates the NULL bias, and the data's first epoch is shuffled)
    return trainer


TEACHER_RUNS = {"streaming": (None, dict(distill=1.0, align=0.5)),  # align at the deep input's tail positions
                "dense": ("dense", dict(distill=1.0, align=0.5, align_at="final", mtp=0.5, mtp_heads=2))}


@pytest.mark.parametrize("kind", list(TEACHER_RUNS))
def test_a_step_with_the_teacher_reads_nothing(static_run, kind):  # noqa: F811
    """The teacher's forward and the distillation, alignment and MTP terms (masked means, no boolean indexing)
    make no host sync; the teacher's time (``TeacherClock``) is read with the step log."""
    baseline, objectives = TEACHER_RUNS[kind]
    trainer = teacher_trainer(static_run, baseline, f"teacher-{kind}", **objectives)
    with HostSyncs() as seen:
        trainer.queue_step()
    assert seen.hidden == 0, dict(seen.syncs)
    assert dict(seen.declared) == ({} if baseline else {"policy scan": 1})
    row, = trainer.read_log()
    assert row["distill_kl"] > 0 and row["align"] > 0 and row["teacher_s"] > 0 and 0 < row["teacher_fraction"] < 1
    assert row.get("mtp", 1) > 0


def test_negative_control_the_boolean_indexed_distillation_is_counted(static_run, monkeypatch):  # noqa: F811
    """The distillation term as it was: ``bool(pair.any())`` and ``logits[pair]`` (a data-dependent shape)."""
    from concept.objectives import DistillObjective, next_token_pairs, valid_mask

    def indexed(self, model, batch, out, teacher=None):
        pair = next_token_pairs(valid_mask(batch), batch.get("document_ids"))
        if not bool(pair.any()):
            return torch.zeros(())
        student = torch.log_softmax(out.logits[:, :-1][pair].float(), -1)
        target = torch.log_softmax(teacher.logits[:, :-1][pair].float(), -1)
        return torch.nn.functional.kl_div(student, target, log_target=True, reduction="batchmean")

    trainer = teacher_trainer(static_run, "dense", "teacher-indexed", distill=1.0)
    monkeypatch.setattr(DistillObjective, "__call__", indexed)
    with HostSyncs() as seen:
        trainer.queue_step()
    assert dict(seen.syncs) == {"_local_scalar_dense": 1, "index": 2, "index_put": 1}  # (index_put: its backward)


class StandInEvent:
    """``torch.cuda.Event`` on a CPU: records the host clock; its time can be read only after ``done``."""
    done = False

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        assert StandInEvent.done, "read before the step's log: would have to wait for the device"
        return (end.at - self.at) * 1000


def test_the_teacher_clock_on_cuda_times_with_events_read_later(monkeypatch):
    """No ``torch.cuda.synchronize`` (it raises here); the events' milliseconds are read by ``float`` only, and the
    forwards of a step's micro-batches add up."""
    from concept.teacher import TeacherClock

    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the teacher stopped the host"))
    total = 0.0
    for _ in range(2):
        clock = TeacherClock("cuda")
        with clock.timing():
            time.sleep(0.01)
        total = total + clock
    assert len(total.spans) == 2
    StandInEvent.done = True
    try:
        assert 0.02 <= float(total) < 1.0
    finally:
        StandInEvent.done = False


# -- the dynamic decoder (concept.generation's eager loop, concept.streaming.decoding, concept.kv_cache) -----------
def count_generate(model, new_tokens: int) -> HostSyncs:
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as seen:
        out = generate(model, ids, max_new_tokens=new_tokens, eos_token_id=None)
    assert out.steps == new_tokens - 1
    return seen


def per_token(model) -> tuple[int, dict]:
    """(hidden syncs, declared points) of 4 more decoded tokens: a prompt's prefill and the final statistics are
    the same in both runs."""
    short, long = count_generate(model, 2), count_generate(model, 6)
    return long.hidden - short.hidden, dict(long.declared - short.declared)


@pytest.fixture(scope="module")
def streaming_model():
    return mixed_model("null").eval()


def test_the_dynamic_decoder_reads_the_tokens_once_per_step(streaming_model):
    """Per decoded token two declared reads (every row's token: the host decides when a row ends; whether any row
    emits a concept: the eager step skips the middle stack otherwise) and nothing hidden: the decisions and the
    longest tail are read when asked, the KV caches look whether to grow only when they cannot vouch for the step."""
    hidden, declared_points = per_token(streaming_model)
    assert declared_points.pop("cache growth check", 0) <= 1  # (the middle cache's first step may come later)
    assert hidden == 0 and declared_points == {"decoded tokens": 4, "decoder concept check": 4}


def test_negative_control_a_read_in_the_decoder_step_is_counted(streaming_model, monkeypatch):
    """The decisions read back as they are made (the step's ``keep.tolist()``, as it was)."""
    step = ConceptDecoder.step

    def step_and_read(self, tokens, active=None):
        logits = step(self, tokens, active)
        self._fed[-1][0].tolist()
        return logits

    monkeypatch.setattr(ConceptDecoder, "step", step_and_read)
    hidden, _ = per_token(streaming_model)
    assert hidden == 4
