"""The `xformers` backend's two layouts: how many keys each materialises, how much memory that is,
and what building each costs on the host (docs/benchmarks.md, "xformers").

Layouts only, no kernel: runs anywhere. In the *gathered* layout each tail segment's query block
gets its document's concepts up to the segment as keys, so concept keys are repeated once per
later segment (about C^2/2 per document), all at once, and kept for the backward in training. The
*shared-prefix* layout reads every key in place: a local partial (each block against itself) and
one partial per bit of the prefix length, merged by their log-sum-exps; each partial's copy of its
queries and keys is transient, and the backward keeps only one log-sum-exp per query and head.

For T tokens at a ratio r (concepts evenly spaced, one document per row) it prints the gathered
keys per token and their K/V of one deep layer for SmolLM2's heads in bf16 (training: K/V repeated
to the 9 query heads; inference: the 3 KV heads), the shared layout's partials and its largest
partial's K/V copy (repeated to the 9 query heads), the plain K/V of the same tokens, which layout
``layout=auto`` picks for a training step, and the host time to build each plan (index building,
the host syncs, xformers' per-block checks).

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
from concept_plugins.attention.xformers import XFormersConfig, XFormersPattern

HEADS, KV_HEADS, HEAD_DIM, BYTES = 9, 3, 64, 2  # SmolLM2-135M, bf16
PER_KEY = 2 * HEAD_DIM * BYTES  # K and V, one head


def build_ms(layout, which: str, repeats: int) -> tuple[XFormersPattern, float]:
    """A plan with the named layout built, and the median host time of building it."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = XFormersPattern(layout, XFormersConfig(kernel="reference", layout=which))
        getattr(plan, which)()
        times.append(time.perf_counter() - start)
    return plan, 1e3 * statistics.median(times)


def measure(T: int, ratio: float, repeats: int = 3) -> dict:
    keep = evenly_spaced_keep(T, ratio)[None]
    layout = pack(keep, torch.ones_like(keep))
    gathered, gathered_ms = build_ms(layout, "gathered", repeats)
    shared, shared_ms = build_ms(layout, "shared", repeats)
    keys = gathered.num_keys
    partials = shared.shared()
    auto = XFormersPattern(layout, XFormersConfig(kernel="reference")).layout_for(
        torch.empty(0, HEAD_DIM, dtype=torch.bfloat16), HEADS, training=True)
    return {
        "T": T, "ratio": ratio, "concepts": int(keep.sum()), "gathered_keys": keys, "keys_per_token": keys / T,
        "gathered_train_mib": keys * HEADS * PER_KEY / 2**20, "gathered_infer_mib": keys * KV_HEADS * PER_KEY / 2**20,
        "shared_partials": len(partials), "shared_keys": sum(p.kv_index.numel() for p in partials),
        "shared_largest_mib": max(p.kv_index.numel() for p in partials) * HEADS * PER_KEY / 2**20,
        "plain_kv_mib": T * KV_HEADS * PER_KEY / 2**20, "auto_training": auto,
        "gathered_plan_ms": gathered_ms, "shared_plan_ms": shared_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: small index ops do not wait on the other cores of a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(T, r) for T in args.lengths for r in args.ratios]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| T | r | concepts | gathered keys / token | gathered K/V per layer, training (MiB) | inference (MiB) "
          "| shared: partials | shared: keys read / token | shared: largest K/V copy (MiB) | plain K/V (MiB) "
          "| auto (training) | plan build gathered / shared (ms, host) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['ratio']} | {r['concepts']} | {r['keys_per_token']:.1f} | "
              f"{r['gathered_train_mib']:.0f} | {r['gathered_infer_mib']:.0f} | {r['shared_partials']} | "
              f"{r['shared_keys'] / r['T']:.2f} | "
              f"{r['shared_largest_mib']:.1f} | {r['plain_kv_mib']:.1f} | {r['auto_training']} | "
              f"{r['gathered_plan_ms']:.1f} / {r['shared_plan_ms']:.1f} |")


if __name__ == "__main__":
    main()
