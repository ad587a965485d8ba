"""The interfaces the model orchestration calls, summarised; their base classes (each kind's contract, with a
mixin per optional capability, checked at lookup) are in ``concept.contracts``.

Every component class has a ``Config`` dataclass (see ``concept.config``) and is built by
``concept.builder`` as ``cls(config, ctx)`` where ``ctx`` is a :class:`BuildContext`.

Length policy (``nn.Module``)
    ``uses_null_class: bool`` — the concept head has K+1 classes (NULL last).
    ``decide(h, head_logits, valid, reset=None) -> keep``: batched decision for whole sequences [B, T].
    ``init_state(batch_size, device)`` / ``step(h_t, head_logits_t, state) -> (keep_t, state)``:
    the step-wise decision used in decoding; must agree exactly with ``decide``.
    Optional: ``decide_with_state`` (batched decision + final state, used after a prefill),
    ``keep_logit`` / ``boundary_prob`` / ``null_bias`` (ratio control), ``gate`` (a soft
    boundary for a straight-through path), ``needs_predictor`` (bind the backbone's LM head).

Sampler (``nn.Module``)
    ``forward(logits) -> probs``: soft (possibly perturbed) class probabilities; the hard
    decision is ``probs.argmax(-1)``. ``straight_through: bool`` selects
    ``e = e_hard + (e_soft - stopgrad(e_soft))`` (True) or hard only without gradient (False).
    Optional: ``hard = False`` (the input is the soft mixture), ``mix(e, h)`` (latent feedback),
    ``learning_rate`` (its own learning rate).

Vocabulary (``nn.Module``)
    ``size`` (K), ``logits(h) -> [.., K (+1)]``, ``embed_hard(ids)``, ``embed_soft(probs_k)``.

Position scheme (``nn.Module``)
    ``text_positions(pos)``, ``concept_positions(pos, rank, stack)`` with stack in
    {"middle", "deep"}, ``add_text_type(x)``, ``add_concept_type(x)``.

Attention backend (plain object)
    ``plan(layout) -> callable(query, key, value, scaling) -> out [B, L, H, hd]`` for the
    deep stack's packed layout (see ``concept.packing``). ``supports_backward: bool``.

Model family (``concept.contracts.Family``, a plain object; ``concept.families``)
    How a build config becomes a model and what training, evaluation, decoding and inspection
    do with it; the core asks the family and never names one.
"""
from __future__ import annotations

from dataclasses import dataclass


def accumulation_dtype(dtype):
    """The dtype to compute softmaxes, norms and losses in: float32 for half precision (bf16 / fp16), the
    input's own for float32 and float64 (an fp64 model stays exact to ~1e-16, as its tests check)."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def upcast(x):
    """``x`` in :func:`accumulation_dtype` (a no-op for float32 and float64)."""
    return x.to(accumulation_dtype(x.dtype))


def rms_normalize(h):
    """``h / rms(h)`` over the last dim (statistics in at least float32, result in h's dtype): what heads
    that should depend on a state's direction, not its norm, read (ConceptHead, codebook, threshold score)."""
    import torch

    return h * torch.rsqrt(upcast(h).pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)


@dataclass
class BuildContext:
    hidden_size: int
    vocab_size: int
    num_layers: int
    split: tuple[int, int, int]
    concept_vocab_size: int = 0  # K, filled once the vocabulary is built
    uses_null_class: bool = True
    num_types: int = 1  # concept types (the planner-executor family has one per plan type)


@dataclass
class InspectRequest:
    """What ``concept inspect`` asks a family about a loaded run: the run's records and the operating point of
    its ideal-FLOPs estimate."""

    record: dict  # concept.json
    train: dict | None  # train.json (None: not trained)
    ratio: float  # concepts per token
    seq_len: int  # tokens
