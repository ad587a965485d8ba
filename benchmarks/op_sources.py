"""Where a training step's aten ops come from: ``op_counts.py``'s step, each ``aten::`` event charged to a source.

    OMP_NUM_THREADS=1 python benchmarks/op_sources.py [--model streaming|pruned|dense] [--seq-len 256] [--top 40]
    OMP_NUM_THREADS=1 python benchmarks/op_sources.py --smollm2-shaped [--by-module]

``torch.profiler`` with ``with_stack``: a forward op is charged to the innermost ``concept/`` or ``plugins/``
frame above it and the first library frame under that (e.g. ``peft/tuners/lora/layer.py``); an op of the
backward to the forward op that made its autograd node (the profiler's sequence numbers), a custom
``autograd.Function``'s backward and ``AccumulateGrad`` by their node's name. The counts add up to
``op_counts.py``'s ``step_aten_ops`` (every event, nested ones included). docs/benchmarks.md, "Fewer aten ops
in a streaming step", has the table this gave.

``--smollm2-shaped``: ``test_step_counts.py``'s step instead (30 layers at width 64, split 4,18,8, the base stored
in bf16, bf16 autocast, 2 x 128 tokens, ``step_counts.training_step``'s ``new`` version). ``--by-module``: the
counts summed per source module, forward and backward, the backbone's decoder layers (transformers' code), LoRA,
the optimizer and AccumulateGrad set apart from the model's own glue (docs/benchmarks.md, "The streaming
step's own glue").
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


EXCLUDED = {"LoRA": "LoRA (concept/lora.py and its backward)", "layers": "the decoder layers (transformers' code)",
            "optimizer": "optimizer, gradient clipping", "accumulate": "AccumulateGrad"}


def module_of(phase: str, ours: str, library: str) -> str:
    """The row of ``--by-module`` an op charged to (``ours``, ``library``) goes to."""
    path = ours.split(":")[0]
    if "lora.py" in ours or ours.startswith("LoraMatmuls"):
        return EXCLUDED["LoRA"]
    if "optim" in library or "_optimizer_step" in ours or ours == "?":
        return EXCLUDED["optimizer"]
    if "AccumulateGrad" in ours:
        return EXCLUDED["accumulate"]
    if path == "concept/backbone.py" or (library.startswith("transformers/")
                                         and not path.startswith(("concept/attention", "plugins/attention"))):
        return EXCLUDED["layers"]  # (HF's own ops: RMSNorm, rotary, MLP; SDPA's are charged to concept.attention)
    return path


def smollm2_shaped_step():
    """``test_step_counts.py``'s streaming step (``new``), its first step taken: a callable for one more."""
    try:
        from benchmarks.test_step_counts import B, T, VOCAB, model_of
        from benchmarks.step_counts import training_step
    except ModuleNotFoundError:  # (run as a script: the repository root is not on the path)
        import pathlib
        import sys
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
        from benchmarks.test_step_counts import B, T, VOCAB, model_of
        from benchmarks.step_counts import training_step
    from concept.precision import store_frozen_base

    model = model_of("streaming")
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    store_frozen_base(model, torch.bfloat16)
    training_step(model, batch, "new", optimizer)
    return lambda: training_step(model, batch, "new", optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="streaming", choices=["streaming", "pruned", "dense"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--smollm2-shaped", action="store_true", help="test_step_counts.py's bf16 streaming step")
    parser.add_argument("--by-module", action="store_true", help="sums per source module (forward, backward)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smollm2_shaped:
        step, name = smollm2_shaped_step(), "SmolLM2-shaped bf16 streaming"
    else:
        step, name = started(built_folder(), args.model, args.seq_len).queue_step, args.model
    counts, names = sources(step)
    print(f"{sum(counts.values())} aten ops in one {name} step")
    if args.by_module:
        rows = defaultdict(Counter)
        for (phase, ours, library), n in counts.items():
            rows[module_of(phase, ours, library)][phase] += n
        own = Counter()
        for module, n in sorted(rows.items(), key=lambda item: -sum(item[1].values())):
            print(f"{n['forward']:6d} {n['backward']:6d}  {module}")
            if module not in EXCLUDED.values():
                own.update(n)
        print(f"{own['forward']:6d} {own['backward']:6d}  the model's own glue (every row but {', '.join(EXCLUDED)})")
        return
    for (phase, ours, library), n in counts.most_common(args.top):
        top = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in names[phase, ours, library].most_common(6))
        print(f"{n:6d}  {phase:8s}  {ours}  <- {library or '-'}  [{top}]")


if __name__ == "__main__":
    main()
