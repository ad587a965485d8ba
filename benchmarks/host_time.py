"""Host time of a forward and a training step, eager against each compile choice, on CPU: what a GPU's host pays.

    python -m benchmarks.host_time [--choices off,on,model,model-flat] [--models streaming,dense] [--seq-len 128] [--json]

The recipe of ``benchmarks/op_counts.py`` (the tiny backbone: 6 layers, hidden 64; split 2,2,2; 2 rows x 128
packed stdlib tokens with their document ids; LoRA rank 8; the default ``null`` policy and ``auto`` budget),
each choice compiled by inductor (torch's default mode on a CPU: ``on`` one graph per stack's layer, ``model``
the whole forward). The model is so small that its arithmetic is a sliver of each call: what is timed is
nearly all host work (Python, dispatch, the eager glue between graphs, a graph's own call), the part of a GPU
step that a faster GPU does not shorten. Per model and choice: the first training step's seconds (the
compilations), then the median of ``--reps`` training steps (``Trainer.train_step``) and of ``--reps`` no-grad
forwards of the same batch in eval, each after 3 warm-up calls, side by side in one process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.compiled import library_choice
from benchmarks.op_counts import built_folder, trainer_of

WARMUP = 3


def median_s(fn, reps: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind: str, choice: str, folder, seq_len: int, reps: int) -> dict:
    """One row: ``kind`` (streaming, pruned, dense) trained and run under ``choice`` (``model-flat``: ``model``
    with every decoder layer traced inline, ``concept.compiled.LAYER_REGIONS`` off)."""
    trainer = trainer_of(folder, kind, seq_len, library_choice(choice), steps=4 + 2 * (WARMUP + reps),
                         run=f"{kind}-{choice}")
    start = time.perf_counter()
    trainer.train_step()  # (the first: the ratio controller's calibration and the compilations)
    first_s = time.perf_counter() - start
    step_s = median_s(trainer.train_step, reps)
    model, batch = trainer.model.eval(), trainer.batch(0)

    def forward():
        with torch.no_grad():
            model(batch["input_ids"], attention_mask=batch["attention_mask"], document_ids=batch["document_ids"])

    forward_s = median_s(forward, reps)
    tokens = batch["input_ids"].numel()
    return {"model": kind, "compile": choice, "first_step_s": round(first_s, 2), "step_ms": round(step_s * 1e3, 2),
            "forward_ms": round(forward_s * 1e3, 2), "train_tokens_per_s": round(tokens / step_s)}


def table(rows: list[dict]) -> str:
    eager = {r["model"]: r for r in rows if r["compile"] == "off"}
    lines = ["| model | compile | first step s | step ms | vs eager | forward ms | vs eager |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = eager.get(r["model"], r)
        lines.append(f"| {r['model']} | `{r['compile']}` | {r['first_step_s']} | {r['step_ms']} | "
                     f"{e['step_ms'] / r['step_ms']:.2f}x | {r['forward_ms']} | {e['forward_ms'] / r['forward_ms']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--choices", default="off,on,model")
    parser.add_argument("--models", default="streaming,dense")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = built_folder()
    rows = [measure(kind, choice, folder, args.seq_len, args.reps)
            for kind in args.models.split(",") for choice in args.choices.split(",")]
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
