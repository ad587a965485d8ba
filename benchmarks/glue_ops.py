"""The aten ops of a COMPILED streaming forward / training step that run outside its compiled graphs (the eager
"glue" between them), on CPU, by source line.

    python benchmarks/glue_ops.py [--seq-len 256] [--compile layers] [--top 20] [--json]

The recipe is ``benchmarks/op_counts.py``'s (the tiny backbone, split 2,2,2, 2 rows of packed stdlib documents,
LoRA rank 8, the trainer's ``queue_step`` after its first two steps, the forward of the step's batch under
``no_grad`` in eval, and ``plain``: that forward of its token ids alone, as the GPU kit's speed rows run it: no
mask, no document ids), compiled as on CUDA (``layers``: regional, one graph per stack's layer), each graph run by
AOT autograd's eager interpreter (``aot_eager``: inductor's C++ compilation takes minutes here).

How it counts: a ``TorchDispatchMode`` (:class:`GlueOps`) sees every aten op dispatched while it is active, and
each compiled graph is called with it switched off (:func:`glue_compile`: ``torch.compile`` wrapped so that the
compiled function, and the forward and backward graphs AOT autograd hands its compilers, run under
``_disable_current_modes``). A mode left on would make dynamo fall back (it refuses to run graphs under a
non-infra dispatch mode). What runs between the graphs is counted, attributed to the innermost frame of the
project's own source (``concept/``, ``plugins/``) on the stack; in a backward, to the autograd node that ran it
(``backward: GatherBackward0``), the eager glue's backward. These are ops reaching a dispatch mode (what a
kernel launch can come from), not ``torch.profiler``'s aten events (those nest: ``aten::matmul`` calls
``aten::mm``), so the totals are smaller than the profiler's.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = tuple(str(ROOT / d) + "/" for d in ("concept", "plugins"))


def source_line() -> str:
    """``file:line function`` of the innermost frame of our own source on the stack (a backward: its node)."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward: {node.name()}"
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(OURS):
            return f"{name[len(str(ROOT)) + 1:]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside the project)"


class GlueOps(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, by :func:`source_line`."""

    def __init__(self):
        super().__init__()
        self.by_line: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_line[source_line()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_line.values())


GRAPH = "glue_ops: compiled graph"  # (the profiler's range around each compiled call)


def _modes_off(fn):
    """``fn`` called with the dispatch modes switched off (a compiled graph: its ops are not glue), inside a
    profiler range named :data:`GRAPH`."""
    def call(*args, **kwargs):
        with _disable_current_modes(), torch.profiler.record_function(GRAPH):
            return fn(*args, **kwargs)
    call.__dict__.update(getattr(fn, "__dict__", {}))  # (a boxed call stays boxed)
    return call


def _graph_compiler(gm, example_inputs):
    from torch._dynamo.backends.debugging import boxed_nop
    return _modes_off(boxed_nop(gm, example_inputs))


def glue_backend(gm, example_inputs):
    """``aot_eager`` whose forward and backward graphs run with the dispatch modes off."""
    from torch._dynamo.backends.common import aot_autograd
    return aot_autograd(fw_compiler=_graph_compiler, bw_compiler=_graph_compiler)(gm, example_inputs)


@contextlib.contextmanager
def glue_compile():
    """Inside the block, ``torch.compile`` compiles with :func:`glue_backend` (any mode or backend asked for)
    and returns a function that calls the compiled one with the dispatch modes off."""
    real = torch.compile

    def compile(fn, fullgraph=False, dynamic=None, mode=None, backend=None, options=None, **rest):
        if torch.compiler.is_compiling():  # (inside a graph, e.g. FlexAttention's own compile: part of it)
            return real(fn, fullgraph=fullgraph, dynamic=dynamic, **rest)
        # (inductor's ``options`` dropped with inductor)
        return _modes_off(real(fn, fullgraph=fullgraph, dynamic=dynamic, backend=glue_backend, **rest))

    torch.compile = compile
    try:
        yield
    finally:
        torch.compile = real


def counted(run) -> GlueOps:
    with GlueOps() as ops:
        run()
    return ops


def profiled_glue(run) -> int:
    """The ``aten::`` events of ``torch.profiler`` (nested ones too, as ``benchmarks/op_counts.py`` and the GPU
    profiles count them) outside every compiled call (:data:`GRAPH`)."""
    from torch.profiler import ProfilerActivity, profile

    def in_graph(event) -> bool:
        while event is not None and event.name != GRAPH:
            event = event.cpu_parent
        return event is not None

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not in_graph(e))


def measure(seq_len: int = 256, compile: str = "layers", folder=None) -> dict:
    """The glue ops of the recipe's compiled forward and training step (``GlueOps`` each), and its trainer."""
    from benchmarks.op_counts import built_folder, started

    with glue_compile():
        trainer = started(built_folder(folder=folder), "streaming", seq_len=seq_len, compile=compile)
        batch, model = trainer.batch(0), trainer.model

        def forward():
            with torch.no_grad():
                model(batch["input_ids"], attention_mask=batch["attention_mask"], document_ids=batch["document_ids"])

        def plain():  # (the GPU kit's speed row: one document per row, no padding)
            with torch.no_grad():
                model(batch["input_ids"])

        model.eval()
        forward(), plain()  # (the eval graphs compiled)
        result = {"forward": counted(forward), "plain": counted(plain)}
        profiled = {"forward": profiled_glue(forward), "plain": profiled_glue(plain)}
        model.train()
        result["step"] = counted(trainer.queue_step)
        profiled["step"] = profiled_glue(trainer.queue_step)
    result["profiled"] = profiled
    result["trainer"], result["run_forward"] = trainer, forward
    return result


KINDS = ("forward", "plain", "step")


def table(ops: GlueOps, top: int) -> str:
    rows = [f"| {n} | `{line}` |" for line, n in ops.by_line.most_common(top)]
    return "\n".join(["| ops | source line |", "|---:|---|", *rows, f"| **{ops.total}** | total ({len(ops.by_line)} lines) |"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--compile", default="layers")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.seq_len, args.compile)
    if args.json:
        print(json.dumps({k: {"total": result[k].total, "profiled": result["profiled"][k],
                              "by_line": dict(result[k].by_line.most_common())} for k in KINDS}, indent=1))
        return
    for k in KINDS:
        print(f"\n{k}: {result[k].total} glue ops dispatched ({result['profiled'][k]} profiler aten events)\n\n"
              f"{table(result[k], args.top)}")


if __name__ == "__main__":
    main()
