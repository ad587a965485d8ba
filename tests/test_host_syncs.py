"""No hidden host syncs (``concept.syncs``): with a static budget, a forward of the streaming model (every
policy, the sdpa and chunked backends) and a training step (streaming, pruned, dense) run no op that forces a
device -> host sync outside the declared points: the policy's host scan (one per forward, for the policies
whose rule is sequential) and the trainer's one read of a step's logged values. Negative controls: an
injected ``.item()``, and the dynamic layout (no budget), are counted."""
import json
import pathlib
import warnings

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.streaming.model import ConceptModel
from concept.syncs import HostSyncs
from concept.training import TrainConfig, Trainer
from tests.conftest import POLICIES, mixed_model
from tests.test_static_shapes import BACKENDS, budgeted

SCANNED = {"null", "threshold", "entropy", "mtp", "mtp-untracked"}  # a sequential rule: one host scan


def count_forward(model, **inputs) -> HostSyncs:
    with torch.no_grad(), HostSyncs() as seen:
        model(**inputs)
    return seen


def forward_inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, 16), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), document_ids=torch.tensor([[0] * 6 + [1] * 10,
                                                                                               [0] * 16]))


@pytest.mark.parametrize("attention", ["sdpa", "chunked"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_static_forward_has_no_hidden_sync(policy, attention):
    with budgeted(mixed_model(policy), 0.25, BACKENDS[attention]) as model:
        seen = count_forward(model, **forward_inputs())
    assert seen.hidden == 0, dict(seen.syncs)
    assert dict(seen.declared) == ({"policy scan": 1} if policy in SCANNED else {})


def test_negative_controls_an_injected_item_and_the_dynamic_layout_are_counted(monkeypatch):
    model = mixed_model("null")
    with budgeted(model, 0.0, BACKENDS["chunked"]):
        assert count_forward(model, **forward_inputs()).hidden > 0  # no budget: the layout's widths are read back
    fuse = ConceptModel.fuse_tail

    def fuse_and_read(self, tail, updates, layout):
        tail.sum().item()  # a data-dependent read slipped into the forward
        return fuse(self, tail, updates, layout)

    with budgeted(model, 0.25, BACKENDS["chunked"]):
        assert count_forward(model, **forward_inputs()).hidden == 0
        monkeypatch.setattr(ConceptModel, "fuse_tail", fuse_and_read)
        seen = count_forward(model, **forward_inputs())
    assert seen.hidden == 1 and dict(seen.syncs) == {"_local_scalar_dense": 1}


STDLIB = pathlib.Path(warnings.__file__).parent


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("syncs")
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}),
                      split="1,2,1", vocabulary=ComponentRef("embedding", {"size": 32}),
                      attention=ComponentRef("chunked", {"chunk": 16}))  # the default budget: auto (0.25 here)
    concept.save(concept.build(cfg), folder / "built")
    return folder


@pytest.mark.parametrize("baseline", [None, "pruned", "dense"])
def test_a_training_step_reads_the_device_once(static_run, baseline, one_thread):
    """Streaming (the default `null` policy with its tracker, the ratio controller and the ratio loss), and the
    pruned and dense baselines of the same build: the second step (the first calibrates the NULL bias)."""
    config = TrainConfig(steps=4, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100, warmup=1,
                         data=str(static_run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2),
                         **({"baseline": baseline} if baseline else {}))
    trainer = Trainer.start(static_run / "built", static_run / f"run-{baseline}", config)
    trainer.train_step()
    with HostSyncs() as seen:
        row = trainer.train_step()
    assert seen.hidden == 0, dict(seen.syncs)
    assert dict(seen.declared) == {"step log": 1, **({} if baseline else {"policy scan": 1})}
    assert row["step"] == 2 and row["loss"] > 0 and row["grad_norm"] > 0
