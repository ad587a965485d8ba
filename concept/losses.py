"""The language-modelling loss every model of the library is trained and evaluated with.

``next_token_loss`` reads logits (evaluation, diagnostics). A model's forward computes its training CE
with ``head_cross_entropy`` from the states that enter the LM head instead: the head runs on chunks of
rows, each chunk's CE is summed and its logits dropped, so a step never holds [B, T, V] logits (at
T=4096 and SmolLM2's 49,152-token vocabulary they are 805 MB in fp32, and the CE's backward kept
three such tensors). The gradient of each chunk is taken in the same pass (softmax - one-hot), so no
logits are recomputed in backward: the head costs the three matmuls of a plain linear layer.
The logits themselves stay available to whoever reads them (``concept.lazy``).

Each chunk's arithmetic between its logits matmul and its gradient matmuls (upcast, logsumexp, the target's
logit, the masked sum, softmax - one-hot scaled by valid / count, the cast back) is :func:`chunk_terms`: run
eagerly, in place (a dozen kernels a chunk, each a pass over [rows, V] in fp32), unless the model runs
compiled (``--compile``): its compiled stacks then pass ``head_next_token_loss`` a compiled copy
(``concept.compiled.CompiledStacks.loss_terms``: fullgraph, static shapes, inductor's default mode, never CUDA
graphs), which inductor fuses into a couple of kernels. The matmuls and the chunk loop stay eager either way.

Why not a library: Liger-Kernel's fused linear cross-entropy and Apple's cut-cross-entropy are Triton
kernels (CUDA only; cut-cross-entropy's non-Triton path compiles the plain loss, logits included),
and this must run and be tested on CPU too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .components import upcast

IGNORE = -100  # a target the CE skips (F.cross_entropy's ignore_index)
CHUNK_LOGITS = 2 ** 25  # logits alive at once in ``head_cross_entropy``: chunks of CHUNK_LOGITS // V rows


def next_token_targets(labels, valid, document_ids=None):
    """[B, T-1] the token each position t predicts (labels[t+1]), ``IGNORE`` where t and t+1 are not two
    real tokens of the same document."""
    pair = valid[:, 1:] & valid[:, :-1]
    if document_ids is not None:
        pair = pair & (document_ids[:, 1:] == document_ids[:, :-1])
    return labels[:, 1:].masked_fill(~pair, IGNORE)


def next_token_loss(logits, labels, valid, document_ids=None, reduction="mean"):
    """CE of predicting labels[t+1] from position t, over pairs of real tokens of the same
    document (labels equal to -100 are ignored)."""
    target = next_token_targets(labels, valid, document_ids)
    loss = F.cross_entropy(upcast(logits[:, :-1].flatten(0, 1)), target.flatten(), ignore_index=IGNORE,
                           reduction=reduction)
    return loss if reduction == "mean" else loss.view(target.shape)


def head_next_token_loss(states, head, labels, valid, document_ids=None, compiled=None):
    """``next_token_loss(head(states), ...)`` (mean) from the states [B, T, d] that enter the LM head, without
    the [B, T, V] logits. ``compiled``: the model's compiled stacks (``concept.compiled.CompiledStacks``, None
    when it runs eagerly): each chunk's arithmetic then runs as their compiled ``loss_terms``."""
    terms = None if compiled is None else compiled.loss_terms(states.device.type)
    return head_cross_entropy(states[:, :-1], head, next_token_targets(labels, valid, document_ids), terms=terms)


def head_cross_entropy(states, head, target, chunk_logits: int | None = None, terms=None):
    """``F.cross_entropy(upcast(head(states)), target, ignore_index=IGNORE)`` (the mean over the targets that
    are not ``IGNORE``; NaN when there is none, as F.cross_entropy) for ``states`` [..., d] and ``target``
    [...]. A plain ``nn.Linear`` head runs in chunks of rows (:class:`LinearCrossEntropy`); any other head
    (e.g. one carrying a LoRA adapter) is called whole. ``chunk_logits``: default ``CHUNK_LOGITS``; ``terms``:
    each chunk's arithmetic (default :func:`chunk_terms`, eager; or a compiled copy of it)."""
    x, t = states.reshape(-1, states.shape[-1]), target.reshape(-1)
    if type(head) is not nn.Linear:
        return F.cross_entropy(upcast(head(x)), t, ignore_index=IGNORE)
    rows, terms = max(1, (chunk_logits or CHUNK_LOGITS) // head.out_features), terms or chunk_terms
    if torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in (x, head.weight, head.bias)):
        return LinearCrossEntropy.apply(x, head.weight, head.bias, t, rows, terms)
    return chunked_loss(x, head.weight, head.bias, t, rows, terms=terms)[0]


def chunk_terms(logits, target, valid, count, grad: bool):
    """One chunk's arithmetic between its logits matmul and its gradient matmuls: (the CE summed over its
    counted rows, fp32; with ``grad``, d(mean CE)/d logits = (softmax - one-hot) * valid / ``count`` in the
    logits' dtype, else None). ``logits`` [rows, V] (upcast here; an fp32 chunk is overwritten), ``target``
    [rows] (``IGNORE`` allowed), ``valid`` = target != IGNORE, ``count`` its sum over the whole batch.

    Eagerly the gradient is made in place in the upcast logits (no second [rows, V] tensor); traced by
    ``torch.compile`` (:class:`concept.compiled.CompiledStacks`'s ``loss_terms``) the same values are one
    pointwise expression (the one-hot a comparison, not a scatter; ``x - 0`` is ``x`` and ``x - 1`` is the
    scatter's ``x + -1``), which inductor fuses with the scale and the cast, the input left unwritten."""
    compute = logits.dtype  # the head's dtype (bf16 under autocast): its backward matmuls run in it too
    logits = upcast(logits)
    lse = logits.logsumexp(-1)
    index = target.clamp(min=0)[:, None]
    part = torch.where(valid, lse - logits.gather(1, index)[:, 0], 0.0).sum()
    if not grad:
        return part, None
    scale = (valid / count)[:, None].to(logits.dtype)
    if torch.compiler.is_compiling():
        one_hot = index == torch.arange(logits.shape[-1], device=logits.device)
        return part, (((logits - lse[:, None]).exp() - one_hot.to(logits.dtype)) * scale).to(compute)
    g = logits.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, index, torch.full_like(index, -1, dtype=g.dtype))
    return part, g.mul_(scale).to(compute)


def chunked_loss(x, weight, bias, target, rows: int, grads: tuple[bool, bool, bool] = (False, False, False),
                 terms=chunk_terms):
    """The mean CE of ``F.linear(x, weight, bias)`` against ``target``, ``rows`` rows at a time; with
    ``grads`` (for x, weight, bias), also the gradients of that mean, taken chunk by chunk in the same pass.
    ``terms``: each chunk's arithmetic, :func:`chunk_terms` or a compiled copy of it.
    Returns (loss, grad_x, grad_weight, grad_bias), the gradients None where not asked for."""
    valid = target != IGNORE
    count = valid.sum()
    total = grad_w = grad_b = None  # (the first chunk's terms start the sums: no zeros to add them to)
    grad_x = []  # (each chunk's rows, concatenated once at the end: a single chunk is the gradient itself)
    for start in range(0, x.shape[0], rows):
        xc, tc, vc = x[start:start + rows], target[start:start + rows], valid[start:start + rows]
        part, g = terms(F.linear(xc, weight, bias), tc, vc, count, any(grads))
        total = part if total is None else total + part
        if g is None:
            continue
        compute = g.dtype
        if grads[0]:
            grad_x.append((g @ weight.to(compute)).to(x.dtype))
        if grads[1]:
            part_w = (g.t() @ xc.to(compute)).float()
            grad_w = part_w if grad_w is None else grad_w.add_(part_w)
        if grads[2]:
            part_b = g.sum(0).float()
            grad_b = part_b if grad_b is None else grad_b.add_(part_b)
    if total is None:  # (no rows)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if grads[1] else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) if grads[2] else None
    grad_x = None if not grads[0] else (grad_x[0] if len(grad_x) == 1 else torch.cat(grad_x) if grad_x
                                        else torch.empty_like(x))
    return total / count, grad_x, grad_w, grad_b


class LinearCrossEntropy(torch.autograd.Function):
    """The mean CE of a linear head (:func:`chunked_loss`), its gradients computed in the forward chunk by
    chunk and scaled by the incoming gradient in backward: no [N, V] tensor outlives its chunk."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, rows, terms=chunk_terms):
        grads = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, grad_x, grad_w, grad_b = chunked_loss(x, weight, bias, target, rows, grads, terms)
        ctx.save_for_backward(*(g if g is not None else x.new_empty(0) for g in (grad_x, grad_w, grad_b)))
        ctx.asked = grads
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, grad_b = ctx.saved_tensors
        asked = ctx.asked
        return (grad_x * grad_loss.to(grad_x.dtype) if asked[0] else None,
                (grad_w * grad_loss).to(ctx.dtypes[0]) if asked[1] else None,
                (grad_b * grad_loss).to(ctx.dtypes[1]) if asked[2] else None,
                None, None, None)
