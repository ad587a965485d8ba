"""aten ops and host syncs per forward and per training step, counted on the CPU (``concept.profiling``).

    .venv/bin/python -m pytest benchmarks/test_op_counts.py                # the tiny backbone (seconds)
    .venv/bin/python -m pytest benchmarks/test_op_counts.py --smollm2      # + the default build on SmolLM2

On a GPU every aten op is at least one kernel launch and every host sync stalls the launch queue: the
first lease measured the streaming model's training step at 0.379 s of wall time for 0.235 s of device
time, with 38,978 aten ops (docs/benchmarks.md). These counts are that cost's CPU proxy, and they need no
GPU: the streaming model, its FLOP-matched pruned baseline and the dense baseline of the GPU kit's recipe
(``benchmarks/gpu_kit/recipe.py``: the default build at 0.125 concepts per token, `make demo`'s learning
rates), each started by the trainer as ``concept train`` starts it:

* **forward**: one row of ``FORWARD_T`` tokens, no gradient, the length policy deciding; also the HF
  backbone's own forward (what a user of the plain model runs);
* **training step**: ``Trainer.queue_step`` (forward, loss, backward, clipping, the non-finite guard, the
  optimizer, the scheduler, the ratio controller; its log is read after, uncounted) on the recipe's rows (``STEP_BATCH`` x the recipe's length), in fp32 and under bf16 autocast
  (the GPU's precision: its casts count, and ``frozen_weight_casts`` counts the copies whose source is a
  frozen weight), the second step (the first one creates the optimizer's state).
  Host syncs asked for by ``torch.optim`` are counted apart (``syncs_outside_optimizer``): the trainer's
  AdamW is fused (its step counters on the device, none read), but a non-fused Adam reads its host counters.

The smoke run (``--benchmark-disable``, what ``make test`` runs) counts the streaming model in fp32 only.

Ops are counted where Python's dispatch sees them (``OpCounter``): the profiler's count on the GPU also
holds the ops that other ops call, so the two differ; compare counts of one kind only.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import concept
from concept.profiling import OpCounter
from concept.training import Trainer

from .conftest import COUNTS
from .gpu_kit import recipe

MODELS = {"streaming": None, "pruned": "pruned", "dense": "dense"}
# torch.optim's Adam reads its step counters with .item(): CPU tensors on a GPU too (not capturable), so no
# device sync there; the rows count them apart
OPTIMIZER = "torch/optim/"
FORWARD_T = {"tiny-llama": 512, "smollm2": 2048}
STEP_BATCH = {"tiny-llama": 2, "smollm2": 4}


@pytest.mark.parametrize("backbone", ["tiny-llama", "smollm2"])
def test_op_and_sync_counts(request, tmp_path, backbone):
    if backbone == "smollm2" and not request.config.getoption("--smollm2"):
        pytest.skip("pass --smollm2 to run the real-backbone cases")
    dry = backbone == "tiny-llama"
    source = tmp_path / "build"
    concept.save(concept.build(recipe.build_config(dry)), source)
    smoke = request.config.getoption("benchmark_disable", default=False)  # `make test`: one model, fp32
    for kind, baseline in list(MODELS.items())[:1 if smoke else None]:
        for precision in ("fp32",) if smoke else ("fp32", "bf16"):
            config = recipe.train_config(dry, steps=10, batch_size=STEP_BATCH[backbone], baseline=baseline,
                                         device="cpu", eval_every=10**6, eval_batches=1, checkpoint_every=10**6,
                                         log_every=10**6, calibration_batches=0)
            config.dtype = precision
            out = tmp_path / f"{kind}-{precision}"
            trainer = Trainer.start(source, out, config)
            trainer.train_step()  # the first step (optimizer state, caches) is not the steady one
            casts = FrozenCasts(trainer.model)
            with OpCounter(on_op=casts) as step:
                trainer.queue_step()
            trainer.read_log()  # (its log, read after: one read serves several steps)
            step.frozen_weight_casts = casts.count
            counts = {"step": step}
            if precision == "fp32":
                counts["forward"] = count_forward(trainer.model, FORWARD_T[backbone])
                if kind == "dense":
                    counts["forward of the HF backbone"] = count_forward(trainer.model.backbone, FORWARD_T[backbone])
            for what, counter in counts.items():
                label = what if what != "step" else f"training step ({precision})"
                tokens = FORWARD_T[backbone] if what != "step" else STEP_BATCH[backbone] * recipe.seq_len(dry)
                COUNTS.append({"backbone": backbone, "what": label, "model": kind, "tokens": tokens,
                               **counter.summary(), "syncs_outside_optimizer": counter.syncs_outside(OPTIMIZER),
                               "frozen_weight_casts": getattr(counter, "frozen_weight_casts", None)})
            del trainer
            shutil.rmtree(out)
    rows = [r for r in COUNTS if r["backbone"] == backbone]
    assert all(r["aten_ops"] > 0 for r in rows) and {r["model"] for r in rows} == set(list(MODELS)[:1 if smoke else None])


class FrozenCasts:
    """An ``OpCounter`` hook: the copies (``_to_copy``, ``copy_``) whose source is a frozen weight of ``model``
    (what autocast does to an fp32 base every step)."""

    def __init__(self, model):
        self.frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
        self.count = 0

    def __call__(self, func, args, kwargs, out):
        name = str(func.overloadpacket)
        source = args[0] if name == "aten._to_copy" else args[1] if name == "aten.copy_" and len(args) > 1 else None
        if isinstance(source, torch.Tensor) and source.data_ptr() in self.frozen:
            self.count += 1


def count_forward(model, T: int) -> OpCounter:
    """One forward of a row of ``T`` random tokens (a warm-up call first), counted."""
    model.eval()
    vocab = (model.backbone if hasattr(model, "backbone") else model).config.vocab_size
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        with OpCounter() as counter:
            model(ids)
    return counter
