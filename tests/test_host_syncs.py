"""No hidden host syncs (``concept.syncs``): with a static budget, a forward of the streaming model (every
policy, the sdpa and chunked backends) and a training step (streaming, pruned, dense) run no op that forces a
device -> host sync outside the declared points: the policy's host scan (one per forward, for the policies
whose rule is sequential); the trainer reads the logged values of several steps at once, outside the steps
(``Trainer.read_log``). Negative controls: an injected ``.item()`` (in a forward, in a step), and the dynamic
layout (no budget), are counted."""
import json
import pathlib
import warnings

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef
from concept.streaming.model import ConceptModel
from concept.streaming import host_scan
from concept.syncs import HostSyncs
from concept.training import StepModule, TrainConfig, Trainer
from plugins.attention import flex
from plugins.attention.cascade import CascadeBackend
from plugins.attention.flex import FlexBackend, FlexConfig
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


def static_trainer(static_run, baseline, name="run"):
    config = TrainConfig(steps=8, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100, warmup=1,
                         data=str(static_run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2),
                         **({"baseline": baseline} if baseline else {}))
    trainer = Trainer.start(static_run / "built", static_run / f"{name}-{baseline}", config)
    trainer.train_step()  # (the first step calibrates the NULL bias)
    return trainer


@pytest.mark.parametrize("baseline", [None, "pruned", "dense"])
def test_a_training_step_reads_nothing_and_its_log_is_read_once_for_several(static_run, baseline, one_thread):
    """Streaming (the default `null` policy with its tracker, the ratio controller and the ratio loss), and the
    pruned and dense baselines of the same build: a step (``queue_step``, the second: the first calibrates the
    NULL bias) makes no hidden sync and no declared one but the streaming policy's scan (the non-finite guard and
    the controller act on the device); ``read_log`` reads three steps' values in one declared sync."""
    trainer = static_trainer(static_run, baseline)
    with HostSyncs() as seen:
        trainer.queue_step()
    assert seen.hidden == 0, dict(seen.syncs)
    assert dict(seen.declared) == ({} if baseline else {"policy scan": 1})
    trainer.queue_step(), trainer.queue_step()
    with HostSyncs() as read:
        rows = trainer.read_log()
    assert read.hidden == 0 and dict(read.declared) == {"step log": 1}
    assert [r["step"] for r in rows] == [2, 3, 4] and all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert not trainer.runner.queued and trainer.read_log() == []


def test_negative_control_an_item_in_the_step_is_counted(static_run, one_thread, monkeypatch):
    trainer = static_trainer(static_run, "dense", "injected")
    forward = StepModule.forward

    def forward_and_read(self, b):
        out = forward(self, b)
        out[1].item()  # the loss read back inside the step
        return out

    monkeypatch.setattr(StepModule, "forward", forward_and_read)
    with HostSyncs() as seen:
        trainer.queue_step()
    assert dict(seen.syncs) == {"_local_scalar_dense": 1} and not seen.declared


def test_the_policy_scan_sends_its_decisions_back_without_another_sync(monkeypatch):
    """The scan's one declared read, and nothing on the way back: its decisions and the trackers' states go to
    the device with ``upload`` (pinned, non-blocking). Negative control: ``torch.tensor(data, device=...)``, which
    the H100 lease of 2026-11-27 counted as 3 more syncs per decided forward, is counted, once per tensor."""
    model = mixed_model("null")
    with budgeted(model, 0.25, BACKENDS["chunked"]):
        seen = count_forward(model, **forward_inputs())
        assert seen.hidden == 0 and dict(seen.declared) == {"policy scan": 1}, dict(seen.syncs)
        monkeypatch.setattr(host_scan, "upload", lambda data, dtype, device: torch.tensor(data, dtype=dtype,
                                                                                        device=device))
        seen = count_forward(model, **forward_inputs())
    assert dict(seen.syncs) == {"tensor from host data": 3}  # keep, and the tracker's two state fields


def test_the_flex_block_mask_is_built_without_a_host_value(monkeypatch):
    """The flex backend's per-forward work outside the kernel (the three ranges per query, torch's
    ``create_block_mask``) reads nothing back and makes no tensor from Python data. Negative control: a
    ``.tolist()`` in the ranges is counted."""
    model = mixed_model("fixed")
    with torch.no_grad(), budgeted(model, 0.25, BACKENDS["chunked"]):
        layout = model(**forward_inputs()).layout
    backend = FlexBackend(FlexConfig(compile=False, block=16))
    with HostSyncs() as seen:
        backend.plan(layout)
    assert seen.ops > 0 and seen.hidden == 0, dict(seen.syncs)
    ranges = flex.slot_ranges
    def ranges_and_read(layout):
        out = ranges(layout)
        for r in out:
            r.tolist()  # a host read slipped into the mask's construction
        return out

    monkeypatch.setattr(flex, "slot_ranges", ranges_and_read)
    with HostSyncs() as seen:
        backend.plan(layout)
    assert dict(seen.syncs) == {"tolist": 3}


def test_cascade_reads_its_tile_plan_once_and_sends_nothing_back_with_a_sync():
    """``cascade``'s tiles have data-dependent widths: its plan reads them in one declared copy ("cascade tile
    plan"); the prefix tiles' rows go back with ``upload`` and the additive bias is filled on the device (both
    were ``torch.tensor(..., device=...)``: 2 syncs per prefix width, 1 per bias dtype on CUDA)."""
    model = mixed_model("fixed")
    with budgeted(model, 0.25, CascadeBackend()):
        seen = count_forward(model, **forward_inputs())
    assert seen.hidden == 0 and dict(seen.declared) == {"cascade tile plan": 1}, dict(seen.syncs)


def test_a_host_tensor_goes_to_cuda_through_pinned_memory_without_waiting(monkeypatch):
    """``concept.syncs.to_device`` on a CUDA device (stand-ins for the pinning and the copy: this CPU has none):
    pinned, then copied with ``non_blocking``; a pinned tensor is not pinned again; on the CPU the tensor as it is.
    On CUDA a plain ``.to(cuda)`` copies from pageable memory and then waits for the stream (``tests/test_cuda.py``
    counts both)."""
    from concept.syncs import to_device

    calls = []

    class OnTheWay:
        def to(self, device, non_blocking=False):
            calls.append(("copy", str(device), non_blocking))
            return "on the device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or OnTheWay())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    assert to_device(torch.ones(2), "cuda:0") == "on the device"
    assert calls == ["pin", ("copy", "cuda:0", True)]
    here = torch.ones(2)
    assert to_device(here, "cpu") is here and len(calls) == 2


def test_the_training_batches_go_through_to_device(static_run, monkeypatch):  # noqa: F811
    import concept.training as training

    moved = []
    monkeypatch.setattr(training, "to_device", lambda t, device: moved.append(str(device)) or t.to(device))
    trainer = static_trainer(static_run, None, "to-device")
    assert len(moved) >= 3  # input ids, attention mask, document ids of the calibrating step
    moved.clear()
    batch = trainer.batch(3)
    assert moved == [str(trainer.device)] * len(batch) == ["cpu"] * 3
    moved.clear()
    trainer.eval_data = trainer.eval_data or trainer.train_data  # (this corpus is too small for a held-out split)
    trainer.evaluate()  # the periodic held-out evaluation's batches too
    assert moved == ["cpu"] * 3 * trainer.config.eval_batches and moved


def eval_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    doc = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    return [{"input_ids": (ids := torch.randint(0, 97, (2, 16), generator=g)), "attention_mask": torch.ones_like(ids),
             "document_ids": doc} for _ in range(n)]


def count_evaluation(model, batches) -> tuple[HostSyncs, dict]:
    from concept.diagnostics import evaluate

    with HostSyncs() as seen:
        result = evaluate(model, batches, bucket=4, controls=False)
    return seen, result


@pytest.mark.parametrize("policy", ["null", "fixed-emit2", "mtp"])
def test_a_held_out_evaluation_reads_its_sums_once_whatever_its_batches(policy):
    """The NLL and its position buckets, the concept statistics and the MTP heads' hits are summed on the device
    (``concept.diagnostics.HeldOutSums``, ``concept.streaming.diagnostics._concept_stats``): four batches read back
    what one does, at the end (before, each batch read about 20 values back: the host waited for the device at each)."""
    with budgeted(mixed_model(policy), 0.25, BACKENDS["chunked"]) as model:
        one, _ = count_evaluation(model, eval_batches(1))
        four, result = count_evaluation(model, eval_batches(4))
    assert four.hidden == one.hidden, (dict(one.syncs), dict(four.syncs))
    assert four.declared["policy scan"] == 4 * one.declared["policy scan"]  # (the forwards' own declared scans)
    assert result["tokens"] == 4 * 29 and sum(result["tokens_by_position"].values()) == result["tokens"]
    assert 0 < result["ratio"] < 1 and ("mtp_accuracy" in result) == (policy == "mtp")


def test_negative_control_a_value_read_each_batch_is_counted(monkeypatch):
    from concept.diagnostics import HeldOutSums

    add = HeldOutSums.add

    def add_and_read(self, nll, pair, valid, doc):
        float(nll.sum())  # a per-batch read slipped into the evaluation
        return add(self, nll, pair, valid, doc)

    model = mixed_model("null")
    with budgeted(model, 0.25, BACKENDS["chunked"]):
        before = count_evaluation(model, eval_batches(1))[0].hidden
        monkeypatch.setattr(HeldOutSums, "add", add_and_read)
        one, four = (count_evaluation(model, eval_batches(n))[0].hidden for n in (1, 4))
    assert four - one == 3 and one == before + 1


def test_the_evaluation_batches_go_through_to_device(monkeypatch):
    """Each held-out batch's three tensors reach the model's device by ``concept.syncs.to_device`` (on CUDA pinned and
    non-blocking: ``test_a_host_tensor_goes_to_cuda_through_pinned_memory_without_waiting``), not a plain ``.to``
    that waits for the batch before."""
    import concept.diagnostics as diagnostics

    moved = []
    monkeypatch.setattr(diagnostics, "to_device", lambda t, device: moved.append(str(device)) or t.to(device))
    model = mixed_model("fixed")
    with budgeted(model, 0.25, BACKENDS["chunked"]):
        count_evaluation(model, eval_batches(2))
    assert moved == ["cpu"] * 6


def selected_stats(m, out, valid) -> dict:
    """The slow reference: the concept statistics over the emitting tokens selected by boolean indexing (what
    ``_concept_stats`` computed before it stopped reading their count back)."""
    K = int(m.vocabulary.size)
    keep = out.keep.bool() & valid
    logp = torch.log_softmax(out.head_logits[keep][:, :K].float(), -1)
    probs = logp.exp()
    cos = torch.nn.functional.cosine_similarity(m.vocabulary.embed_soft(probs).float(),
                                                m.vocabulary.embed_hard(out.concept_ids[keep].clamp(min=0)).float(),
                                                dim=-1, eps=1e-12)
    return {"entropy_sum": float(-(probs * logp).sum()), "max_prob_sum": float(probs.max(-1).values.sum()),
            "cos_sum": float(cos.sum()), "kept": int(keep.sum())}


@pytest.mark.parametrize("policy", ["null", "fixed-emit2", "entropy", "mtp"])
def test_the_concept_statistics_on_the_budgets_rows_equal_those_on_the_emitting_tokens(policy, monkeypatch):
    """``_concept_stats`` computes the head's signals on ``emitting_rows`` (as many a row as the static budget keeps
    boundaries, the emitting tokens first) and masks the rest out: the same sums as selecting the emitting tokens.
    Negative control: rows one short of the budget leave emitting tokens out, and the sums differ."""
    from concept import packing
    from concept.streaming.diagnostics import _concept_stats

    with budgeted(mixed_model(policy), 0.25, BACKENDS["chunked"]) as model, torch.no_grad():
        inputs = forward_inputs()
        out, valid = model(**inputs), inputs["attention_mask"].bool()
        stats, reference = _concept_stats(model, out, valid), selected_stats(model, out, valid)
        assert int(stats["kept"]) == reference["kept"] > 2
        for key in ("entropy_sum", "max_prob_sum", "cos_sum"):
            assert float(stats[key]) == pytest.approx(reference[key], rel=1e-5, abs=1e-5), key
        budget = packing.budget
        most = int(out.keep.sum(1).max())  # (a row's emitting tokens: the rows need at least this many)
        monkeypatch.setattr(packing, "budget", lambda T, ratio, slack=0: most - 1)
        short = _concept_stats(model, out, valid)
        assert float(short["max_prob_sum"]) != pytest.approx(reference["max_prob_sum"], rel=1e-5)
        monkeypatch.setattr(packing, "budget", budget)
