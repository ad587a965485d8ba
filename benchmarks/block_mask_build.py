"""What the `flex` backend's BlockMask costs to build: eager (the dense L x L mask, then its blocks), with
``create_block_mask(..., _compile=True)`` (what the backend did until 2026-11-27; deprecated by torch) and
``torch.compile(create_block_mask)`` (what torch advises instead); each the first build in the process
(compilation included) and the second (a new layout of the same length: what every later forward pays).

    .venv/bin/python -m benchmarks.block_mask_build                    # T = 2048, 8192; all three ways
    .venv/bin/python -m benchmarks.block_mask_build --lengths 16384 --ways eager

The layout: one row, concepts evenly spaced at 0.125 per token (the default operating point), the backend's
``ranges`` mask. Each way runs in a fresh process, so that every "first build" pays its own compilation.
The H100 lease of 2026-11-27 took 55.7 s for the first compiled build at 8k tokens and 3.6 ms for the second.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

WAYS = ("eager", "compile-flag", "torch-compile")


def build_once(way: str, T: int, device: str, shift: int):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from concept.flops import evenly_spaced_keep
    from concept.packing import pack
    from concept_plugins.attention.flex import ranges_mask

    keep = torch.roll(evenly_spaced_keep(T, 0.125), shift)[None].to(device)
    layout = pack(keep, torch.ones_like(keep))
    L = layout.length
    start = time.perf_counter()
    if way == "eager":
        mask = create_block_mask(ranges_mask(layout), 1, None, L, L, device=device, BLOCK_SIZE=128, _compile=False)
    elif way == "compile-flag":
        mask = create_block_mask(ranges_mask(layout), 1, None, L, L, device=device, BLOCK_SIZE=128, _compile=True)
    else:
        mask = torch.compile(create_block_mask)(ranges_mask(layout), 1, None, L, L, device=device, BLOCK_SIZE=128)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, mask


def one_way(way: str, T: int, device: str) -> dict:
    """In this process: the first and the second build (of a layout shifted by 3 tokens: another mask)."""
    import torch

    torch.set_num_threads(1)
    first, _ = build_once(way, T, device, 0)
    second, mask = build_once(way, T, device, 3)
    return {"way": way, "T": T, "first_s": round(first, 3), "second_s": round(second, 4),
            "kv_blocks": int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.block_mask_build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", nargs=2, metavar=("WAY", "T"), help=argparse.SUPPRESS)  # a child process's part
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_way(args.one[0], int(args.one[1]), args.device)))
        return 0
    print("| way | T | first build s | second build s |\n|---|---:|---:|---:|")
    for T in args.lengths:
        for way in args.ways:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.block_mask_build", "--one", way, str(T),
                                   "--device", args.device], capture_output=True, text=True)
            if proc.returncode:
                print(f"| {way} | {T} | failed: {proc.stderr.strip().splitlines()[-1][:200]} | |", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"| {way} | {T} | {r['first_s']:.3f} | {r['second_s']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
