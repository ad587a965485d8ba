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

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from benchmarks.glue_ops import counted, measure, profiled_glue
from concept import packing
from concept.compiled import torch_release
from concept.streaming.stacks import StackRuns

FORWARD = 311  # glue ops dispatched by the compiled forward (349 before the cuts; 325 with the RoPE table in the layer graphs;
# 284 after the cuts; 312 since the deep stack runs over its block, which the packing moves its inputs to, 28 ops;
# 311 since the tracker's allowance packs its interval as ``lo * 2**32 + hi``, two ops where ``lo * width + hi + 1``
# took three)
PLAIN = 268  # the same forward of the token ids alone (300 before the cuts; 241 after them, before the deep block;
# 269 with it, 268 with the allowance's two ops)
STEP = 718  # glue ops dispatched by the compiled training step (772 before the cuts; 748 with the RoPE table in the
# graphs; 707 after the cuts, 689 with the loss's chunk arithmetic compiled too; 690 since the sampler's annealed
# temperature is a tensor the schedule fills, one op, so that ``--compile model``'s graph reads it without recompiling;
# 720 with the deep block; 719 with the controller's own quantile, one view less: ``concept.streaming.ratio.nanquantile``;
# 718 with the allowance's two ops)
# torch.profiler's aten events outside the graphs (nested ones too: what the GPU profiles count), at most (929 / 814 /
# 3,169 before the cuts)
PROFILED = {"forward": 861, "plain": 756, "step": 3042}  # (802 / 697 before the deep block)
PINNED_ON = (2, 13)  # the torch release the pins were counted on


def test_the_compiled_glue_is_pinned_and_counted_outside_the_graphs_only(tmp_path, fresh_dynamo, one_thread,
                                                                          monkeypatch):
    result = measure(seq_len=256, compile="layers", folder=tmp_path)
    assert counters["stats"]["unique_graphs"] >= 3 and not counters["graph_break"]
    counts = {k: result[k].total for k in ("forward", "plain", "step")}
    pins = {"forward": FORWARD, "plain": PLAIN, "step": STEP}
    assert all(counts[k] <= pins[k] for k in pins), f"glue ops {counts}, over the pins {pins}"
    if torch_release() == PINNED_ON:  # (another torch dispatches a few ops more or fewer: 2.11's step 718)
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


def random_layout(seed: int, emit: int = 1, B: int = 3, T: int = 40):
    """A static layout of random decisions over rows with left / right padding and several documents."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, T, generator=g) < 0.3
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :5], valid[1, -7:] = False, False
    doc = torch.cumsum(torch.rand(B, T, generator=g) < 0.08, dim=1)
    keep = packing.cap_boundaries(keep, valid, 0.3, slack=2)
    return packing.pack(keep, valid, doc, emit, 1, packing.budget(T, 0.3, 2) * emit)


@pytest.mark.parametrize("emit", [1, 2])
def test_rule_blocks_equal_the_rule(emit):
    """``packing.RuleBlocks`` (the static chunked plan's masks) against ``packing.allowed`` of the sliced metadata,
    for every block of queries against every key prefix. Negative controls: the rule without its documents, or
    without its padding, is caught."""
    for seed in range(3):
        layout = random_layout(seed, emit)
        meta, L = layout.meta, layout.length
        rule = packing.RuleBlocks(meta)
        blocks = [(a, b, kb) for a in range(0, L, 7) for b in (a + 1, min(a + 9, L), L) for kb in (b, L) if b <= L]
        for a, b, kb in blocks:
            assert torch.equal(rule(a, b, kb), packing.allowed(meta[:, a:b], meta[:, :kb]))
    # negative controls: the rule without its documents, or without its padding, is caught
    for field, value in (("doc", torch.zeros_like(meta.doc)), ("valid", torch.ones_like(meta.valid))):
        broken = packing.RuleBlocks(dataclasses.replace(meta, **{field: value}))
        assert not all(torch.equal(broken(a, b, kb), packing.allowed(meta[:, a:b], meta[:, :kb])) for a, b, kb in blocks)
