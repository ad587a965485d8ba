"""The training step reads nothing back (issue 39): the non-finite guard, the ratio controller and the log.

* a step whose loss is not finite is skipped on the device (fused AdamW's ``found_inf``): the weights, the
  optimizer state and the controller stay as they were, the skip is logged and the run stops with the error it
  always gave (negative control: the same run without the guard ends with other weights);
* the PI controller on the device (``PIController.apply_on_device``) gives the host controller's bias bit for bit;
* a short run (its log read one step late, every ``--log-every`` steps) has the loss curve and the NULL bias
  sequence of today's step (the host controller, non-fused AdamW, every step read at once) to fp32 tolerance
  (negative control: a broken device controller does not; ``slow``).
"""
import json
import math

import pytest
import torch

from concept.streaming.objectives import RatioControl
from concept.streaming.ratio import PIController
from concept.training import StepModule, Trainer, TrainingError

from .test_training import built, corpus, small  # noqa: F401  (fixtures)


def state_of(trainer) -> dict[str, torch.Tensor]:
    """The trained weights and the optimizer state (AdamW's moments and step counters), cloned."""
    state = {f"param/{n}": p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    for i, p in enumerate(q for g in trainer.optimizer.param_groups for q in g["params"]):
        state.update({f"adamw/{i}/{k}": v.detach().clone() for k, v in trainer.optimizer.state[p].items()})
    return state


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "no-guard (negative control)"])
def test_a_non_finite_step_is_skipped_on_the_device(built, corpus, tmp_path, monkeypatch, guarded):  # noqa: F811
    config = small(data=str(corpus), steps=6, checkpoint_every=2, log_every=2, eval_every=100)
    trainer = Trainer.start(built, tmp_path / "run", config)
    forward, save, saved = StepModule.forward, Trainer.save_checkpoint, {}

    def nan_at_step_3(self, b):
        out, loss, terms, teacher_s = forward(self, b)
        return out, loss * (math.nan if trainer.step == 2 else 1.0), terms, teacher_s

    def save_and_keep(self):
        saved[self.step] = state_of(self)
        return save(self)

    monkeypatch.setattr(StepModule, "forward", nan_at_step_3)
    monkeypatch.setattr(Trainer, "save_checkpoint", save_and_keep)
    if not guarded:  # the optimizer steps whatever the guard says
        step = trainer.optimizer.step

        def unguarded(*args, **kwargs):
            trainer.optimizer.found_inf = None
            return step(*args, **kwargs)
        trainer.optimizer.step = unguarded
    with pytest.raises(TrainingError, match=r"the loss became nan at step 3; the step was skipped \(the weights and "
                                            r"the optimizer state are those of step 2\) and the last good checkpoint "
                                            r"\(step 2\) is intact"):
        trainer.train()
    # step 4 ran on the device too (the log of step 3 was read at step 4's checkpoint): skipped as well
    assert list(saved) == [2] and trainer.step == 2 and trainer.scheduler.last_epoch == 2
    assert same(state_of(trainer), saved[2]) == guarded
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["skipped"] is True and rows[-1]["total_loss"] is None
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 2


def test_the_device_controller_moves_the_bias_as_the_host_one_bit_for_bit():
    g = torch.Generator().manual_seed(0)

    class Policy:
        null_bias = torch.zeros(())

    host, device, policy = PIController(0.25, ema=1.5), PIController(0.25, ema=1.5), Policy()
    for i in range(20):
        quantile, spread, ratio = torch.randn(3, generator=g, dtype=torch.float64).unbind()
        ratio = ratio.abs() / 3
        skipped = torch.tensor(i % 7 == 6)
        before = (device.ema, device.integral, policy.null_bias.clone())
        device.apply_on_device(policy, quantile, spread, ratio, skipped)
        if skipped:
            assert float(device.ema) == float(before[0]) and float(device.integral) == float(before[1])
            assert torch.equal(policy.null_bias, before[2])
            continue
        bias = host.apply(Policy, float(quantile), float(spread), float(ratio))
        assert float(device.ema) == host.ema and float(device.integral) == host.integral
        assert torch.equal(policy.null_bias, torch.tensor(bias, dtype=torch.float32))
    assert device.state_dict() == host.state_dict()
    # the comparison can fail: a ratio 1e-12 larger moves the bias
    device.apply_on_device(policy, quantile, spread, ratio + 1e-12, torch.tensor(False))
    host.apply(Policy, float(quantile), float(spread), float(ratio))
    assert float(device.integral) != host.integral


class TodaysAdamW(torch.optim.AdamW):
    """The optimizer before the guard: not fused (its step counters on the host), no ``found_inf``."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **{**kwargs, "fused": None})

    def step(self, closure=None):
        self.__dict__.pop("found_inf", None)
        return super().step(closure)


def host_ratio_step(self, model, means, totals, skipped):
    """Today's ratio controller: the step's values read on the host, the bias moved by ``PIController.apply``."""
    means, totals = {k: float(v) for k, v in means.items()}, {k: float(v) for k, v in totals.items()}
    ratio = totals["_kept"] / max(1, totals["tokens"])
    if self.pi is not None and self.tracking:
        self.pi.apply(model.length_policy, means["_quantile"], means["_spread"], ratio)
    return {"ratio": ratio, "target_ratio": self.step_target, "null_bias": means["_null_bias"]}


def broken_ratio_step(self, model, means, totals, skipped):
    """A device controller that forgets its integral (the negative control)."""
    if self.pi is not None:
        self.pi.integral = 0.0
    return real_ratio_step(self, model, means, totals, skipped)


real_ratio_step = RatioControl.device_step
CURVE = ("loss", "total_loss", "grad_norm", "ratio", "null_bias", "ratio_loss")


def curve(built, corpus, out, monkeypatch, controller=None, optimizer=None):  # noqa: F811
    with monkeypatch.context() as patch:
        if controller:
            patch.setattr(RatioControl, "device_step", controller)
        if optimizer:
            patch.setattr(torch.optim, "AdamW", optimizer)
        patch.setattr(Trainer, "plot", lambda self: None)  # (curves.png: not what is compared)
        config = small(data=str(corpus), steps=6, log_every=3, eval_every=100, checkpoint_every=100,
                       calibration_batches=0)
        trainer = Trainer.start(built, out, config)
        trainer.train()
    return [[row[k] for k in CURVE] for row in trainer.metrics()]


@pytest.mark.slow  # three short runs, 15 s + 11 s of fixtures (make test-slow); the default suite keeps the
# device controller's bit-for-bit test above
def test_the_loss_curve_and_the_null_bias_are_todays(built, corpus, tmp_path, monkeypatch):  # noqa: F811
    today = curve(built, corpus, tmp_path / "today", monkeypatch, host_ratio_step, TodaysAdamW)
    now = curve(built, corpus, tmp_path / "now", monkeypatch)
    assert len(now) == len(today) == 6
    assert torch.allclose(torch.tensor(now), torch.tensor(today), rtol=1e-5, atol=0), (now, today)
    broken = curve(built, corpus, tmp_path / "broken", monkeypatch, broken_ratio_step)
    assert not torch.allclose(torch.tensor(broken), torch.tensor(today), rtol=1e-5, atol=0)
