"""The step runner on its own (concept.train_step.StepRunner), with no trainer and no run folder: its steps equal a
naive loop of forward, backward, clip and AdamW step per micro-batch, and the objectives' hooks around a step see a
narrow, frozen StepContext, not the trainer."""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from concept.distributed import Dist
from concept.objectives import Objective, StepContext
from concept.train_step import StepModule, StepRunner, micro_seed
from concept.training import TrainConfig, lr_lambda

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)
VOCAB = 16


class Toy(nn.Module):
    """A model with the training forward's signature: logits and the next-token CE, with dropout (randomness)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out, self.drop = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB), nn.Dropout(0.1)

    def forward(self, input_ids, attention_mask=None, labels=None, document_ids=None):
        logits = self.out(self.drop(self.emb(input_ids)))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return SimpleNamespace(logits=logits, loss=loss)


class Recorder(Objective):
    """A controller that keeps what its hooks see."""
    name, adds_term = "recorder", False

    def __init__(self):
        self.seen = []

    def before_step(self, context):
        self.seen.append(context)


def data(index: int) -> dict:
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "document_ids": torch.zeros_like(ids)}


def config() -> TrainConfig:
    return TrainConfig(steps=3, seq_len=8, batch=2, grad_accum=2, clip=0.5, log_every=1, warmup=1, seed=3)


def parts(cfg):
    torch.manual_seed(0)
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def runner(cfg, objectives=(), batch=data) -> StepRunner:
    """A runner over the eager step module, one process, fp32."""
    model, optimizer, scheduler = parts(cfg)
    forward = StepModule(model, list(objectives), 1.0, nullcontext)
    return StepRunner(cfg, model, forward, list(objectives), optimizer, scheduler, Dist(), torch.device("cpu"),
                      batch=batch, autocast=nullcontext, gathered=nullcontext,
                      diagnostics=lambda model, out, b: {"diagnosed": 1.0}, note=lambda text: None)


def naive(cfg) -> tuple[nn.Module, list[float]]:
    """The reference: each step's micro-batches one by one (each seeded from the step), then clip and step."""
    model, optimizer, scheduler = parts(cfg)
    model.train()
    losses = []
    for step in range(cfg.steps):
        total = 0.0
        for m in range(cfg.grad_accum):
            torch.manual_seed(micro_seed(cfg.seed, step, m))
            out = model(**data(step * cfg.grad_accum + m), labels=data(step * cfg.grad_accum + m)["input_ids"])
            (out.loss / cfg.grad_accum).backward()
            total += float(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / cfg.grad_accum)
    return model, losses


def run(r: StepRunner) -> list[dict]:
    r.queue_step()
    rows = r.read_log()
    r.queue_step(), r.queue_step()
    return rows + r.read_log()


def test_the_runners_steps_equal_a_naive_loop():
    cfg = config()
    reference, losses = naive(cfg)
    r = runner(cfg)
    rows = run(r)
    assert [row["step"] for row in rows] == [1, 2, 3] and r.step == 3 and not r.queued
    assert all(row["diagnosed"] == 1.0 for row in rows)  # the family's step diagnostics (--log-every 1)
    assert [row["loss"] for row in rows] == pytest.approx(losses, rel=1e-12, abs=0)
    for a, b in zip(reference.parameters(), r.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit for bit
    # negative control: a runner that reads the data one batch late trains other weights
    late = runner(cfg, batch=lambda index: data(index + 1))
    run(late)
    assert not all(torch.equal(a, b) for a, b in zip(reference.parameters(), late.model.parameters()))


def test_objectives_see_a_frozen_step_context_not_the_trainer():
    recorder = Recorder()
    r = runner(config(), [recorder])
    run(r)
    seen = recorder.seen
    assert all(type(c) is StepContext for c in seen) and [c.step for c in seen] == [0, 1, 2]
    assert {(c.steps, c.micro_batches) for c in seen} == {(3, 2)} and seen[0].model is r.model
    assert not hasattr(seen[0], "optimizer") and not hasattr(seen[0], "queue_step")  # narrow
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen[0].step = 5
    assert torch.equal(seen[0].batch(4)["input_ids"], data(4)["input_ids"])
    assert seen[0].forward(data(0)).logits.shape == (2, 8, VOCAB)
