"""How long ``--compile`` takes before it pays: the first compiled forward and the first compiled training step,
whole stacks (``default``: inductor's default mode, a stack's whole loop in one graph) against regional
compilation (``layers``, what ``on`` means: one decoder layer's graph shared by a stack's layers) and the whole
forward (``model``: decisions, packing, plans, stacks and loss one graph, each decoder layer a nested compile region;
``model-flat``: the same graph with every layer traced inline), side by side in one run, on this CPU (inductor, not
``aot-eager``)::

    .venv/bin/python -m benchmarks.compile_time                      # tiny and SmolLM2-shaped, both models
    .venv/bin/python -m benchmarks.compile_time --shape tiny --kind dense --json out.json
    .venv/bin/python -m benchmarks.compile_time --shape smollm2 --kind streaming --backend aot-eager  # tracing only
    .venv/bin/python -m benchmarks.compile_time --shape smollm2 --kind streaming --side-by-side  # run time, in turns

Each (shape, model, choice) runs in a process of its own (``--one``), with inductor's on-disk caches off and a
fresh cache folder, so every compilation is cold, as on a fresh GPU machine; one thread (``torch`` and
inductor's compile workers). In it: one no-grad forward (eval; its graphs), then training steps of the model
with LoRA (forward with the loss, backward, AdamW): the first (its graphs), two more, then the median of
``STEADY`` steps and one profiled step (aten ops as the profiler records them: inductor's generated kernels
are not aten ops). Graphs: dynamo's ``unique_graphs``; breaks: its ``graph_break`` counter. ``eager`` is the
same model uncompiled, for the steady step's reference.

Shapes: ``tiny`` is the default suite's compile test model (3 layers, width 32, split 1,1,1); ``smollm2`` has
SmolLM2's 30 layers split 4,18,8 at a tiny width (``benchmarks/test_step_counts.py``: tracing and code
generation follow the layers, not their width). The streaming model is the default build (``null`` policy,
``auto`` budget: static shapes), the dense model the same backbone's ``DenseModel``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "tiny": {"backbone": {"layers": 3, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64, "vocab": 256},
             "split": "1,1,1", "B": 2, "T": 32},
    "smollm2": {"backbone": {"layers": 30, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128,
                             "vocab": 512}, "split": "4,18,8", "B": 2, "T": 64},
}
KINDS = ("streaming", "dense")
CHOICES = ("off", "default", "layers", "model", "model-flat")  # eager; whole stacks (inductor's default mode); one
# graph per layer; the whole forward one graph, each layer a nested compile region (what ``model`` is); the same graph
# with every layer traced inline (``concept.compiled.LAYER_REGIONS`` off: what ``model`` was before the regions)
STEADY = 5


def model_of(shape: str, kind: str):
    import torch

    import concept
    from concept import BuildConfig, ComponentRef
    from concept.dense import DenseModel
    from concept.lora import LoraSettings, add_lora

    torch.manual_seed(0)
    s = SHAPES[shape]
    model = concept.build(BuildConfig(backbone=ComponentRef("tiny-llama", s["backbone"]), split=s["split"]))
    if kind == "dense":
        model = DenseModel(model.backbone, static=True)
    add_lora(model.backbone, LoraSettings())
    return model


def measure(shape: str, kind: str, choice: str, backend: str = "inductor", forward_only: bool = False) -> dict:
    """One row, in this process (``--one``). ``backend`` ``aot-eager``: the same graphs captured (dynamo, AOT
    autograd) and run by eager kernels: the tracing's share of the compile time, and the calls' own overhead.
    ``forward_only``: the two no-grad forwards alone (no training steps)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    if backend == "aot-eager":
        real = torch.compile
        torch.compile = lambda fn, fullgraph, dynamic, mode=None, backend=None, options=None: real(
            fn, fullgraph=fullgraph, dynamic=dynamic, backend="aot_eager")  # (inductor's options dropped with it)

    from benchmarks.compiled import library_choice
    from concept.compiled import compile_model
    from concept.profiling import profile_call

    torch.set_num_threads(1)
    s = SHAPES[shape]
    model = compile_model(model_of(shape, kind), library_choice(choice))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s["backbone"]["vocab"], (s["B"], s["T"]), generator=g) for _ in range(4)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(i: int) -> None:
        ids = batches[i % len(batches)]
        loss = model(ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        forward_s = timed(lambda: model(batches[0], attention_mask=torch.ones_like(batches[0])))
        forward_graphs = counters["stats"]["unique_graphs"]
        again_s = timed(lambda: model(batches[1], attention_mask=torch.ones_like(batches[1])))
    if forward_only:
        return {"shape": shape, "kind": kind, "choice": choice, "backend": backend, "layers": s["backbone"]["layers"],
                "split": s["split"], "B": s["B"], "T": s["T"], "first_forward_s": forward_s, "second_forward_s": again_s,
                "forward_graphs": forward_graphs, "graph_breaks": sum(counters["graph_break"].values())}
    model.train()
    first_step_s = timed(lambda: step(0))
    graphs = counters["stats"]["unique_graphs"]
    for i in (1, 2):
        step(i)
    steady = [timed(lambda i=i: step(i)) for i in range(3, 3 + STEADY)]
    prof = profile_call(lambda: step(0))
    return {"shape": shape, "kind": kind, "choice": choice, "backend": backend, "layers": s["backbone"]["layers"], "split": s["split"],
            "B": s["B"], "T": s["T"], "first_forward_s": forward_s, "second_forward_s": again_s,
            "forward_graphs": forward_graphs, "first_step_s": first_step_s, "step_graphs": graphs - forward_graphs,
            "graphs_after": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "steady_step_s": statistics.median(steady), "step_aten_ops": prof["aten_ops"]}


def side_by_side(shape: str, kind: str, choices: list[str], reps: int = 30) -> list[dict]:
    """Steady training steps and no-grad forwards of each choice, compiled in this one process (inductor, warm
    caches) and then timed in turns, ``reps`` rounds: the run time of the compiled code, free of the drift between
    processes that the per-row ``steady step s`` (a median of 5 in its own process) carries."""
    import copy

    import torch

    from benchmarks.compiled import library_choice
    from concept.compiled import compile_model

    torch.set_num_threads(1)
    s = SHAPES[shape]
    base = model_of(shape, kind)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s["backbone"]["vocab"], (s["B"], s["T"]), generator=g) for _ in range(4)]
    runs = {}
    for choice in choices:
        model = compile_model(copy.deepcopy(base), library_choice(choice))  # (its graphs traced below: now)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(i, model=model, optimizer=optimizer):
            ids = batches[i % len(batches)]
            model(ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def forward(i, model=model):
            with torch.no_grad():
                model(batches[i % len(batches)], attention_mask=torch.ones_like(batches[i % len(batches)]))

        for i in range(2):
            model.train()
            step(i)
            model.eval()
            forward(i)
        runs[choice] = (model, step, forward)
    times = {choice: {"step": [], "forward": []} for choice in runs}
    for i in range(reps):
        for choice, (model, step, forward) in runs.items():
            for name, fn, training in (("step", step, True), ("forward", forward, False)):
                model.train(training)
                start = time.perf_counter()
                fn(i)
                times[choice][name].append(time.perf_counter() - start)
    return [{"shape": shape, "kind": kind, "choice": choice, "reps": reps,
             "step_ms": round(1e3 * statistics.median(t["step"]), 2),
             "forward_ms": round(1e3 * statistics.median(t["forward"]), 2)} for choice, t in times.items()]


def cold_env(cache: str, **more: str) -> dict:
    """This process's environment for a child whose every compilation is cold: inductor's caches in the empty
    folder ``cache`` and off; ``more``: other variables (e.g. ``OMP_NUM_THREADS="1"``)."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", **more}


def run_one(shape: str, kind: str, choice: str, timeout: float, backend: str = "inductor",
            forward_only: bool = False) -> dict:
    """:func:`measure` in a fresh process with cold inductor caches."""
    with tempfile.TemporaryDirectory() as cache:
        env = cold_env(cache, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--one", shape, kind, choice,
                                   "--backend", backend] + ["--forward-only"] * forward_only,
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"shape": shape, "kind": kind, "choice": choice, "error": f"over {timeout:.0f} s"}
        if done.returncode:
            return {"shape": shape, "kind": kind, "choice": choice, "error": done.stderr.strip().splitlines()[-1:]}
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["process_s"] = time.perf_counter() - start
        return row


def table(rows: list[dict]) -> str:
    head = ("| shape | model | compile | first forward s | graphs | first step s | graphs | breaks | steady step s "
            "| aten ops / step |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['kind']} | {r['choice']} | {r['error']} |||||||")
            continue
        if "first_step_s" not in r:  # (--forward-only)
            lines.append(f"| {r['shape']} ({r['layers']} layers, {r['split']}) | {r['kind']} | {r['choice']} "
                         f"({r['backend']}) | {r['first_forward_s']:.1f} | {r['forward_graphs']} | – | – | "
                         f"{r['graph_breaks']} | – | – |")
            continue
        lines.append(f"| {r['shape']} ({r['layers']} layers, {r['split']}) | {r['kind']} | {r['choice']} "
                     f"({r['backend']}) | "
                     f"{r['first_forward_s']:.1f} | {r['forward_graphs']} | {r['first_step_s']:.1f} | "
                     f"{r['step_graphs']} | {r['graph_breaks']} | {r['steady_step_s']:.4f} | {r['step_aten_ops']:,} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("SHAPE", "KIND", "CHOICE"), help="one row, in this process")
    parser.add_argument("--shape", choices=SHAPES, action="append")
    parser.add_argument("--kind", choices=KINDS, action="append")
    parser.add_argument("--choice", choices=CHOICES, action="append")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    parser.add_argument("--backend", choices=("inductor", "aot-eager"), default="inductor")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--forward-only", action="store_true", help="the first no-grad forwards alone, no training "
                        "steps (an inductor row of a whole model's training step takes many minutes on this CPU)")
    parser.add_argument("--side-by-side", action="store_true", help="each --choice compiled in this process, then "
                        "their steady steps and forwards timed in turns (run time, not compile time)")
    args = parser.parse_args(argv)
    if args.side_by_side:
        for shape in args.shape or SHAPES:
            for kind in args.kind or KINDS:
                for row in side_by_side(shape, kind, args.choice or ["model", "model-flat"]):
                    print(json.dumps(row), flush=True)
        return 0
    if args.one:
        print(json.dumps(measure(*args.one, backend=args.backend, forward_only=args.forward_only)))
        return 0
    rows = []
    for shape in args.shape or SHAPES:
        for kind in args.kind or KINDS:
            for choice in args.choice or CHOICES:
                rows.append(run_one(shape, kind, choice, args.timeout, args.backend, args.forward_only))
                print(json.dumps(rows[-1]), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
