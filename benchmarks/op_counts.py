"""aten ops and host syncs per forward and per training step, on CPU: streaming, pruned and dense.

    python benchmarks/op_counts.py [--max-ratio auto|none|0.25] [--compile off|on|aot-eager] [--seq-len 128] [--json]

The tiny backbone of the tests (6 layers, hidden 64, a 256-id byte vocabulary, split 2,2,2), the default `null` policy (its tracker
on: one host scan per forward), `chunked` attention, 2 rows x 128 tokens of packed stdlib documents with
their document ids, as the trainer feeds them. A training step is the trainer's own (``Trainer.queue_step``,
its log read after it: ``log_read_*``, the two counted steps' log at once; ``Trainer.train_step`` at a commit
before the deferred log; the second step: the first calibrates the NULL bias), LoRA rank 8, no logging or
evaluation step.

Columns: ``aten ops`` as torch.profiler counts them (every ``aten::`` event, nested ones too: what the GPU
profiles of docs/benchmarks.md count; compiled graphs show their extern calls); ``dispatched`` (ops reaching
a ``TorchDispatchMode``, eager only) and ``hidden syncs`` / ``declared`` (``concept.syncs.HostSyncs``,
eager only: a dispatch mode makes torch.compile fall back). Run it at another commit (``git archive``,
``PYTHONPATH``) for the before / after table.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import concept
from concept import BuildConfig, ComponentRef
from concept.training import TrainConfig, Trainer

STDLIB = pathlib.Path(warnings.__file__).parent


def profiled_ops(run) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def dispatched(run) -> dict:
    try:
        from concept.syncs import HostSyncs
    except ImportError:  # (a commit before concept.syncs)
        return {}
    with HostSyncs() as seen:
        run()
    return {"dispatched": seen.ops, "hidden_syncs": seen.hidden, "declared": dict(seen.declared)}


def built_folder(max_ratio: str = "auto", folder: pathlib.Path | None = None) -> pathlib.Path:
    """A folder holding the recipe's corpus (``code.jsonl``) and its build (``built``)."""
    folder = folder or pathlib.Path(tempfile.mkdtemp())
    docs = [c for name in ("textwrap.py", "shlex.py", "heapq.py", "bisect.py", "difflib.py")
            for c in (STDLIB / name).read_text().split("\ndef ") if len(c) > 200]
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    given = 0.0 if max_ratio == "none" else max_ratio
    extra = {} if given == "auto" else {"max_ratio": float(given)}  # (auto: the default, at any commit)
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2,
                                                          "vocab": 256}),
                      split="2,2,2", vocabulary=ComponentRef("embedding", {"size": 32}),
                      attention=ComponentRef("chunked", {}), **extra)
    concept.save(concept.build(cfg), folder / "built")
    return folder


def trainer_of(folder: pathlib.Path, kind: str, seq_len: int = 128, compile: str = "off", steps: int = 4,
               run: str | None = None) -> Trainer:
    """The recipe's trainer of ``kind`` (streaming, pruned, dense) on :func:`built_folder`'s build, in
    ``folder / run`` (default: ``kind``), for ``steps`` steps (no evaluation, checkpoint or log step among them)."""
    options = dict(steps=steps, seq_len=seq_len, batch=2, eval_every=10_000, checkpoint_every=10_000,
                   log_every=10_000, warmup=1, data=str(folder / "code.jsonl"), lora=concept.lora.LoraSettings(rank=8))
    if compile != "off":
        options["compile"] = compile
    if kind != "streaming":
        options["baseline"] = kind
    return Trainer.start(folder / "built", folder / (run or kind), TrainConfig(**options))


def started(folder: pathlib.Path, kind: str, seq_len: int = 128, compile: str = "off") -> Trainer:
    """:func:`trainer_of`, its first two steps taken (the first calibrates the NULL bias; the optimizer's state
    exists from the first on)."""
    trainer = trainer_of(folder, kind, seq_len, compile)
    trainer.train_step()
    trainer.train_step()  # (a compiled run: every graph of a step is compiled by now)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ratio", default="auto", help="the build's (auto: its default, whatever the commit)")
    parser.add_argument("--compile", default="off")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = built_folder(args.max_ratio)
    rows = []
    for kind in ("streaming", "pruned", "dense"):
        trainer = started(folder, kind, args.seq_len, args.compile)
        batch = trainer.batch(0)
        model = trainer.model

        def forward():
            with torch.no_grad():
                model(batch["input_ids"], attention_mask=batch["attention_mask"], document_ids=batch["document_ids"])

        model.eval()
        forward()
        row = {"model": kind, "forward_aten_ops": profiled_ops(forward)}
        if args.compile == "off":
            row.update({f"forward_{k}": v for k, v in dispatched(forward).items()})
        model.train()
        queue = getattr(trainer, "queue_step", trainer.train_step)  # (a commit before the deferred step log)
        row["step_aten_ops"] = profiled_ops(queue)
        if args.compile == "off":
            row.update({f"step_{k}": v for k, v in dispatched(queue).items()})
            if hasattr(trainer, "read_log"):  # the two steps' log, read at once
                row.update({f"log_read_{k}": v for k, v in dispatched(trainer.read_log).items()})
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
