"""The planner-executor's residual stream runs in the backbone's compute dtype, as the streaming model's does
(``tests/test_stream_dtype.py``): with the frozen base stored in bf16 and bf16 autocast, every decoder layer
reads a bf16 hidden state in every part the backbone plays — the planner's prefix ``[u, <PLAN>]``, its steps
(fed one group per forward, or teacher-forced in one), the executor, and decoding's prefill and steps. The
inputs made by trainable fp32 modules (the step embeddings, ``<PLAN>`` / ``<SEP_i>``, the type rows) join the
stream at one point, ``PlannerExecutorModel.run``, cast to its dtype (``stream_dtype``); before, the planner's
steps and the executor ran on an fp32 stream. In fp32 the join is a no-op: the forward is bit-identical to the
one without it. Negative control: without the join, fp32 reaches the layers in each of them."""
from __future__ import annotations

import copy

import pytest
import torch

from concept.backbone import decoder, run_layers
from concept.planner.model import PlannerExecutorModel
from concept.precision import store_frozen_base

from .test_planner_executor import built

pytestmark = pytest.mark.usefixtures("one_thread")


def without_the_join(self, x, position_ids, attention_plan, cache=None):
    """``PlannerExecutorModel.run`` as it was: ``x`` fed in whatever dtype its makers gave it."""
    return run_layers(self.inner.layers, x, position_ids, attention_plan, self.inner.rotary_emb,
                      self.gradient_checkpointing and self.training and cache is None, cache)


@pytest.fixture(scope="module")
def models():
    fp32 = built()
    bf16 = copy.deepcopy(fp32)
    store_frozen_base(bf16, torch.bfloat16)
    return fp32, bf16


def layer_input_dtypes(model) -> dict[str, set]:
    """The dtypes the decoder layers read (over every layer and call), by what ran: a bf16-autocast training
    forward and backward (the planner sampling step by step), the planner teacher-forced, and generation."""
    seen: set = set()

    def hook(module, args, kwargs):
        seen.add((args[0] if args else kwargs["hidden_states"]).dtype)

    hooks = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in decoder(model.backbone).layers]
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    found = {}
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.train()
            torch.manual_seed(0)
            out = model(ids, labels=ids)
            out.loss.backward()
            found["training"], seen = seen, set()
            model(ids, labels=ids, plan=out.plan)
            found["teacher-forced"], seen = seen, set()
            model.eval()
            with torch.no_grad():
                model.generate(ids[:, :6], max_new_tokens=3)
            found["generation"] = seen
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.eval()
    assert out.plan.active.sum(1).min() > 1  # every row planned concepts: the steps ran
    return found


def test_every_planner_and_executor_layer_reads_bf16(models):
    _, bf16 = models
    assert layer_input_dtypes(bf16) == {"training": {torch.bfloat16}, "teacher-forced": {torch.bfloat16},
                                        "generation": {torch.bfloat16}}


def test_negative_control_without_the_join_fp32_reaches_the_layers(models, monkeypatch):
    _, bf16 = models
    monkeypatch.setattr(PlannerExecutorModel, "run", without_the_join)
    assert all(torch.float32 in dtypes for dtypes in layer_input_dtypes(bf16).values())


def test_fp32_is_bit_identical_with_and_without_the_join(models, monkeypatch):
    fp32, _ = models
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))

    def forward():
        torch.manual_seed(0)
        with torch.no_grad():
            out = fp32.train()(ids, labels=ids)
        fp32.eval()
        return out.logits, out.loss

    joined = forward()
    monkeypatch.setattr(PlannerExecutorModel, "run", without_the_join)
    before = forward()
    assert all(torch.equal(a, b) for a, b in zip(joined, before))
