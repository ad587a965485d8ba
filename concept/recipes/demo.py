"""`python -m concept.recipes.demo RUN_DIR`: run a built concept model next to its dense backbone.

Feeds a slice of a Python standard-library source file (always on the machine) to both
models and prints, side by side: next-token NLL in bits per token, the realised concepts
per token, forward time measured in the same run, and the ideal FLOP speed-up for that
ratio. An untrained model (straight after ``concept build``) is expected to be much worse
than the backbone; training closes the gap.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .. import load
from ..errors import ConceptError
from ..flops import Shape, forward_flops
from ..losses import next_token_loss


def stdlib_text(name: str = "textwrap.py") -> str:
    path = Path(warnings.__file__).parent / name
    return path.read_text(encoding="utf-8")


def best_time(fn, repeats: int = 2) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(model, ids: torch.Tensor, repeats: int = 2) -> dict:
    """The demo's numbers for ``ids`` (1, T): next-token NLL in bits per token of the dense backbone and
    of the concept model, the concept model's realised concepts per token, the best forward time of each
    (seconds, measured side by side), and the ideal FLOP speed-up of the concept model's decisions."""
    torch.manual_seed(0)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out = model(ids)
        dense_logits = model.backbone(ids).logits
        dense_s = best_time(lambda: model.backbone(ids), repeats)
        concept_s = best_time(lambda: model(ids, keep=out.keep), repeats)
    bits = lambda logits: next_token_loss(logits, ids, valid).item() / math.log(2)  # noqa: E731
    ideal = forward_flops(Shape.from_hf_config(model.backbone.config), model.split, out.keep[0],
                          out.head_logits.shape[-1], emit=model.emit)
    return {"dense_bits": bits(dense_logits), "concept_bits": bits(out.logits), "ratio": out.keep.float().mean().item(),
            "dense_s": dense_s, "concept_s": concept_s, "ideal_speedup": ideal.speedup}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m concept.recipes.demo", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run folder written by `concept build`")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--file", default="textwrap.py", help="standard-library file to read")
    args = parser.parse_args(argv)
    err = Console(stderr=True)
    try:
        model = load(args.run)
    except ConceptError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return exc.exit_code
    if model.tokenizer is None:
        err.print("[red]error:[/red] this backbone has no tokenizer; the demo needs a pretrained backbone (e.g. smollm2)")
        return 1
    ids = model.tokenizer(stdlib_text(args.file), return_tensors="pt").input_ids[:, : args.tokens]
    err.print(f"running {ids.shape[1]} tokens of Lib/{args.file} through both models ...")
    result = compare(model, ids)
    table = Table(title=f"{args.run}: concept model vs dense backbone on the same {ids.shape[1]} tokens")
    table.add_column("")
    table.add_column("dense backbone", justify="right")
    table.add_column("concept model", justify="right")
    table.add_row("NLL (bits/token)", f"{result['dense_bits']:.3f}", f"{result['concept_bits']:.3f}")
    table.add_row("concepts per token", "-", f"{result['ratio']:.3f}")
    table.add_row("forward time (s, best of 2)", f"{result['dense_s']:.3f}", f"{result['concept_s']:.3f}")
    table.add_row("speed-up measured / ideal (FLOPs)", "1.00",
                  f"{result['dense_s'] / result['concept_s']:.2f} / {result['ideal_speedup']:.2f}")
    Console().print(table)
    err.print("note: straight after `concept build` the new modules are at initialisation (untrained), "
              "so the concept model's NLL is not yet meaningful.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
