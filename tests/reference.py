"""The slow, obviously correct oracle: one deep pass per position t over Z_t.

For each real token t of each row:  Z_t = [concepts emitted at positions <= t ; h_shallow[tau(t)+1 .. t]]
with plain causal attention inside Z_t, and the logits for x[t+1] read from the last element.
Shallow states come from the backbone's ordinary Hugging Face forward; the middle stack runs
once over the row's concepts with plain causal attention. No packing, no custom masks.

The oracle shares nothing it checks: positions (every scheme), type embeddings, concept inputs
(hard / soft / straight-through embeddings, latent feedback, multi-level codes, the identity start) and
the tail fusions (``update``, ``bridge``) are computed here from their definitions and the modules'
parameters, never through the model's methods. It reuses only what other tests check on their own:
the keep decisions and concept ids (``decide``, against the policies' step-wise rules in
tests/test_policies.py and tests/test_null_policy.py).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from concept.backbone import decoder
from concept.planner.model import after_end
from concept.syncs import declared


def component(model, slot: str) -> str:
    return model.resolution.components[slot].name


# -- positions and type embeddings, by definition -----------------------------------------------------
def text_position(model, index: torch.Tensor) -> torch.Tensor:
    """Every scheme: a text token sits at its index among its row's real tokens."""
    return index


def concept_position(model, index: torch.Tensor, rank: torch.Tensor, stack: str) -> torch.Tensor:
    """A concept slot taking its position from the token at ``index``, ``rank``-th concept slot of its row:
    ``time``: the token's index (both stacks); ``per-type``: its rank among the concepts plus the scheme's
    fixed offset (both stacks); ``compact``: its rank in the middle stack, the token's index in the deep."""
    scheme = component(model, "position_scheme")
    if scheme == "time":
        return index
    if scheme == "per-type":
        return rank + model.resolution.components["position_scheme"].config.offset
    if scheme == "compact":
        return rank if stack == "middle" else index
    raise NotImplementedError(f"the reference has no definition of the {scheme!r} position scheme; add it here")


def with_type(model, x: torch.Tensor, kind: int) -> torch.Tensor:
    """``per-type`` adds its learned type row (0: text, 1: concept) to every input; the others add nothing."""
    table = getattr(model.positions, "type_embedding", None)
    return x if table is None else x + table.weight[kind]


# -- concept inputs, by definition -----------------------------------------------------------------------
def concept_rows(model, level: int) -> torch.Tensor:
    """[K, d] the middle-stack input of every concept id at code level ``level``."""
    vocab, name = model.vocabulary, component(model, "vocabulary")
    if name == "embedding":
        return vocab.table.weight
    if name == "codebook":  # proj_in(book[id]) = book[id] @ W^T, linear in the book's rows
        book = vocab.codebook if level == 0 else vocab.deeper[level - 1]
        return book @ vocab.proj_in.weight.T
    if name == "fsq":  # proj_up(grid values of id k's digits), dimension 0 the most significant (+ level l's vector)
        dims = list(vocab.levels_per_dim)
        digits = torch.tensor(list(itertools.product(*(range(n) for n in dims))))  # row k: k's digits
        values = torch.stack([-1 + 2 * digits[:, i].double() / (n - 1) for i, n in enumerate(dims)], -1)
        rows = values.to(vocab.proj_up.weight.dtype) @ vocab.proj_up.weight.T
        return rows if vocab.level_embed is None else rows + vocab.level_embed[level]
    raise NotImplementedError(f"the reference has no definition of the {name!r} vocabulary; add it here")


def concept_input(model, probs: torch.Tensor, concept_id: int, h_src: torch.Tensor, level: int) -> torch.Tensor:
    """[d] the input of one concept slot: its id's embedding (hard samplers, with the straight-through
    soft part while training with gradients) or the probability-weighted embedding (soft samplers); a
    latent-feedback sampler (``hidden-projection``) then mixes in the emitting token's shallow state, and
    the identity start adds that state to the gated embedding."""
    rows = concept_rows(model, level)
    sampler = model.sampler if model.training else model.eval_sampler
    soft = probs.to(rows.dtype) @ rows
    if getattr(sampler, "hard", True):
        e = rows[concept_id]
        if sampler.straight_through and torch.is_grad_enabled():
            e = e + (soft - soft.detach())
    else:
        e = soft
    if component(model, "sampler") == "hidden-projection":  # latent feedback, in training and at inference
        mix = model.sampler
        a = torch.sigmoid(mix.gate)
        h_hat = F.normalize(h_src.to(mix.proj.weight.dtype) @ mix.proj.weight.T, dim=-1)
        e = (a * e + torch.sqrt(1 - a * a) * (mix.scale * h_hat)).to(e.dtype)
    if model.concept_gate is not None:  # identity start: h_src + gate * e
        if model.concept_gate.relative:  # identity-scaled: e at the norm of h_src (same width: rms ratio = norm ratio)
            e = e * (h_src.double().norm() / e.double().norm()).to(e.dtype)
        e = h_src.to(e.dtype) + model.concept_gate.gate.to(e.dtype) * e
    return e


def fused_tail(model, tail: torch.Tensor, update: torch.Tensor, has: bool) -> torch.Tensor:
    """[n, d] what the deep stack receives for a segment's tail tokens ``tail`` [n, d], from their latest
    concept's middle-stack update ``update`` [d] (``has``: the document has a concept before them):

    ``update``: h + u;  ``bridge``: base(h, u) + W_out act(W_in [h / rms(h) ; u / rms(u)]) (u = 0 when
    there is none; ``base`` h + u or h; no W_in when the bridge is linear)."""
    name = component(model, "tail_fusion")
    u = update.expand_as(tail) if has else torch.zeros_like(tail)
    if name == "update":
        return tail + u
    if name == "bridge":
        fusion = model.tail_fusion

        def unit(x):  # x / rms(x), statistics in float64
            return (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).to(x.dtype)

        x = torch.cat([unit(tail), unit(u) if has else torch.zeros_like(u)], -1).to(fusion.out.weight.dtype)
        if fusion.inp is not None:
            x = F.gelu(F.linear(x, fusion.inp.weight, fusion.inp.bias))
        base = tail + u if fusion.config.base == "update" else tail
        return base + F.linear(x, fusion.out.weight, fusion.out.bias).to(tail.dtype)
    raise NotImplementedError(f"the reference has no definition of the {name!r} tail fusion; add it here")


def _run(model, layers, x, position_ids):
    cos_sin = decoder(model.backbone).rotary_emb(x, position_ids)
    for layer in layers:  # attention_mask=None: transformers' own causal SDPA
        x = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)
    return x


def shallow_states(model, input_ids, valid):
    """h after the shallow stack, from the plain HF forward (hidden_states[Ls])."""
    inner = decoder(model.backbone)
    x = with_type(model, inner.embed_tokens(input_ids), 0)
    pos = text_position(model, (torch.cumsum(valid.long(), 1) - 1).clamp(min=0))
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
            e = torch.stack([concept_input(model, (probs[b, t] if L == 1 else probs[b, t, lv]),
                                           int(token_ids[b, t] if L == 1 else token_ids[b, t, lv]), h[b, t], int(lv))
                             for t, lv in zip(c_times.tolist(), level.tolist())])[None]
            e = with_type(model, e, 1)
            middle_pos = concept_position(model, c_pos[None], c_rank[None], "middle")
            middle_out = _run(model, model.middle, e, middle_pos)[0]
            update = middle_out - e[0]  # what the middle stack added to each concept
        for i, t in enumerate(times.tolist()):
            n_c = M * L * int(kept[: i + 1].sum())  # concepts emitted at positions <= t
            last = int(kept[: i + 1].nonzero().max()) if n_c else -1  # tau(t), as an index into `times`
            tail_idx = times[last + 1: i + 1]
            tail = h[b, tail_idx][None]
            if model.tail_fusion is not None and model.tail_fusion.needs_update:  # the latest concept's update
                tail = fused_tail(model, tail[0], update[n_c - 1] if n_c else tail.new_zeros(tail.shape[-1]), n_c > 0)[None]
            parts = [tail[0]]
            tail_pos = text_position(model, pos[last + 1: i + 1][None])[0]
            part_pos = [tail_pos]
            if n_c:
                parts.insert(0, middle_out[:n_c])
                part_pos.insert(0, concept_position(model, c_pos[None, :n_c], c_rank[None, :n_c], "deep")[0])
            z = torch.cat(parts)[None]
            z_pos = torch.cat(part_pos)[None]
            if deep_positions == "packed-index":
                z_pos = torch.arange(z.shape[1])[None]
            out = _run(model, model.deep, z, z_pos)
            logits[b, t] = model.backbone.lm_head(inner.norm(out[0, -1]))
    return logits, keep


# -- the planner's parallel types: chains joined as the sampling planner did before 2026-11-27 --------------------
def join_types_read(chains, n: int):
    """Rows of ``n`` chains (row ``b * n + i``: type i's steps of row b) joined type by type, as wide as the longest
    joined plan: its width and its steps' places read back (the declared ``plan join`` this replaced), every step
    copied to its place with ``index_put``. The reference of ``concept.planner.model.Plan.join_types``."""
    Bn, _ = chains.classes.shape
    B = Bn // n
    lengths = chains.active.sum(1).view(B, n)
    offset = (lengths.cumsum(1) - lengths).flatten()  # where each chain starts in its row's plan
    with declared("plan join"):
        width = int(lengths.sum(1).max())
        rows, steps = chains.active.nonzero(as_tuple=True)
    target = (rows // n, offset[rows] + steps)
    out = {}
    for f in dataclasses.fields(chains):
        t = getattr(chains, f.name)
        if t is not None:
            out[f.name] = t.new_full((B, width, *t.shape[2:]), after_end(f.name)).index_put(target, t[rows, steps])
    return dataclasses.replace(chains, **out)
