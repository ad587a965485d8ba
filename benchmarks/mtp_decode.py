"""Multi-token decoding measured side by side (docs/benchmarks.md, "Multi-token decoding").

For a streaming run with MTP heads (``--length-policy mtp``) and optionally a dense / pruned
baseline run (with ``--mtp-heads``), on prompts cut from a held-out split, in one process and
alternating rounds: each model's plain greedy decoding, ``verify``, and ``confadapt`` at each
``--taus``. Reported per mode: new tokens/s (median of the rounds), the speed-up over plain
concept decoding and over the model's own greedy decoding, forwards per prompt, new tokens per
decoding forward, agreement with the model's greedy output (the fraction of new tokens equal at
the same position, and the mean common-prefix length), and the bits/token of the emitted text
under the backbone without adapters, given the prompt (a lossy mode's quality cost shows as a
rise over greedy's).

    python benchmarks/mtp_decode.py --model runs/mtp-train --dense runs/dense-mtp
    python benchmarks/mtp_decode.py --model runs/mtp-train --data pydoc --prompts 8 --new 64 --json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import concept
from concept import data as concept_data
from concept.teacher import adapters_disabled


def prompts_from(model, source: str, count: int, length: int) -> list[list[int]]:
    tokenizer = concept_data.tokenizer_for(model)
    docs = concept_data.read_documents(source, "heldout" if concept_data.builtin_corpus(source) else "all")
    packed = concept_data.PackedSequences(docs, tokenizer, length, seed=1)
    rows = packed.batch(0, count)["input_ids"]
    return [r.tolist() for r in rows]


@torch.no_grad()
def dense_bits(model, prompt: list[int], new: list[int]) -> tuple[float, int]:
    """(sum of -log2 p(new token | before) under the backbone without adapters, tokens)."""
    if not new:
        return 0.0, 0
    ids = torch.tensor([prompt + new])
    with adapters_disabled(model.backbone):
        logits = model.backbone(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(new), reduction="sum")
    return float(nll) / math.log(2), len(new)


def run_mode(prompts, new_tokens, mode):
    """(seconds, outputs) of generating from every prompt (one at a time, batch 1) in ``mode``:
    (label, model, generate keyword arguments)."""
    _, model, extra = mode
    start = time.perf_counter()
    outs = []
    for p in prompts:
        out = model.generate([p], max_new_tokens=new_tokens, eos_token_id=-1, **extra)
        outs.append({"tokens": out.tokens[0], "forwards": out.steps})
    return time.perf_counter() - start, outs


def modes_for(label: str, model, taus) -> list:
    if model.mtp_heads is None:
        return [(label, model, {})]
    return [(label, model, {}), (f"{label} verify", model, {"mtp": "verify"}),
            *((f"{label} confadapt tau={t}", model, {"mtp": "confadapt", "mtp_tau": t}) for t in taus)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained streaming run with MTP heads (--length-policy mtp)")
    parser.add_argument("--dense", help="a trained dense / pruned baseline run (with --mtp-heads: its modes too)")
    parser.add_argument("--data", default="stdlib", help="held-out prompts from this corpus (default: stdlib)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.9, 0.7, 0.5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = concept.load(args.model).eval()
    if model.mtp_heads is None:
        raise SystemExit(f"{args.model} has no MTP heads (build with --length-policy mtp)")
    prompts = prompts_from(model, args.data, args.prompts, args.prompt_len)
    modes = modes_for("concept", model, args.taus)
    if args.dense:
        dense = concept.load(args.dense).eval()
        modes += modes_for(dense.family, dense, args.taus)
    run_mode(prompts[:1], 4, modes[0])  # warm-up
    seconds = {m[0]: [] for m in modes}
    outputs = {}
    for _ in range(args.rounds):
        for m in modes:
            s, outs = run_mode(prompts, args.new, m)
            seconds[m[0]].append(s)
            outputs[m[0]] = outs
    greedy = {"concept": outputs["concept"]}
    base_s = {}
    for label, m, extra in modes:
        if not extra:  # plain greedy of each model: the reference of its own modes
            greedy[label], base_s[label] = outputs[label], statistics.median(seconds[label])
    rows = []
    for label, m, extra in modes:
        family = next(g for g in sorted(greedy, key=len, reverse=True) if label.startswith(g))
        outs, s = outputs[label], statistics.median(seconds[label])
        new = sum(len(o["tokens"]) for o in outs)
        forwards = sum(o["forwards"] for o in outs)
        same = sum(a == b for o, g in zip(outs, greedy[family]) for a, b in zip(o["tokens"], g["tokens"]))
        prefix = []
        for o, g in zip(outs, greedy[family]):
            n = 0
            while n < min(len(o["tokens"]), len(g["tokens"])) and o["tokens"][n] == g["tokens"][n]:
                n += 1
            prefix.append(n)
        bits = [dense_bits(model, p, o["tokens"]) for p, o in zip(prompts, outs)]
        rows.append({"mode": label, "tokens_per_s": new / s, "speedup_vs_plain_concept": base_s["concept"] / s,
                     "speedup_vs_own_greedy": base_s[family] / s, "forwards_per_prompt": forwards / len(outs),
                     "tokens_per_forward": new / max(1, forwards),
                     "agree_with_greedy": same / max(1, new), "common_prefix": statistics.mean(prefix),
                     "dense_bits_per_token": sum(b for b, _ in bits) / max(1, sum(n for _, n in bits))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| mode | new tokens/s | vs plain concept | vs its own greedy | forwards / prompt | tokens / forward "
          "| agree with its greedy | common prefix | bits/token under the backbone |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain_concept']:.2f}x | "
              f"{r['speedup_vs_own_greedy']:.2f}x | {r['forwards_per_prompt']:.1f} | "
              f"{r['tokens_per_forward']:.2f} | {100 * r['agree_with_greedy']:.0f}% | {r['common_prefix']:.1f} | "
              f"{r['dense_bits_per_token']:.3f} |")


if __name__ == "__main__":
    main()
