"""Multi-token decoding with the MTP heads (``model.generate(..., mtp="verify" | "confadapt")``).

After token t the model's own logits give token t+1; MTP head i (``concept.mtp``) reads the
state of token t (the streaming model's shallow state; a dense baseline's last hidden state) and
drafts token t+1+i, for i = 1..k-1. One decoding step then feeds
the block ``[t+1, draft_2 .. draft_k]`` through the three caches in one forward of each stack
(``ConceptDecoder.extend``) and keeps a prefix of it (``ConceptDecoder.accept``), which leaves the
caches exactly as that many single steps would (the rejected suffix leaves no entry, concept or
policy state: tested).

* ``verify`` (lossless, Medusa / EAGLE style): keep the longest prefix whose every drafted token is
  the model's own greedy choice after the tokens before it, as the block's logits say. The output
  is token for token plain greedy decoding (tested); each step yields 1 + (drafts accepted)
  tokens, and the next step's first token is the model's greedy choice after the last one kept.
* ``confadapt`` (lossy, ConfAdapt): keep the longest prefix of drafts whose heads' top-1
  probability is >= ``mtp_tau`` (always the model's own first token), without checking them.
  Cheaper per step (only the kept tokens are fed), not equal to greedy: measure its quality.

Greedy only: sampling with ``verify`` would need speculative accept / reject sampling to keep the
output distribution, which is not built; both modes refuse ``do_sample`` and repetition penalties.
"""
from __future__ import annotations

import torch

from .errors import ConceptError

MODES = ("verify", "confadapt")


def check(model, settings) -> None:
    """Refuse what multi-token decoding cannot do, with the fix."""
    if getattr(model, "mtp_heads", None) is None:
        raise ConceptError(f"--mtp {settings.mtp}: this model has no MTP heads; build it with --length-policy mtp "
                           f"(`concept build --length-policy mtp --set length_policy.heads=4`) and train it (the "
                           f"`mtp` objective trains the heads by self-distillation), or train a baseline with "
                           f"`--mtp-heads 4`")
    if settings.do_sample:
        raise ConceptError(f"--mtp {settings.mtp} decodes greedily (exact speculative sampling is not built); "
                           f"leave sampling off (--temperature 0)")
    if settings.repetition_penalty != 1.0:
        raise ConceptError(f"--mtp {settings.mtp}: a repetition penalty is not supported with multi-token decoding")


def draft(model, decoder, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block to feed [B, k] (``first``, then heads 1..k-1 on the last fed token's shallow state)
    and the drafted tokens' top-1 probabilities [B, k-1]."""
    heads = model.mtp_heads
    h = decoder.draft_state()  # the last fed token's state the heads read
    probs, tokens = [], []
    for i in range(1, heads.k):
        p, tok = heads.top1(h, i)
        probs.append(p)
        tokens.append(tok)
    block = torch.stack([first, *tokens], dim=1)
    return block, (torch.stack(probs, dim=1) if probs else block.new_zeros(len(first), 0, dtype=torch.float))


def decode_step(model, decoder, first: torch.Tensor, mode: str, tau: float):
    """One multi-token step: (the fed block [B, n], its logits [B, n, V], tokens each row may keep [B]).
    The caller cuts the counts (end of sequence, budget) and calls ``decoder.accept``."""
    block, confidence = draft(model, decoder, first)
    if mode == "confadapt":
        count = 1 + torch.cumprod((confidence >= tau).long(), dim=1).sum(1)
        block = block[:, : int(count.max())]  # only what some row keeps is fed
        return block, decoder.extend(block), count
    logits = decoder.extend(block)
    agree = block[:, 1:] == logits[:, :-1].argmax(-1)  # each draft is the greedy choice after the tokens before it
    return block, logits, 1 + torch.cumprod(agree.long(), dim=1).sum(1)
