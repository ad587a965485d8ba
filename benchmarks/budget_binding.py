"""How often a static concept budget binds: the share of a run's own boundaries (its length policy's decisions on
training batches, as the trainer feeds them) that ``ceil(R n) + slack`` would drop, for a few budgets R (in units
of the run's target ratio) and slacks. What ``max_ratio="auto"`` was chosen from (``concept.streaming.budget``).

    python benchmarks/budget_binding.py RUN [--batches 20] [--seq-len 256] [--batch 8] [--data prose]
"""
from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

from concept import packing
from concept.streaming import gap
from concept.training import TrainConfig, Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--data", default=None, help="a corpus other than the run's (e.g. prose)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = pathlib.Path(tempfile.mkdtemp()) / "probe"
    config = TrainConfig(steps=1, seq_len=args.seq_len, batch=args.batch, data=args.data)
    trainer = Trainer.start(args.run, out, config)
    model = trainer.model.eval()
    target = gap.target_of(model.length_policy)
    cases = [(h, s) for h in (1.25, 1.5, 2.0, 3.0) for s in (0, 1, 2, 3, 4, 6, 8)]
    found = {case: [0, 0] for case in cases}
    with torch.no_grad():
        for i in range(args.batches):
            b = trainer.batch(i)
            valid = b["attention_mask"].bool()
            starts = packing.document_starts(valid, b["document_ids"])
            h = model.shallow_states(b["input_ids"], valid, b["document_ids"])
            chosen = model.length_policy.decide(h, model.vocabulary.logits(h), valid, starts).bool() & valid
            for headroom, slack in cases:
                kept = packing.cap_boundaries(chosen, valid, min(1.0, headroom * target), slack=slack)
                found[headroom, slack][0] += int(chosen.sum())
                found[headroom, slack][1] += int((chosen & ~kept).sum())
    tokens = args.batches * args.batch * args.seq_len
    print(f"{args.run}: target ratio {target:g}, {tokens} tokens, {found[cases[0]][0]} boundaries")
    print("| budget R | slack | boundaries dropped | share |\n|---|---:|---:|---:|")
    for (headroom, slack), (total, dropped) in found.items():
        print(f"| {headroom:g} x target = {min(1.0, headroom * target):g} | {slack} | {dropped} | "
              f"{dropped / max(1, total):.2%} |")


if __name__ == "__main__":
    main()
