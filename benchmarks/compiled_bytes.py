"""What a compiled step asks of the device, by inductor's own count: kernels, bytes and matmul FLOPs of the whole
forward (and its loss and backward) compiled as one graph, streaming against dense, on this CPU.

    .venv/bin/python -m benchmarks.compiled_bytes                              # SmolLM2's widths, both cases
    .venv/bin/python -m benchmarks.compiled_bytes --case train --B 16 --T 128 --json out.json
    .venv/bin/python -m benchmarks.compiled_bytes --shape tiny                 # the test's shape, seconds

Inductor plans every kernel of a graph before it generates code (its scheduler: which ops fuse into one kernel,
what each kernel reads and writes); it counts each kernel's bytes read and written (``GraphLowering.count_bytes``,
logged as ``inductor_metrics``), here collected per kernel. The plan on a CPU is not the GPU's (its C++ kernels,
not Triton), but which ops fuse, and so the bytes between kernels, follows the same scheduler; the matmuls and the
attention are library calls on both. So each model's compiled step gets, from the graphs inductor compiles:

- ``kernels``: the kernels with any byte to move (what a GPU launches: generated, matmul, attention, other);
- ``bytes``: their bytes read and written, and of those the generated kernels' (the fused elementwise glue);
- ``matmul_flops``: the FLOPs of its matmul calls (``2 M N K`` each, from the shapes inductor planned);
- ``roofline_ms``: each kernel's time at a device's peak, the larger of its FLOPs over the peak matmul rate and its
  bytes over the memory bandwidth, summed (:data:`DEVICES`; attention at its bytes alone: a CPU plans another
  attention kernel than a GPU runs), the device time a step could not go below with these kernels;
- ``floor_ms``: the same sum with no kernel below the shortest a GPU runs of its kind (:data:`FLOORS`): a kernel
  whose bytes and FLOPs take less still occupies the device that long. An estimate of a step bound by its many
  small kernels, not by its bytes: the streaming model's middle stack runs every layer's kernels over a fifth of
  the rows, so more of its kernels sit at their floor than dense's.

The model is the default build (split 4,18,8, the ``null`` policy, the ``auto`` budget) or its backbone as the
dense baseline, at SmolLM2-135M's widths (``--shape smollm2``: 30 layers, width 576, 9 heads over 3 KV heads, MLP
1,536, vocabulary 49,152) with random weights, the base stored in bf16 under bf16 autocast, as the GPU runs it.
``train``: a training step's graphs (forward with the loss, backward; the optimizer runs eagerly outside them), LoRA
on every projection, two packed documents a row; ``forward``: a no-grad forward with its logits, no adapters, as the
kit's speed rows run it. The attention is ``auto``: ``chunked`` on a CPU, so the deep stack's attention kernels and
their glue are this CPU's plan (an SDPA call a query chunk), not ``flex``'s one kernel a layer. Compiled as
``--compile model`` with every decoder layer inline (``model-flat``: a layer's region would be counted once, not
per layer; the fusion inside a layer is the same), each model in a fresh process with inductor's caches off, so
every graph is planned and counted.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections import Counter

SHAPES = {
    "smollm2": {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "intermediate": 1536, "vocab": 49152},
    "tiny": {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512},
}
SPLITS = {"smollm2": "4,18,8", "tiny": "2,2,2"}
MODELS = ("streaming", "dense")
# device -> (dense bf16 matmul FLOP/s, memory bytes/s), the makers' peak figures
DEVICES = {"h200": (989e12, 4.8e12), "h100": (989e12, 3.35e12)}
# kind -> the shortest device time a GPU gave a kernel of that kind (seconds): the smallest mean per call in the
# H200's compiled training step (`benchmarks/gpu_results/nvidia-h200/lease-2026-11-27b/call2/setup-profile-streaming-
# compiled.txt`): a generated Triton cast, 1.29 us; a cuBLAS GEMM, 4.25 us (the attention: a library call, held to a
# GEMM's floor, its least)
FLOORS = {"generated": 1.29e-6, "matmul": 4.25e-6, "attention": 4.25e-6, "other": 1.29e-6}
MATMULS = ("mm", "addmm", "bmm", "baddbmm")
METRICS_LOG = "torch._inductor.compile_fx.__inductor_metrics"


def kind_of(node) -> str:
    """A scheduler node's kind: ``matmul``, ``attention``, ``other`` (another library call) or ``generated``."""
    kernel = getattr(getattr(node, "node", None), "python_kernel_name", None)
    if kernel is None:
        return "generated"
    name = kernel.rsplit(".", 1)[-1]
    if name in MATMULS:
        return "matmul"
    return "attention" if "attention" in kernel or "flex" in kernel else "other"


def matmul_flops(node) -> int:
    """``2 M N K`` of a matmul node (``addmm``: its first input is the added term): the output's elements times
    twice the inner size, read from the shapes inductor planned."""
    ir = node.node
    mat1 = ir.inputs[1] if ir.python_kernel_name.endswith("addmm") else ir.inputs[0]
    out = 1
    for s in ir.get_size():
        out *= int(s)
    return 2 * out * int(mat1.get_size()[-1])


def signature(node) -> str:
    """A generated kernel's aten ops (those it was fused from, sorted, without overloads), e.g. ``add,mul,rsqrt``."""
    ops = set()
    for part in node.get_nodes():
        for origin in getattr(getattr(part, "node", None), "origins", ()):
            if origin.op == "call_function":
                ops.add(str(origin.target).replace("aten.", "").replace("prims.", "").split(".")[0])
    return ",".join(sorted(ops))


def census(kernels: list[dict], top: int) -> list[tuple[str, int, int]]:
    """The ``top`` most frequent generated kernels by their ops: (ops, kernels, bytes)."""
    generated = [k for k in kernels if k["kind"] == "generated"]
    counts, moved = Counter(k["ops"] for k in generated), Counter()
    for k in generated:
        moved[k["ops"]] += k["bytes"]
    return [(ops, n, moved[ops]) for ops, n in counts.most_common(top)]


class KernelLog(logging.Handler):
    """Collects inductor's per-kernel byte counts (:data:`METRICS_LOG`) while installed: with this handler the
    logger is enabled at INFO, so inductor counts (``count_bytes``) each graph it compiles; nothing is printed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.logger = logging.getLogger(METRICS_LOG)

    def __enter__(self):
        from torch._inductor import metrics

        metrics.reset()
        self.saved = self.logger.level, self.logger.propagate
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.logger.addHandler(self)
        return self

    def emit(self, record):  # (the counts are read from inductor's metrics; the message itself is dropped)
        pass

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]

    def kernels(self) -> list[dict]:
        """Each counted kernel: its kind, bytes and (a matmul) FLOPs; kernels with no byte to move (views,
        reinterpretations) left out."""
        from torch._inductor import metrics

        out = []
        for node, words in metrics.nodes_num_elem:
            if words <= 0:
                continue
            kind = kind_of(node)
            out.append({"kind": kind, "bytes": 4 * words, "flops": matmul_flops(node) if kind == "matmul" else 0,
                        "ops": signature(node) if kind == "generated" else ""})
        return out


def summary(kernels: list[dict], tokens: int, top: int = 0) -> dict:
    """The totals of :meth:`KernelLog.kernels`, each device's roofline and (``top``) the :func:`census`."""
    by = {k: [r for r in kernels if r["kind"] == k] for k in ("generated", "matmul", "attention", "other")}
    row = {"tokens": tokens, "kernels": len(kernels), **{f"{k}_kernels": len(v) for k, v in by.items()},
           "bytes": sum(r["bytes"] for r in kernels), "generated_bytes": sum(r["bytes"] for r in by["generated"]),
           "matmul_bytes": sum(r["bytes"] for r in by["matmul"]),
           "attention_bytes": sum(r["bytes"] for r in by["attention"]),
           "matmul_flops": sum(r["flops"] for r in by["matmul"])}
    for device, (peak, bandwidth) in DEVICES.items():
        bound = [(max(r["flops"] / peak, r["bytes"] / bandwidth), FLOORS[r["kind"]], r["kind"]) for r in kernels]
        row[f"roofline_ms_{device}"] = 1e3 * sum(seconds for seconds, _, _ in bound)
        row[f"floor_ms_{device}"] = 1e3 * sum(max(seconds, floor) for seconds, floor, _ in bound)
        below = [kind for seconds, floor, kind in bound if seconds < floor]
        row[f"at_floor_{device}"] = len(below)
        row[f"at_floor_by_kind_{device}"] = dict(Counter(below))
    if top:
        row["census"] = census(kernels, top)
    return row


def model_of(kind: str, shape: str, case: str):
    """``kind``'s model for ``case``: ``train`` with LoRA on every projection, ``forward`` without adapters (as the
    kit's speed rows build it); the ``auto`` attention (``chunked`` on a CPU: ``flex``, the GPU's, has no backward
    here, and inductor's CPU template for it finds no kernel for a bf16 forward inside the whole graph)."""
    import torch

    import concept
    from concept import BuildConfig, ComponentRef
    from concept.dense import DenseModel
    from concept.lora import LoraSettings, add_lora
    from concept.precision import store_frozen_base

    torch.manual_seed(0)
    model = concept.build(BuildConfig(backbone=ComponentRef("tiny-llama", SHAPES[shape]), split=SPLITS[shape]))
    if kind == "dense":
        model = DenseModel(model.backbone, static=True)
    if case == "train":
        add_lora(model.backbone, LoraSettings())
    store_frozen_base(model, torch.bfloat16)
    return model


def measure(kind: str, case: str, B: int, T: int, shape: str, top: int = 0) -> dict:
    """One row, in this process: ``kind``'s ``case`` compiled and run once, its kernels counted."""
    import torch
    import torch._dynamo
    import torch._inductor.config
    import torch._functorch.config

    from benchmarks.compiled import library_choice
    from concept.compiled import compile_model

    torch._dynamo.reset()
    model = compile_model(model_of(kind, shape, case), library_choice("model-flat"))
    ids = torch.randint(0, SHAPES[shape]["vocab"], (B, T), generator=torch.Generator().manual_seed(0))
    valid = torch.ones_like(ids)
    documents = (torch.arange(T) >= T // 2).long().expand(B, T)  # two packed documents a row, as training packs
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), KernelLog() as log, \
            torch.autocast("cpu", torch.bfloat16):
        if case == "train":
            model.train()
            model(ids, attention_mask=valid, document_ids=documents, labels=ids).loss.backward()
        else:
            model.eval()
            with torch.no_grad():
                model(ids, attention_mask=valid).logits
    return {"model": kind, "case": case, "B": B, "T": T, "shape": shape, **summary(log.kernels(), B * T, top)}


def run_one(kind: str, case: str, B: int, T: int, shape: str, top: int = 0, timeout: float = 1800) -> dict:
    """:func:`measure` in a fresh process (cold caches; two threads)."""
    from benchmarks.compile_time import cold_env

    with tempfile.TemporaryDirectory() as cache:
        env = cold_env(cache, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        done = subprocess.run([sys.executable, "-m", "benchmarks.compiled_bytes", "--one", kind, case, str(B), str(T),
                               shape, str(top)], env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            return {"model": kind, "case": case, "error": done.stderr.strip().splitlines()[-1:]}
        return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| case | model | kernels (generated / matmul / attention) | GB moved (generated) | matmul TFLOP | "
             "roofline ms, H200 | per 1k tokens, H200 | dense / streaming | with the kernels' floors: ms (kernels "
             "at it) | dense / streaming |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    dense = {(r["case"], r["B"], r["T"]): r for r in rows if r.get("model") == "dense"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['model']} | error: {r['error']} | | | | | | | |")
            continue
        d = dense.get((r["case"], r["B"], r["T"]))
        against_dense = d and r["model"] != "dense"
        ratio = f"{d['roofline_ms_h200'] / r['roofline_ms_h200']:.2f}x" if against_dense else ""
        floor_ratio = f"{d['floor_ms_h200'] / r['floor_ms_h200']:.2f}x" if against_dense else ""
        lines.append(f"| {r['case']} {r['B']} x {r['T']} | {r['model']} | {r['kernels']:,} ({r['generated_kernels']:,} / "
                     f"{r['matmul_kernels']:,} / {r['attention_kernels']:,}) | {r['bytes'] / 1e9:.2f} "
                     f"({r['generated_bytes'] / 1e9:.2f}) | {r['matmul_flops'] / 1e12:.3f} | {r['roofline_ms_h200']:.2f} | "
                     f"{1e3 * r['roofline_ms_h200'] / r['tokens']:.3f} | {ratio} | {r['floor_ms_h200']:.2f} "
                     f"({r['at_floor_h200']:,}) | {floor_ratio} |")
    return "\n".join(lines)


CASES = {"train": (16, 128), "forward": (1, 2048)}  # the demo recipe's rows (16 of its 128), a long row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=6, metavar=("MODEL", "CASE", "B", "T", "SHAPE", "TOP"), help=argparse.SUPPRESS)
    parser.add_argument("--case", action="append", choices=tuple(CASES), help="train, forward (default: both)")
    parser.add_argument("--model", action="append", choices=MODELS, help="streaming, dense (default: both)")
    parser.add_argument("--B", type=int, help="rows (default: 16 for train, 1 for forward)")
    parser.add_argument("--T", type=int, help="tokens a row (default: 128 for train, 2048 for forward)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="smollm2")
    parser.add_argument("--top", type=int, default=0, help="also list each model's N most frequent generated kernels")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    if args.one:
        kind, case, B, T, shape, top = args.one
        print(json.dumps(measure(kind, case, int(B), int(T), shape, int(top))))
        return
    rows = []
    for case in args.case or list(CASES):
        B, T = args.B or CASES[case][0], args.T or CASES[case][1]
        for kind in args.model or MODELS:
            rows.append(run_one(kind, case, B, T, args.shape, args.top))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    for r in rows:
        if r.get("census"):
            print(f"\n{r['case']} {r['model']}: the {len(r['census'])} most frequent generated kernels (ops: kernels, MB)")
            for ops, n, moved in r["census"]:
                print(f"  {ops}: {n}, {moved / 1e6:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
