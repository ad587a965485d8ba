"""Where a training step's aten ops come from: ``op_counts.py``'s step, each ``aten::`` event charged to a source.

    OMP_NUM_THREADS=1 python benchmarks/op_sources.py [--model streaming|pruned|dense] [--seq-len 256] [--top 40]

``torch.profiler`` with ``with_stack``: a forward op is charged to the innermost ``concept/`` or ``plugins/``
frame above it and the first library frame under that (e.g. ``peft/tuners/lora/layer.py``); an op of the
backward to the forward op that made its autograd node (the profiler's sequence numbers), a custom
``autograd.Function``'s backward and ``AccumulateGrad`` by their node's name. The counts add up to
``op_counts.py``'s ``step_aten_ops`` (every event, nested ones included). docs/benchmarks.md, "Fewer aten ops
in a streaming step", has the table this gave.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

try:
    from benchmarks.op_counts import built_folder, started
except ModuleNotFoundError:  # (run as a script: benchmarks/ is the first path)
    from op_counts import built_folder, started

PROJECT = ("concept/", "plugins/")
SKIPPED = PROJECT + ("torch/profiler", "torch/utils/_contextlib", "torch/nn/modules/module.py", "torch/autograd/")


def _frames(event) -> list[str]:
    """The Python frames above ``event``, innermost first, as ``path(line): name`` without the line."""
    frames, parent = [], event.cpu_parent
    while parent is not None:
        if ".py(" in parent.name:
            name = re.sub(r"\(\d+\)", "", parent.name)
            name = name.split("site-packages/")[-1] if "site-packages/" in name else re.sub(
                r"^/.*?/(?=(concept|plugins)/)", "", name)  # (a path from the root: run as a script)
            frames.append(name)
        parent = parent.cpu_parent
    return frames


def _backward_node(event):
    parent = event
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function"):
            return parent
        parent = parent.cpu_parent
    return None


def _source(frames: list[str]) -> tuple[str, str]:
    ours = next((f for f in frames if f.startswith(PROJECT)), "?")
    library = next((f for f in frames if not f.startswith(SKIPPED)), "")
    return ours, library


def sources(run) -> tuple[Counter, dict]:
    """Run ``run`` under the profiler: ({(phase, ours, library): aten ops}, {same key: Counter of op names})."""
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        run()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    made_by = {e.sequence_nr: _source(_frames(e)) for e in aten
               if e.sequence_nr >= 0 and _backward_node(e) is None}
    counts, names = Counter(), defaultdict(Counter)
    for event in aten:
        node = _backward_node(event)
        if node is None:
            key = ("forward", *_source(_frames(event)))
        else:
            label = node.name.split(": ", 1)[-1]
            key = ("backward", *made_by.get(node.sequence_nr, (label, "")))
        counts[key] += 1
        names[key][event.name] += 1
    return counts, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="streaming", choices=["streaming", "pruned", "dense"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = started(built_folder(), args.model, args.seq_len)
    counts, names = sources(trainer.queue_step)
    print(f"{sum(counts.values())} aten ops in one {args.model} step")
    for (phase, ours, library), n in counts.most_common(args.top):
        top = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in names[phase, ours, library].most_common(6))
        print(f"{n:6d}  {phase:8s}  {ours}  <- {library or '-'}  [{top}]")


if __name__ == "__main__":
    main()
