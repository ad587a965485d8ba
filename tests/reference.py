"""The slow, obviously correct oracle: one deep pass per position t over Z_t (SPEC §2.1).

For each real token t of each row:  Z_t = [concepts emitted at positions <= t ; h_shallow[tau(t)+1 .. t]]
with plain causal attention inside Z_t, and the logits for x[t+1] read from the last element.
Shallow states come from the backbone's ordinary Hugging Face forward; the middle stack runs
once over the row's concepts with plain causal attention. No packing, no custom masks.
"""
from __future__ import annotations

import torch

from concept.backbone import decoder


def _run(model, layers, x, position_ids):
    cos_sin = decoder(model.backbone).rotary_emb(x, position_ids)
    for layer in layers:  # attention_mask=None: transformers' own causal SDPA
        x = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)
    return x


def shallow_states(model, input_ids, valid):
    """h after the shallow stack, from the plain HF forward (hidden_states[Ls])."""
    inner = decoder(model.backbone)
    x = model.positions.add_text_type(inner.embed_tokens(input_ids))
    pos = (torch.cumsum(valid.long(), 1) - 1).clamp(min=0)
    out = inner(inputs_embeds=x, attention_mask=valid.long(), position_ids=pos, output_hidden_states=True)
    return out.hidden_states[model.split[0]]


def reference_logits(model, input_ids, attention_mask=None, keep=None, deep_positions="scheme"):
    """Logits [B, T, V] by the naive per-t loop (padding positions left at zero).

    ``deep_positions="packed-index"`` numbers Z_t's elements 0..len-1 instead (a wrong rule, for
    negative controls).
    """
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    h = shallow_states(model, input_ids, valid)
    _, probs, keep, token_ids = model.decide(h, valid, keep)  # every token's would-be concept (all levels)
    L = model.levels  # code levels: each concept is L consecutive slots
    M = getattr(model.length_policy, "emit", 1)  # concepts per emitting token
    inner = decoder(model.backbone)
    B, T = input_ids.shape
    logits = h.new_zeros(B, T, model.backbone.config.vocab_size)
    for b in range(B):
        times = valid[b].nonzero().flatten()  # real tokens of this row, in order
        pos = torch.arange(len(times))
        kept = keep[b, times]
        # the M concepts of an emitting token i take ids and positions from tokens i-M+1 .. i, L levels each
        emitting = kept.nonzero().flatten().tolist()
        src = torch.tensor([i - M + 1 + m for i in emitting for m in range(M) for _ in range(L)], dtype=torch.long)
        level = torch.tensor([lv for _ in emitting for _ in range(M) for lv in range(L)], dtype=torch.long)
        c_times = times[src]
        c_pos = pos[src]
        c_rank = torch.arange(len(c_times))
        middle_out = None
        if len(c_times):
            e = model.concept_inputs(probs[b:b + 1], token_ids[b:b + 1], c_times[None], h[b:b + 1],
                                     None if L == 1 else level[None])
            e = model.positions.add_concept_type(e)
            middle_pos = model.positions.concept_positions(c_pos[None], c_rank[None], "middle")
            middle_out = _run(model, model.middle, e, middle_pos)[0]
            update = middle_out - e[0]  # what the middle stack added to each concept
        for i, t in enumerate(times.tolist()):
            n_c = M * L * int(kept[: i + 1].sum())  # concepts emitted at positions <= t
            last = int(kept[: i + 1].nonzero().max()) if n_c else -1  # tau(t), as an index into `times`
            tail_idx = times[last + 1: i + 1]
            tail = h[b, tail_idx][None]
            if model.tail_fusion is not None and model.tail_fusion.needs_update:  # the latest concept's update
                u = update[n_c - 1].expand_as(tail) if n_c else torch.zeros_like(tail)
                tail = model.tail_fusion(tail, u, torch.full(tail.shape[:2], n_c > 0))
            parts = [tail[0]]
            tail_pos = model.positions.text_positions(pos[last + 1: i + 1][None])[0]
            part_pos = [tail_pos]
            if n_c:
                parts.insert(0, middle_out[:n_c])
                part_pos.insert(0, model.positions.concept_positions(c_pos[None, :n_c], c_rank[None, :n_c], "deep")[0])
            z = torch.cat(parts)[None]
            z_pos = torch.cat(part_pos)[None]
            if deep_positions == "packed-index":
                z_pos = torch.arange(z.shape[1])[None]
            out = _run(model, model.deep, z, z_pos)
            logits[b, t] = model.backbone.lm_head(inner.norm(out[0, -1]))
    return logits, keep
