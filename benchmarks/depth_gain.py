"""Where is depth needed? The ceiling of concept placement, forward only (docs/results.md,
"Learned placement").

A streaming model predicts the next token through all layers at a concept and through
``Ls + Ld`` layers (plus attention to the concepts) at a tail token. This script measures how
much *where* the concepts go could matter, with two models of the same backbone:

* ``full``: the backbone (a build with every token a concept is exactly the backbone);
* ``small``: a trained run folder of the all-tail path, i.e. the pruned baseline that skips the
  middle stack (``concept train BUILD --baseline pruned --prune-layers Ls:Ls+Lm``).

For a ratio r it picks, in each held-out row, r of the positions by a score and reports the
*mixture estimate* of bits/token: the full model's NLL at the picked positions, the small
model's elsewhere. Scores: the non-causal oracle (the NLL gain itself), KL(full || small) at t
(causal: it reads tokens <= t only; what ``--placement`` trains the head to predict, with the
run's own skip-middle path as ``small``), KL(full || the untrained skip-middle path), a ridge
regression and a small MLP of the layer-``Ls`` state fitted on the stdlib *training* split to
log KL (what a head reading the shallow state can learn), and every 1/r-th token.

The estimate leaves out two things a real streaming model has: the concepts' own loss (their
middle stack sees only concepts) and their role as the tail's only memory of earlier segments.
The trained runs in docs/results.md show the second one dominates.

    concept build -o /tmp/b --split 4,22,4 --force
    concept train /tmp/b --baseline pruned --prune-layers 4:26 --out /tmp/p8 --steps 100 --seq-len 128 \\
        --batch 4 --lr 1e-3 --warmup 10
    python benchmarks/depth_gain.py --small /tmp/p8 --split 4,22,4 --ratio 0.25
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F


def main() -> None:
    import concept
    from concept import data as cd
    from concept.losses import next_token_loss
    from concept.streaming.objectives import depth_gain, top_fraction

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", required=True, help="trained all-tail (pruned, middle skipped) run folder")
    ap.add_argument("--split", default="4,22,4")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batches", type=int, default=2, help="held-out batches of 4 rows per domain")
    ap.add_argument("--fit-batches", type=int, default=6, help="training batches of 4 rows for the ridge / MLP")
    args = ap.parse_args()
    torch.manual_seed(0)
    small = concept.load(args.small).eval()
    full = concept.build(concept.BuildConfig(split=args.split)).eval()
    tok = cd.tokenizer_for(full)

    def pieces(b):
        ids, mask, doc = b["input_ids"], b["attention_mask"], b["document_ids"]
        with torch.no_grad():
            out = full(ids, mask, keep=mask.bool(), document_ids=doc)
            s = small(ids, attention_mask=mask, document_ids=doc).logits
            u = full.skip_middle(ids, mask, doc)
        nll = lambda lg: next_token_loss(lg.float(), ids, mask.bool(), doc, reduction="none")  # noqa: E731
        d = out.logits[:, :-1]
        return out.shallow[:, :-1], depth_gain(d, s[:, :-1]), depth_gain(d, u[:, :-1]), nll(out.logits), nll(s)

    train = cd.PackedSequences(cd.read_documents("stdlib", "train"), tok, args.seq_len, seed=0)
    X, Y = [], []
    for i in range(args.fit_batches):
        h, kl, *_ = pieces(train.batch(i, 4))
        X.append(h.reshape(-1, h.shape[-1]))
        Y.append(torch.log(kl.reshape(-1) + 1e-3))
    X, Y = torch.cat(X), torch.cat(Y)
    mu, sd = X.mean(0), X.std(0) + 1e-6
    A = torch.cat([(X - mu) / sd, torch.ones(len(X), 1)], 1).double()
    w = torch.linalg.solve(A.T @ A + 10.0 * torch.eye(A.shape[1], dtype=torch.double), A.T @ Y.double()).float()
    mlp = torch.nn.Sequential(torch.nn.Linear(X.shape[1], 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(mlp.parameters(), 1e-3, weight_decay=1e-2)
    for _ in range(1500):
        idx = torch.randint(len(X), (512,))
        loss = F.mse_loss(mlp(A[idx, :-1].float()).squeeze(-1), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    every = round(1 / args.ratio)
    print(f"split {args.split}, r = {args.ratio}, seq-len {args.seq_len}; small = {args.small}; "
          f"predictors fitted on {len(X)} stdlib training positions")
    for dom in ("stdlib", "pydoc"):
        packed = cd.PackedSequences(cd.read_documents(dom, "heldout"), tok, args.seq_len, seed=0)
        acc, n = {}, 0
        for i in range(args.batches):
            h, kl, klu, nd, ns = pieces(packed.batch(i, 4))
            m = (nd != 0) | (ns != 0)
            hn = (h - mu) / sd
            with torch.no_grad():
                scores = {"oracle: NLL gain (non-causal)": ns - nd, "KL(full || small)": kl,
                          "KL(full || untrained skip-middle)": klu,
                          "ridge on the layer-Ls state": torch.cat([hn, torch.ones(*hn.shape[:2], 1)], -1) @ w,
                          "MLP on the layer-Ls state": mlp(hn).squeeze(-1),
                          f"every {every}th token": (torch.arange(h.shape[1]) % every == every - 1).float().expand_as(kl)
                          - 1e-6 * torch.arange(h.shape[1])}  # (ties broken: top_fraction keeps all tied)
            for name, score in scores.items():
                picked = top_fraction(score, m, args.ratio)
                acc[name] = acc.get(name, 0.0) + float(torch.where(picked, nd, ns)[m].sum())
            acc["full model"] = acc.get("full model", 0.0) + float(nd[m].sum())
            acc["small model (no concept)"] = acc.get("small model (no concept)", 0.0) + float(ns[m].sum())
            n += int(m.sum())
        print(f"\n{dom}: mixture estimate, bits/token ({n} positions)")
        for name, v in acc.items():
            print(f"  {name:36s} {v / n / math.log(2):6.2f}")


if __name__ == "__main__":
    main()
