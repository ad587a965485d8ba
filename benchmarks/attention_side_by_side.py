"""The deep attention's exact backends side by side in one process (issue 40): every backend and dense
causal SDPA called in turn in each round, the median of the rounds, so their ratios share the machine's
state. One layer with SmolLM2's heads (9 query heads, 3 KV heads, head_dim 64), concepts evenly spaced,
each plan built outside the timed call (a forward builds it once for all its deep layers).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attention_side_by_side.py                 # forward
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attention_side_by_side.py --backward      # forward + backward

Columns: milliseconds of each, its speed-up over dense causal attention, the ideal (causal pairs over the
rule's allowed pairs) and the pairs each backend computes (counted from its plan: tiles, chunks or the dense
mask), as a speed-up bound of its own.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from concept.attention import sdpa
from concept.flops import deep_pairs, evenly_spaced_keep
from concept.packing import pack
from concept.registry import registry

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BACKENDS = ("chunked", "cascade", "sdpa")


def computed_pairs(name: str, plan, layout) -> float:
    """Score pairs the backend's kernels compute (one head)."""
    C, L = layout.num_concepts, layout.length
    if name == "sdpa":
        return L * L
    if name == "cascade":
        return C * (C + 1) / 2 + sum(t.mask.numel() for t in plan.parts)
    return C * (C + 1) / 2 + sum(m.numel() for *_, m in plan.chunks)


def measure(T: int, ratio: float, rounds: int, backward: bool) -> dict:
    keep = evenly_spaced_keep(T, ratio)[None]
    layout = pack(keep, torch.ones_like(keep))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, T, HEAD_DIM, generator=g).requires_grad_(backward)
    k, v = (torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g).requires_grad_(backward) for _ in range(2))
    scale = HEAD_DIM ** -0.5
    names = [b for b in BACKENDS if b != "sdpa" or T <= 4096]  # the dense mask: T^2 per head and call
    plans = {b: registry("attention").get(b)().plan(layout) for b in names}
    calls = {"dense": lambda: sdpa(q, k, v, scale, is_causal=True).transpose(1, 2),
             **{b: (lambda p=p: p(q, k, v, scale)) for b, p in plans.items()}}

    def run(fn):
        with torch.set_grad_enabled(backward):
            out = fn()
            if backward:
                out.sum().backward()

    times = {name: [] for name in calls}
    for fn in calls.values():
        run(fn)
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            run(fn)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    causal = T * (T + 1) / 2
    return {"T": T, "ratio": ratio, "ideal": causal / deep_pairs(keep[0]), "ms": {n: 1e3 * m for n, m in med.items()},
            "speedup": {n: med["dense"] / m for n, m in med.items() if n != "dense"},
            "pairs_bound": {b: causal / computed_pairs(b, p, layout) for b, p in plans.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--ratios", default="0.1,0.125,0.25,0.5")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backward", action="store_true", help="time forward + backward (training)")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{'forward + backward' if args.backward else 'forward'}, median of {args.rounds} rounds")
    print("| T | r | dense ms | " + " | ".join(f"`{b}` ms (speed-up; pairs bound)" for b in BACKENDS) + " | ideal |")
    print("|---:|---:|---:|" + "---:|" * len(BACKENDS) + "---:|")
    for T in map(int, args.lengths.split(",")):
        for ratio in map(float, args.ratios.split(",")):
            r = measure(T, ratio, args.rounds, args.backward)
            cells = [f"{r['ms'][b]:.0f} ({r['speedup'][b]:.2f}x; {r['pairs_bound'][b]:.2f}x)" if b in r["speedup"] else "–"
                     for b in BACKENDS]
            print(f"| {T} | {ratio:g} | {r['ms']['dense']:.0f} | " + " | ".join(cells) + f" | {r['ideal']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
