"""A tiny conformance forward per component (``concept plugins list --check``): the component is built with its
default options on a small context and called the way the model calls it, against an obviously correct
reference where its kind has one. A component that imports but breaks its kind's contract at its first call (a
``decide`` with the wrong signature, a step rule that disagrees with the batched decision) is reported here, with
the call that failed, instead of at the first forward of a build.

- length policy: the batched ``decide(h, head_logits, valid, reset)`` equals ``step`` run token by token; a
  ratio-controlled one decides the same given its ``keep_logit`` (the model hands it over) and, with a
  ``boundary_prob``, gives the same probability from it;
- sampler: ``forward(logits)`` gives probabilities (finite, non-negative, summing to 1) of the logits' shape;
- vocabulary: ``logits(h)`` has K (+1 with a NULL class) columns; ``embed_soft`` of a one-hot row is ``embed_hard``;
- position scheme: positions shaped like their input; the type embeddings keep the input's shape;
- attention backend: its plan's output equals dense-mask SDPA over the one-pass rule (``concept.packing.allowed``);
- tail fusion: a per-token function of its inputs (a slice of the input gives the slice of the output);
- backbone and family: the class checks at lookup only (a backbone's default options may name no model).
"""
from __future__ import annotations

import torch

from .attention import AttentionPattern, sdpa
from .components import BuildContext
from .config import NoOptions
from .contracts import DifferentiableBoundary, LengthPolicy, RatioControlled, ReadsPredictor
from .packing import allowed, pack

B, T, D, K, V = 2, 12, 16, 8, 32  # rows, tokens, width, concept ids, token vocabulary


def problem(kind: str, cls: type) -> str | None:
    """What the conformance forward of the component class ``cls`` of ``kind`` found wrong (one line), or None."""
    check = CHECKS.get(kind)
    if check is None or cls.unavailable_reason():
        return None
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            return check(cls)
    except Exception as exc:  # third-party code: any failure is the finding
        return f"{type(exc).__name__}: {exc}"


def _make(cls: type, concept_vocab_size: int = K):
    config = getattr(cls, "Config", NoOptions)()
    ctx = BuildContext(hidden_size=D, vocab_size=V, num_layers=3, split=(1, 1, 1),
                       concept_vocab_size=concept_vocab_size,
                       uses_null_class=not issubclass(cls, LengthPolicy) or cls.uses_null_class)
    return cls(config, ctx)


def length_policy(cls: type) -> str | None:
    policy = _make(cls)
    if isinstance(policy, ReadsPredictor):  # the model binds the backbone's next-token readout
        readout = torch.nn.Linear(D, V)
        policy.predictor = lambda x: readout(x)  # (a function, as the model binds it: not a submodule)
    policy.eval()
    h = torch.randn(B, T, D)
    head_logits = torch.randn(B, T, K + int(cls.uses_null_class)) * 3
    valid = torch.ones(B, T, dtype=torch.bool)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[:, 0] = True
    try:
        keep = policy.decide(h, head_logits, valid, reset)
    except Exception as exc:
        return f"decide(h, head_logits, valid, reset) failed: {type(exc).__name__}: {exc}"
    if not isinstance(keep, torch.Tensor) or keep.shape != (B, T):
        return f"decide(h, head_logits, valid, reset) must return keep [B, T] = {[B, T]}, got {_shape(keep)}"
    given = _given_keep_logit(policy, h, head_logits, valid, reset, keep)
    if given:
        return given
    state, steps = policy.init_state(B, h.device), []
    for t in range(T):
        try:
            keep_t, state = policy.step(h[:, t], head_logits[:, t], state)
        except Exception as exc:
            return f"step(h_t, head_logits_t, state) failed at t={t}: {type(exc).__name__}: {exc}"
        steps.append(torch.as_tensor(keep_t).reshape(B).bool())
    stepped = torch.stack(steps, 1)
    if not torch.equal(stepped, keep.bool()):
        t = int((stepped != keep.bool()).any(0).nonzero()[0])
        return (f"decide() and step() disagree (first at token {t}: decide {keep.bool()[:, t].tolist()}, step "
                f"{stepped[:, t].tolist()}); decoding needs the step rule to equal the batched decision")
    return None


def _given_keep_logit(policy, h, head_logits, valid, reset, keep) -> str | None:
    """A ratio-controlled policy reads the keep score the model computed once per forward (``keep_logit=``):
    the same decision, and the same ``boundary_prob``, as when it computes the score itself."""
    if not isinstance(policy, RatioControlled):
        return None
    score = policy.keep_logit(head_logits, h)
    try:
        given = policy.decide(h, head_logits, valid, reset, keep_logit=score)
    except Exception as exc:
        return f"decide(h, head_logits, valid, reset, keep_logit=...) failed: {type(exc).__name__}: {exc}"
    if not torch.equal(torch.as_tensor(given, device=keep.device).bool(), keep.bool()):
        return "decide(..., keep_logit=keep_logit(head_logits, h)) must equal decide(...) (the same score)"
    if isinstance(policy, DifferentiableBoundary) and not torch.equal(
            policy.boundary_prob(head_logits, h, keep_logit=score), policy.boundary_prob(head_logits, h)):
        return "boundary_prob(..., keep_logit=keep_logit(head_logits, h)) must equal boundary_prob(...)"
    return None


def sampler(cls: type) -> str | None:
    logits = torch.randn(B, T, K) * 2
    probs = _make(cls)(logits)
    if not isinstance(probs, torch.Tensor) or probs.shape != logits.shape:
        return f"forward(logits [B, T, K]) must return probabilities of that shape, got {_shape(probs)}"
    if not (torch.isfinite(probs).all() and (probs >= 0).all() and torch.allclose(probs.sum(-1), torch.ones(B, T),
                                                                                     atol=1e-4)):
        return "forward(logits) must return probabilities: finite, >= 0, summing to 1 over the last dim"
    return None


def vocabulary(cls: type) -> str | None:
    vocab = _make(cls, concept_vocab_size=0)
    vocab.init_from_backbone(torch.randn(V, D))
    h = torch.randn(B, T, D)
    logits = vocab.logits(h)
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != (B, T) or logits.shape[-1] not in (
            vocab.size, vocab.size + 1):
        return f"logits(h [B, T, d]) must be [B, T, K (+1)] with K = size {vocab.size}, got {_shape(logits)}"
    ids = torch.randint(0, vocab.size, (B, T))
    hard = vocab.embed_hard(ids)
    soft = vocab.embed_soft(torch.nn.functional.one_hot(ids, vocab.size).float())
    if hard.shape != (B, T, D) or soft.shape != (B, T, D):
        return f"embed_hard / embed_soft must give [B, T, d] = {[B, T, D]}, got {_shape(hard)} / {_shape(soft)}"
    if not torch.allclose(hard.float(), soft.float(), atol=1e-4, rtol=1e-4):
        return "embed_soft(one_hot(ids)) must equal embed_hard(ids) (a soft mixture of one id is that id)"
    return None


def position_scheme(cls: type) -> str | None:
    scheme = _make(cls)
    pos = torch.arange(T).expand(B, T)
    rank = torch.arange(T).expand(B, T)
    x = torch.randn(B, T, D)
    shapes = {"text_positions(pos)": scheme.text_positions(pos),
              "concept_positions(pos, rank, 'middle')": scheme.concept_positions(pos, rank, "middle"),
              "concept_positions(pos, rank, 'deep')": scheme.concept_positions(pos, rank, "deep")}
    for call, out in shapes.items():
        if not isinstance(out, torch.Tensor) or out.shape != pos.shape:
            return f"{call} must return positions shaped like pos {list(pos.shape)}, got {_shape(out)}"
    for call, out in {"add_text_type(x)": scheme.add_text_type(x), "add_concept_type(x)": scheme.add_concept_type(x)}.items():
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return f"{call} must keep x's shape {list(x.shape)}, got {_shape(out)}"
    return None


def attention(cls: type) -> str | None:
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded row
    keep = torch.rand(B, T) < 0.3
    layout = pack(keep, valid)
    plan = _make(cls).plan(layout)
    if not isinstance(plan, AttentionPattern):
        return f"plan(layout) must return a concept.attention.AttentionPattern, got {type(plan).__name__}"
    heads, kv_heads, hd, L = 4, 2, 8, layout.length
    q, k, v = torch.randn(B, heads, L, hd), torch.randn(B, kv_heads, L, hd), torch.randn(B, kv_heads, L, hd)
    out = plan(q, k, v, hd ** -0.5)
    expected = sdpa(q, k, v, hd ** -0.5, allowed(layout.meta, layout.meta)).transpose(1, 2)
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
        return f"plan(query, key, value, scaling) must return [B, L, H, hd] = {list(expected.shape)}, got {_shape(out)}"
    real = layout.meta.valid
    if not torch.allclose(out[real].float(), expected[real].float(), atol=1e-4, rtol=1e-3):
        return "its plan's output differs from dense-mask SDPA over the one-pass rule (concept.packing.allowed)"
    return None


def tail_fusion(cls: type) -> str | None:
    fusion = _make(cls)
    tail, update = torch.randn(B, T, D), torch.randn(B, T, D)
    has = torch.rand(B, T) < 0.5
    out = fusion(tail, update, has)
    if not isinstance(out, torch.Tensor) or out.shape != tail.shape:
        return f"forward(tail, update, has) must return [B, L, d] = {list(tail.shape)}, got {_shape(out)}"
    part = fusion(tail[:, 3:7], update[:, 3:7], has[:, 3:7])
    if not torch.allclose(part, out[:, 3:7], atol=1e-5):
        return "forward(tail, update, has) must be a per-token function of its inputs (a slice in, the slice out)"
    return None


def _shape(x) -> str:
    shape = getattr(x, "shape", None)
    return str(list(shape)) if shape is not None else type(x).__name__


CHECKS = {"length_policy": length_policy, "sampler": sampler, "vocabulary": vocabulary,
          "position_scheme": position_scheme, "attention": attention, "tail_fusion": tail_fusion}
