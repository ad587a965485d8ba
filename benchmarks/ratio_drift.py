"""Ratio drift across domains: the realised concepts / token of the `null` length policy on code
and on prose, with its per-document ratio tracker off (gain 0) and at several gains, in keep-logit
units per token of lag (docs/results.md, "Second domain").

Forward only: the model's shallow stack and ConceptHead give every token's keep logit (no
training needed; pass a trained run to measure its head). For each gain the NULL bias is
calibrated the way the trainer's ratio controller does it at the end of a run (``RatioControl.finish``) (``PIController.calibrate_exact``:
bisection on the realised ratio, forced concepts and the tracker included) on rows of the
stdlib *training* split; then the realised ratio is measured, with that bias, on held-out
stdlib (code, in domain), on the `pydoc` corpus (English prose) and, when Debian's
``python3.11-doc`` is installed, on its tutorial / howto / faq reST sources (prose the model
has seen nowhere). ``agree``: the fraction of held-out code decisions equal to the gain-0
ones (how much the tracker overrides the head in domain). ``--stress F`` adds a synthetic
column: the pydoc keep logits lowered by the constant that puts the untracked (gain-0) ratio
at F x target (0.62: the -38% of a demo-trained head on prose, issue 10). ``--domain NAME=SOURCE``
adds a column for any text ``concept eval --data`` reads (read whole).

    concept build -o /tmp/m --force
    python benchmarks/ratio_drift.py --model /tmp/m                  # seq-len 128 and 512
    python benchmarks/ratio_drift.py --model runs/x-train --gains 0 0.5 1 --domain readmes=/data/readmes --json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from concept.streaming.operating_point import DEFAULT_TARGET_RATIO

PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")


def domains(extra=()) -> dict:
    """The built-in domains, then ``extra`` ("NAME=SOURCE" strings) in order."""
    from concept.data import read_documents

    out = {"code (stdlib held-out)": read_documents("stdlib", "heldout"),
           "prose (pydoc)": read_documents("pydoc", "all")}
    folders = [PYDOC_SOURCES / f for f in ("tutorial", "howto", "faq") if (PYDOC_SOURCES / f).is_dir()]
    if folders:
        out["prose (python3.11-doc)"] = [d for f in folders for d in read_documents(f, "all")]
    for item in extra:
        name, sep, source = item.partition("=")
        if not sep or not name or not source:
            raise SystemExit(f"--domain {item!r}: expected NAME=SOURCE, e.g. --domain readmes=/data/readmes")
        out[name] = read_documents(source, "all")
    return out


@torch.no_grad()
def keep_logits(model, docs, tokenizer, seq_len: int, rows: int, chunk: int = 8):
    """Raw keep logits (without the NULL bias) [N, T], valid and document starts, of ``rows``
    seeded rows of the packed documents."""
    from concept.data import PackedSequences
    from concept.packing import document_starts

    packed = PackedSequences(docs, tokenizer, seq_len, seed=0)
    batch = packed.batch(0, min(rows, len(packed)))
    policy = model.length_policy
    out = []
    for i in range(0, batch["input_ids"].shape[0], chunk):
        ids, doc = batch["input_ids"][i:i + chunk], batch["document_ids"][i:i + chunk]
        valid = torch.ones_like(ids, dtype=torch.bool)
        h = model.shallow_states(ids, valid, doc)
        out.append(policy.keep_logit(model.vocabulary.logits(h)) + policy.null_bias)
    valid = torch.ones_like(batch["input_ids"], dtype=torch.bool)
    return torch.cat(out), valid, document_starts(valid, batch["document_ids"])


def light_policy(max_run: int, track: float, target: float):
    """The same `null` policy over a one-concept head: logits [x, 0] have keep logit x - bias."""
    from concept.components import BuildContext
    from concept_plugins.length_policies.null import NullPolicy, NullPolicyConfig

    ctx = BuildContext(hidden_size=1, vocab_size=1, num_layers=3, split=(1, 1, 1), concept_vocab_size=1)
    policy = NullPolicy(NullPolicyConfig(max_run=max_run, track=track), ctx)
    policy.target_ratio.fill_(target)
    return policy


def as_head(logit):
    return torch.stack([logit, torch.zeros_like(logit)], dim=-1)


def stressed(prose, calib, max_run: int, args):
    """``prose`` with its keep logits lowered by the constant that gives the untracked policy,
    calibrated on ``calib``, a ratio of ``args.stress * args.target``."""
    from concept.streaming.ratio import PIController

    policy = light_policy(max_run, 0.0, args.target)
    PIController(args.target).calibrate_exact(policy, as_head(calib[0]), calib[1], calib[2])
    logit, valid, reset = prose
    lo, hi = -20.0, 20.0
    for _ in range(40):  # the ratio falls as the shift rises
        mid = 0.5 * (lo + hi)
        ratio = float(policy.decide(None, as_head(logit - mid), valid, reset)[valid].float().mean())
        lo, hi = (mid, hi) if ratio > args.stress * args.target else (lo, mid)
    return logit - 0.5 * (lo + hi), valid, reset


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/m", help="a run folder (built or trained)")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--gains", type=float, nargs="+", default=[0.0, 0.125, 0.25, 0.5, 1.0],
                    help="tracker gains (keep-logit units per token of lag; 0 = off)")
    ap.add_argument("--target", type=float, default=DEFAULT_TARGET_RATIO)
    ap.add_argument("--domain", action="append", default=[], metavar="NAME=SOURCE", help="another domain (repeatable)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per domain and sequence length")
    ap.add_argument("--calibration-rows", type=int, default=64, help="stdlib training rows for the bias")
    ap.add_argument("--stress", type=float, default=0.62, help="synthetic shift: untracked prose ratio / target (0: off)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import concept
    from concept.data import read_documents, tokenizer_for
    from concept.streaming.ratio import PIController

    model = concept.load(args.model).eval()
    tokenizer = tokenizer_for(model)
    max_run = model.length_policy.max_run
    sources = domains(args.domain)
    train = read_documents("stdlib", "train")
    rows = []
    for T in args.seq_len:
        start = time.perf_counter()
        calib = keep_logits(model, train, tokenizer, T, args.calibration_rows)
        data = {name: keep_logits(model, docs, tokenizer, T, max(1, args.tokens // T)) for name, docs in sources.items()}
        if args.stress:
            data[f"prose (pydoc) shifted to {args.stress:g}x"] = stressed(data["prose (pydoc)"], calib, max_run, args)
        base = {}
        for gain in args.gains:
            policy = light_policy(max_run, gain, args.target)
            logit, valid, reset = calib
            PIController(args.target).calibrate_exact(policy, as_head(logit), valid, reset)
            row = {"seq_len": T, "gain": gain, "null_bias": float(policy.null_bias)}
            for name, (logit, valid, reset) in data.items():
                keep = policy.decide(None, as_head(logit), valid, reset)
                row[name] = float(keep[valid].float().mean())
                if name.startswith("code"):
                    base.setdefault(name, keep)
                    row["agree"] = float((keep == base[name])[valid].float().mean())
            rows.append(row)
        if not args.json:
            print(f"seq-len {T}: {', '.join(f'{n} {int(v[1].sum()):,} tokens' for n, v in data.items())} "
                  f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        print(json.dumps(rows, indent=1))
        return rows
    names = [n for n in rows[0] if n not in ("seq_len", "gain", "null_bias", "agree")]
    print(f"\ntarget {args.target}, max_run {max_run}, bias calibrated on {args.calibration_rows} stdlib training rows")
    print("| seq-len | gain | " + " | ".join(names) + " | agree (code) |")
    print("|---:|---:|" + "---:|" * len(names) + "---:|")
    for r in rows:
        cells = [f"{r[n]:.3f} ({100 * (r[n] / args.target - 1):+.0f}%)" for n in names]
        print(f"| {r['seq_len']} | {r['gain']:g} | " + " | ".join(cells) + f" | {r['agree']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
