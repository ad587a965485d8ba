"""Where a training step's aten ops come from: ``op_counts.py``'s step, each ``aten::`` event charged to a source.

    OMP_NUM_THREADS=1 python benchmarks/op_sources.py [--model streaming|pruned|dense] [--seq-len 256] [--top 40]
                      [--shape tiny|smollm2-bf16] [--ops _to_copy,copy_] [--casts] [--by-module] [--lines]

``torch.profiler`` with ``with_stack``: a forward op is charged to the innermost ``concept/`` or ``plugins/``
frame above it and the first library frame under that (e.g. ``peft/tuners/lora/layer.py``); an op of the
backward to the forward op that made its autograd node (the profiler's sequence numbers), a custom
``autograd.Function``'s backward and ``AccumulateGrad`` by their node's name. The counts add up to
``op_counts.py``'s ``step_aten_ops`` (every event, nested ones included). docs/benchmarks.md, "Fewer aten ops
in a streaming step", has the table this gave. ``--shape smollm2-bf16``: ``test_step_counts.py``'s step instead
(SmolLM2's 30 layers at width 64, the base stored in bf16, bf16 autocast, 2 x 128 tokens, its second step);
``--ops``: only those ops counted (e.g. the casts, ``_to_copy,copy_``). ``--by-module``: the counts summed per
source module, forward and backward, the backbone's decoder layers (transformers' code), LoRA, the optimizer and
AccumulateGrad set apart from the model's own glue (docs/benchmarks.md, "The streaming step's own glue").
``--lines``: every op Python's dispatch sees (``StepCounter``'s ops, not the profiler's nested events) charged to
the source LINE of the innermost project frame (a backward op: the line that made its autograd node), the
decoder layers, LoRA and the optimizer set apart: the model's own glue, line by line (docs/benchmarks.md, "One keep
score per forward").
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections import Counter, defaultdict

import traceback

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from benchmarks.op_counts import built_folder, started
    from benchmarks.step_counts import CASTS
except ModuleNotFoundError:  # (run as a script: benchmarks/ is the first path)
    from op_counts import built_folder, started
    from step_counts import CASTS

PROJECT = ("concept/", "plugins/")
SKIPPED = PROJECT + ("torch/profiler", "torch/utils/_contextlib", "torch/nn/modules/module.py", "torch/autograd/",
                     "torch/_dynamo/eval_frame.py", "torch/_compile.py")


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


def smollm2_bf16_step(kind: str):
    """``test_step_counts.py``'s ``new`` step of ``kind`` (its first step taken): a function running one more."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks.step_counts import training_step
    from benchmarks.test_step_counts import VOCAB, B, T, model_of
    from concept.precision import store_frozen_base

    model = model_of(kind)
    store_frozen_base(model, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    training_step(model, batch, "new", optimizer)
    return lambda: training_step(model, batch, "new", optimizer)


class _CastSources(TorchDispatchMode):
    """The casts Python's dispatch sees (``StepCounter``'s: autocast's, ``.to``, ``copy_``), each charged as
    :func:`sources` charges an op: the innermost project frame and the library frame under it; a backward
    cast to its autograd node's name and the forward frame that made the node (anomaly mode's traceback)."""

    def __init__(self):
        super().__init__()
        self.counts, self.names = Counter(), defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in CASTS:
            self._charge(name, args[1] if name == "copy_" else args[0], args[0] if name == "copy_" else out)
        return out

    def _charge(self, name: str, source: torch.Tensor, result: torch.Tensor) -> None:
        dtypes = f"{str(source.dtype).removeprefix('torch.')} -> {str(result.dtype).removeprefix('torch.')}"
        what = ("a trainable parameter" if isinstance(source, nn.Parameter) and source.requires_grad else
                "a frozen parameter" if isinstance(source, nn.Parameter) else dtypes)
        node = torch._C._current_autograd_node()
        if node is None:
            ours, library = _source(_stack_frames(traceback.extract_stack()[:-2]))  # (less this class's frames)
            key = ("forward", f"{ours} ({what})", library)
        else:
            made = _stack_frames(_parse_traceback(node.metadata.get("traceback_", "")))
            key = ("backward", f"{node.name()} of {_source(made)[0]} ({what})", _source(made)[1])
        self.counts[key] += 1
        self.names[key][f"aten::{name}"] += 1


def _short(path: str) -> str:
    return path.split("site-packages/")[-1] if "site-packages/" in path else re.sub(
        r"^/.*?/(?=(concept|plugins|benchmarks)/)", "", path)


def _stack_frames(stack, lines: bool = False) -> list[str]:
    """``traceback`` frames as ``path: name`` (``path:line: name`` with ``lines``), innermost first."""
    return [f"{_short(f.filename)}{f':{f.lineno}' if lines else ''}: {f.name}" for f in reversed(stack)]


class _LineSources(TorchDispatchMode):
    """Every dispatched op charged to the line of the innermost project frame above it (forward), or to the
    line that made its autograd node (backward: anomaly mode's traceback), with the library frame under it."""

    def __init__(self):
        super().__init__()
        self.counts, self.names = Counter(), defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        if node is None:
            key = ("forward", *_source(_stack_frames(traceback.extract_stack()[:-1], lines=True)))
        else:
            made = _stack_frames(_parse_traceback(node.metadata.get("traceback_", "")), lines=True)
            key = ("backward", *(_source(made) if made else (node.name(), "")))
        self.counts[key] += 1
        self.names[key][f"aten::{func.overloadpacket.__name__}"] += 1
        return out


def line_sources(run) -> tuple[Counter, dict]:
    """Run ``run`` counting every dispatched op by source line (as :func:`sources`' keys)."""
    with torch.autograd.set_detect_anomaly(True, check_nan=False), _LineSources() as seen:
        run()
    return seen.counts, seen.names


def _parse_traceback(text: str):
    return [traceback.FrameSummary(m.group(1), int(m.group(2)), m.group(3))
            for m in re.finditer(r'File "(.+?)", line (\d+), in (\S+)', text if isinstance(text, str) else "".join(text))]


def cast_sources(run) -> tuple[Counter, dict]:
    """Run ``run`` counting the dispatched casts by source (as :func:`sources`' keys)."""
    with torch.autograd.set_detect_anomaly(True, check_nan=False), _CastSources() as seen:
        run()
    return seen.counts, seen.names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="streaming", choices=["streaming", "pruned", "dense"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--shape", default="tiny", choices=["tiny", "smollm2-bf16"])
    parser.add_argument("--ops", default="", help="count only these aten ops (comma-separated, no aten:: prefix)")
    parser.add_argument("--casts", action="store_true",
                        help="the casts Python's dispatch sees (as step_counts.StepCounter), not the profiler's ops")
    parser.add_argument("--by-module", action="store_true", help="sums per source module (forward, backward)")
    parser.add_argument("--lines", action="store_true",
                        help="dispatched ops by source line; the decoder layers, LoRA and the optimizer summed apart")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.shape == "tiny":
        run = started(built_folder(), args.model, args.seq_len).queue_step
    else:
        run = smollm2_bf16_step(args.model)
    counts, names = cast_sources(run) if args.casts else line_sources(run) if args.lines else sources(run)
    if args.ops:
        wanted = {f"aten::{op.strip()}" for op in args.ops.split(",")}
        for key in list(names):
            names[key] = Counter({k: v for k, v in names[key].items() if k in wanted})
            counts[key] = sum(names[key].values())
        counts = +counts
    ops = f"{'dispatched ' if args.lines else ''}aten ops{' (' + args.ops + ')' if args.ops else ''}"
    what = "casts" if args.casts else ops
    print(f"{sum(counts.values())} {what} in one {args.model} step")
    if args.lines:
        apart = Counter()
        for (phase, ours, library), n in list(counts.items()):
            module = module_of(phase, re.sub(r":\d+:", ":", ours), library)
            if module in EXCLUDED.values():
                apart[module, phase] += n
                del counts[phase, ours, library]
        for (module, phase), n in sorted(apart.items()):
            print(f"{n:6d}  {phase:8s}  {module}")
        print(f"{sum(counts.values()):6d}  the model's own glue, by line:")
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
