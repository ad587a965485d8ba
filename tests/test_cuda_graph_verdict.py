"""Would inductor run ``--compile model``'s training step as CUDA graphs? Its own checks, asked on a CPU.

Where inductor compiles a graph for CUDA graphs (``triton.cudagraphs``) it first looks for a reason not to, and
where it finds one it runs the graph without them: it counts a skip (``cudagraph_skips``) and logs "skipping
cudagraphs due to ..." (``torch/_inductor/output_code.py``: ``CompiledFxGraph.__init__``, ``post_compile``;
``torch/_inductor/cudagraph_trees.py``: ``check_for_mutation``). Its reasons: an op that cannot be captured (a
host sync, a data-dependent shape), dynamic shapes, an input whose storage is mutated, a non-tensor input, and at
run time a mutated input that is not static (a parameter or buffer keeps its address; anything else is copied into
the graph at each replay, so a mutation of it would be lost). On a CPU the first reason is always the device, so
here that one check answers "none" (``check_lowering_disable_cudagraph``) and inductor's ``cudagraph_post_compile``
records every other verdict instead of building graphs; graph partitioning is off, so the checks see the whole graph.

Checked: the training forward and backward of the streaming model and the no-grad forward of its ratio controller's
calibration (LoRA, the annealed temperature, two steps) have no reason and no mutated input that is not static; inductor counts no skip.
Negative control: a forward that updates an input in place is refused for that mutation. ``slow``:
inductor's C++ compilation of the tiny model takes about a minute here.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch._inductor.config
import torch._inductor.cudagraph_utils
import torch._inductor.output_code
from torch._dynamo.utils import counters

import concept
import concept.compiled
from concept.training import TrainConfig, Trainer
from tests.test_graph_memory import STDLIB, streaming_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


class Verdicts:
    """Inductor's verdict on each graph it compiles for CUDA graphs, the CPU device aside."""

    def __init__(self, monkeypatch):
        self.graphs: list[dict] = []
        monkeypatch.setattr(torch._inductor.output_code, "cudagraph_post_compile", self.record)
        monkeypatch.setattr(torch._inductor.cudagraph_utils, "check_lowering_disable_cudagraph", lambda mapping: None)
        counters.clear()

    def record(self, example_inputs, compiled_graph, cudagraphs, constants, boxed_forward_device_index):
        """In place of building the graphs: what the run-time checks would find."""
        static = set(compiled_graph.fx_kwargs["static_input_idxs"] or ())
        self.graphs.append({"backward": compiled_graph.fx_kwargs["is_backward"],
                            "reasons": list(compiled_graph.cudagraph_info.cudagraph_fail_reasons),
                            "mutated": sorted(set(compiled_graph.mutated_input_idxs) - static),
                            "inputs": len(example_inputs), "static": len(static)})

    def skips(self) -> int:
        return counters["inductor"]["cudagraph_skips"]


@pytest.fixture
def verdicts(monkeypatch):
    """(Inductor's config patched by its own ``patch``: pytest's monkeypatch deletes a config entry on undo. Caches
    off: a graph loaded from the cache is not checked again.)"""
    with torch._inductor.config.patch(graph_partition=False, force_disable_caches=True):
        yield Verdicts(monkeypatch)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_training_step_gives_inductor_no_reason_to_skip_cuda_graphs(tmp_path, monkeypatch, verdicts, dtype):
    """(bf16: under autocast the adapters are cast before the graph, ``WholeForward.cast_adapters``, into buffers
    that keep their addresses: static inputs in place of the adapters, which the graph no longer reads.)"""
    monkeypatch.setattr(concept.compiled, "training_cuda_graphs", lambda device_type, environ=None: True)
    monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", None)  # inductor (the suite's default is aot_eager)
    docs = [c for name in ("textwrap.py", "shlex.py") for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    concept.save(streaming_model(), tmp_path / "built")
    config = TrainConfig(steps=2, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=1, warmup=1,
                         data=str(tmp_path / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2), compile="model",
                         dtype=dtype)
    trainer = Trainer.start(tmp_path / "built", tmp_path / "run", config)
    rows = [trainer.train_step() for _ in range(2)]
    assert rows[0]["tau"] != rows[1]["tau"]  # (the annealed temperature: an input the graph reads, not a constant)
    # (the calibration's no-grad forward, the training forward, its backward)
    assert [g["backward"] for g in verdicts.graphs] == [False, False, True]
    assert all(g["reasons"] == [] and g["mutated"] == [] for g in verdicts.graphs), verdicts.graphs
    assert verdicts.skips() == 0
    for forward in verdicts.graphs[:2]:
        assert 0 < forward["inputs"] - forward["static"] < 8  # (the weights static; the batch's not)
    print(verdicts.graphs)  # (``-s``: the inputs and static inputs of each graph, docs/architecture.md)


def counted(x, calls):
    """Negative control: a forward that counts its calls in a tensor it is given (an input, not a parameter or a
    buffer: not static)."""
    calls.add_(1)
    return x * 2


def test_a_forward_that_mutates_an_input_is_refused(verdicts):
    """(Without gradients AOT autograd keeps the mutation inside the graph, where cudagraph trees would skip it at run
    time; a training graph returns the new value and its runtime wrapper copies it in, outside the graph.)"""
    compiled = torch.compile(counted, fullgraph=True, dynamic=False, options={"triton.cudagraphs": True})
    calls = torch.zeros(())
    with torch.no_grad():
        compiled(torch.ones(4), calls)
    assert calls == 1 and [len(g["mutated"]) for g in verdicts.graphs] == [1], verdicts.graphs
