"""The compiled streaming model's eager glue: the aten ops of a compiled forward and training step that run outside
its compiled graphs (``benchmarks/glue_ops.py``: the tiny backbone, split 2,2,2, 2 rows x 256 packed tokens,
``--compile layers`` with each graph run by ``aot_eager``), pinned so they cannot grow unseen (docs/benchmarks.md,
"The compiled forward's eager glue, CPU (2026-11-27)"): the ops reaching a dispatch mode by source line (exact
pins), and torch.profiler's aten events outside the graphs (bars). A pin is only ever lowered.

Negative controls: an eager op injected between two stacks is counted (twice: two ops), exactly; an op injected
into every decoder layer is counted by the eager forward (once per layer) and not at all by the compiled one (it
runs inside the layers' graphs).
"""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from benchmarks.glue_ops import counted, measure, profiled_glue
from concept.streaming.stacks import StackRuns

FORWARD = 300  # glue ops dispatched by the compiled forward (349 before the cuts; 325 with the RoPE table in the layer graphs)
PLAIN = 257  # the same forward of the token ids alone (300 before the cuts)
STEP = 723  # glue ops dispatched by the compiled training step (772 before the cuts; 748 with the RoPE table in the graphs)
# torch.profiler's aten events outside the graphs (nested ones too: what the GPU profiles count), at most (929 / 814 /
# 3,169 before the cuts)
PROFILED = {"forward": 830, "plain": 725, "step": 3070}


def test_the_compiled_glue_is_pinned_and_counted_outside_the_graphs_only(tmp_path, fresh_dynamo, one_thread,
                                                                          monkeypatch):
    result = measure(seq_len=256, compile="layers", folder=tmp_path)
    assert counters["stats"]["unique_graphs"] >= 3 and not counters["graph_break"]
    counts = {k: result[k].total for k in ("forward", "plain", "step")}
    pins = {"forward": FORWARD, "plain": PLAIN, "step": STEP}
    assert all(counts[k] <= pins[k] for k in pins), f"glue ops {counts}, over the pins {pins}"
    assert counts == pins, f"glue ops went down, {counts}: lower the pins {pins}"  # (a pin above its count is stale)
    assert all(result["profiled"][k] <= PROFILED[k] for k in pins), f"profiled {result['profiled']}, over {PROFILED}"
    forward = counts["forward"]

    run, model = result["run_forward"], result["trainer"].model.eval()
    # negative control 1: two eager ops between the middle and the deep stack are counted, on their line
    middle = StackRuns.run_middle

    def two_more(self, *args, **kwargs):
        out, updates = middle(self, *args, **kwargs)
        return out.neg().neg_(), updates  # (the same values)

    monkeypatch.setattr(StackRuns, "run_middle", two_more)
    seen = counted(run)
    assert seen.total == forward + 2 and profiled_glue(run) == result["profiled"]["forward"] + 2
    assert sum(n for line, n in seen.by_line.items() if line.startswith("tests/")) == 0  # (ours: concept/, plugins/)
    monkeypatch.setattr(StackRuns, "run_middle", middle)

    # negative control 2: two ops in every decoder layer: counted by the eager forward, not by the compiled one
    layers = list(model.inner.layers)
    compiled_stacks = model.compiled_stacks
    model.compiled_stacks = None
    eager = counted(run).total
    for layer in layers:
        monkeypatch.setattr(layer, "forward", lambda *a, _f=layer.forward, **k: _f(*a, **k).neg().neg_())
    assert counted(run).total == eager + 2 * len(layers)
    model.compiled_stacks = compiled_stacks
    graphs = counters["stats"]["unique_graphs"]
    assert counted(run).total == forward and profiled_glue(run) == result["profiled"]["forward"]
    assert counters["stats"]["unique_graphs"] > graphs  # (the layers' graphs recompiled, the two ops inside)
    assert not counters["graph_break"]


def test_the_counter_sees_every_op_of_an_eager_function():
    """The counter itself: a plain function's ops, by line (a count that cannot be zero by construction)."""
    x = torch.ones(3)
    seen = counted(lambda: x.add(1).mul(2).sum())
    assert seen.total == 3 and seen.by_line == {"(outside the project)": 3}
