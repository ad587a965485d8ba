"""The `xformers` backend's gathered key/value layout: how many keys it gathers, how much memory
that is, and what building it costs on the host (docs/benchmarks.md, "xformers").

Layout only, no kernel: runs anywhere. Each tail segment's query block gets its document's
concepts up to the segment as keys, so concept keys are repeated once per later segment (about
C^2/2 per document). For T tokens at a ratio r (concepts evenly spaced, one document per row) it
prints the gathered keys per token, the gathered K/V of one deep layer for SmolLM2's heads in
bf16 (training: K/V repeated to the 9 query heads; inference: the 3 KV heads) next to the plain
K/V of the same tokens, and the host time of one plan (index building, the one sync, xformers'
per-block checks).

    python benchmarks/gathered_kv.py
    python benchmarks/gathered_kv.py --lengths 8192 16384 32768 --ratios 0.25 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from concept.flops import evenly_spaced_keep
from concept.packing import pack
from concept_plugins.attention.xformers import XFormersConfig, XFormersPlan

HEADS, KV_HEADS, HEAD_DIM, BYTES = 9, 3, 64, 2  # SmolLM2-135M, bf16


def measure(T: int, ratio: float, repeats: int = 3) -> dict:
    keep = evenly_spaced_keep(T, ratio)[None]
    layout = pack(keep, torch.ones_like(keep))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = XFormersPlan(layout, XFormersConfig(kernel="reference"))
        times.append(time.perf_counter() - start)
    keys = plan.num_keys
    per_key = 2 * HEAD_DIM * BYTES  # K and V
    return {
        "T": T, "ratio": ratio, "concepts": int(keep.sum()), "blocks": len(plan.bias.q_seqinfo.seqstart_py) - 1,
        "gathered_keys": keys, "keys_per_token": keys / T,
        "train_mib": keys * HEADS * per_key / 2**20, "infer_mib": keys * KV_HEADS * per_key / 2**20,
        "plain_kv_mib": T * KV_HEADS * per_key / 2**20, "plan_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(T, r) for T in args.lengths for r in args.ratios]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| T | r | concepts | blocks | gathered keys | keys / token | K/V per layer, training (MiB) "
          "| inference (MiB) | plain K/V (MiB) | plan build (ms, host) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['ratio']} | {r['concepts']} | {r['blocks']} | {r['gathered_keys']:,} | "
              f"{r['keys_per_token']:.1f} | {r['train_mib']:.0f} | {r['infer_mib']:.0f} | {r['plain_kv_mib']:.1f} | "
              f"{r['plan_ms']:.1f} |")


if __name__ == "__main__":
    main()
