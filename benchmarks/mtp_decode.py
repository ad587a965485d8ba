"""Multi-token decoding measured side by side (docs/benchmarks.md, "Multi-token decoding").

For a run with MTP heads (``--length-policy mtp``), on prompts cut from a held-out split, in one
process and alternating rounds: plain greedy concept decoding, ``verify`` and ``confadapt`` at each
``--taus``, and the dense backbone (no adapters) greedy. Reported per mode: new tokens/s (median of
the rounds), the speed-up over plain concept decoding, forwards per prompt, mean tokens per forward,
agreement with plain greedy (the fraction of new tokens equal to greedy's at the same position, and
the mean length of the common prefix), and the bits/token of the emitted text under the dense
backbone given the prompt (how likely the base model finds it: a lossy mode's quality cost shows
as a rise over greedy's).

    python benchmarks/mtp_decode.py --model runs/mtp-train
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


def run_mode(model, prompts, new_tokens, mode):
    """(seconds, outputs) of generating from every prompt (one at a time, batch 1) in ``mode``."""
    kind, tau = mode
    start = time.perf_counter()
    outs = []
    for p in prompts:
        if kind == "dense":
            with adapters_disabled(model.backbone):
                from concept.decoding import DenseDecoder

                decoder = DenseDecoder(model.backbone)
                logits = decoder.prefill(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.bool))
                tokens = []
                for _ in range(new_tokens):
                    t = int(logits.argmax(-1))
                    tokens.append(t)
                    if len(tokens) < new_tokens:
                        logits = decoder.step(torch.tensor([t]))
            outs.append({"tokens": tokens, "forwards": new_tokens - 1})
            continue
        extra = {} if kind == "plain" else {"mtp": kind, **({"mtp_tau": tau} if tau is not None else {})}
        out = model.generate([p], max_new_tokens=new_tokens, eos_token_id=-1, **extra)
        outs.append({"tokens": out.tokens[0], "forwards": out.steps})
    return time.perf_counter() - start, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained run with MTP heads")
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
    modes = [("plain", None), ("verify", None), *(("confadapt", t) for t in args.taus), ("dense", None)]
    run_mode(model, prompts[:1], 4, ("plain", None))  # warm-up
    seconds = {m: [] for m in modes}
    outputs = {}
    for _ in range(args.rounds):
        for m in modes:
            s, outs = run_mode(model, prompts, args.new, m)
            seconds[m].append(s)
            outputs[m] = outs
    greedy = outputs[("plain", None)]
    plain_s = statistics.median(seconds[("plain", None)])
    rows = []
    for m in modes:
        outs, s = outputs[m], statistics.median(seconds[m])
        new = sum(len(o["tokens"]) for o in outs)
        forwards = sum(o["forwards"] for o in outs)
        same = sum(a == b for o, g in zip(outs, greedy) for a, b in zip(o["tokens"], g["tokens"]))
        prefix = []
        for o, g in zip(outs, greedy):
            n = 0
            while n < min(len(o["tokens"]), len(g["tokens"])) and o["tokens"][n] == g["tokens"][n]:
                n += 1
            prefix.append(n)
        bits = [dense_bits(model, p, o["tokens"]) for p, o in zip(prompts, outs)]
        rows.append({"mode": m[0] if m[1] is None else f"{m[0]} tau={m[1]}", "tokens_per_s": new / s,
                     "speedup_vs_plain": plain_s / s, "forwards_per_prompt": forwards / len(outs),
                     "tokens_per_forward": new / max(1, forwards),
                     "agree_with_greedy": same / max(1, new), "common_prefix": statistics.mean(prefix),
                     "dense_bits_per_token": sum(b for b, _ in bits) / max(1, sum(n for _, n in bits))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| mode | new tokens/s | vs plain | forwards / prompt | tokens / forward | agree with greedy "
          "| common prefix | bits/token under dense |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x | {r['forwards_per_prompt']:.1f} | "
              f"{r['tokens_per_forward']:.2f} | {100 * r['agree_with_greedy']:.0f}% | {r['common_prefix']:.1f} | "
              f"{r['dense_bits_per_token']:.3f} |")


if __name__ == "__main__":
    main()
