"""The training CE through the LM head (``concept.losses.head_cross_entropy``, forward + backward) with each
chunk's arithmetic eager against compiled with the stacks (``concept.compiled.CompiledStacks.loss_terms``),
side by side in one run.

    .venv/bin/python -m pytest benchmarks/test_loss_compiled.py -s
    .venv/bin/python -m pytest benchmarks/test_loss_compiled.py -s --device cuda --dtype bf16   # + the demo recipe's shape

The compiled side uses ``--compile``'s choice, inductor's default mode where that is ``off`` (on a CPU the
generated C++; the loss is never compiled into CUDA graphs). Cases:
- ``cpu`` (any device): 1,024 rows, width 256, a 16,384-token vocabulary, chunks of 384 rows (two full chunks and
  a last one of 256: both of the compiled function's shapes), in ``--dtype`` (bf16: under autocast);
- ``demo`` (CUDA only): the demo recipe's step on SmolLM2-135M, 128 x 127 next-token rows, width 576, the
  49,152-token vocabulary, the default chunks (24 of 682 rows), the head stored in the compute dtype (frozen,
  as ``concept.precision`` stores the base) under autocast.
Each row also times one full chunk's arithmetic alone (``terms_eager_s``, ``terms_compiled_s``) and counts each
side's aten ops (``dense_`` = eager, ``concept_`` = compiled: the rows' convention; on CUDA with kernel launches
and device time). The smoke run (``--benchmark-disable``) runs both sides once on a small shape, compiled by ``aot-eager``.
"""
from __future__ import annotations

import pytest
import torch

from concept.compiled import CompiledStacks
from concept.losses import CHUNK_LOGITS, IGNORE, chunk_terms, head_cross_entropy
from concept.profiling import profile_call

from .conftest import autocast, dtype_name, side_by_side

CASES = [("cpu", 1024, 256, 16384, 384), ("demo", 128 * 127, 576, 49152, None)]


def loss_step(x, head, target, precision, device, terms=None, rows=None):
    """One forward + backward of the chunked CE (``rows``: rows per chunk, None: the default)."""
    def step():
        x.grad = None
        with autocast(device, precision):
            loss = head_cross_entropy(x, head, target, chunk_logits=rows and rows * head.out_features, terms=terms)
        loss.backward()
    return step


@pytest.mark.parametrize("case,N,d,V,rows", CASES, ids=[c[0] for c in CASES])
def test_loss_eager_vs_compiled(benchmark, record, device, dtype, compile_choice, case, N, d, V, rows):
    if case == "demo" and device.type != "cuda":
        pytest.skip("the demo recipe's shape runs on CUDA (--device cuda)")
    if benchmark.disabled:  # the smoke run: the same code, small
        N, d, V, rows = 50, 16, 37, 7
    precision = dtype
    choice = "aot-eager" if benchmark.disabled else compile_choice if compile_choice != "off" else "default"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, d, generator=g).to(device).requires_grad_()
    head = torch.nn.Linear(d, V, bias=False).to(device, precision).requires_grad_(False)  # the frozen LM head
    target = torch.randint(0, V, (N,), generator=g)
    target[::17] = IGNORE
    target = target.to(device)
    terms = CompiledStacks(choice).loss_terms(device.type)
    fns = {"eager": loss_step(x, head, target, precision, device, rows=rows),
           "compiled": loss_step(x, head, target, precision, device, terms, rows)}
    if benchmark.disabled:
        for fn in fns.values():
            fn()
        return
    # (the rows' convention: the first side in the ``dense`` fields, the second in the ``concept`` ones; ``sides``)
    timing = side_by_side(fns["eager"], fns["compiled"], rounds=5, device=device)
    chunk = rows or max(1, CHUNK_LOGITS // V)
    timing.update(arithmetic_alone(x, head, target, chunk, terms, precision, device))
    if device.type == "cpu":  # (on CUDA the side-by-side profiles each side: launches, aten ops, device time)
        timing.update({f"{side}_aten_ops": profile_call(fns[name])["aten_ops"]
                       for side, name in (("dense", "eager"), ("concept", "compiled"))})
    benchmark.pedantic(fns["compiled"], rounds=2, iterations=1)
    record(benchmark, f"loss fwd+bwd {case} N={N} d={d} V={V} chunks of {chunk} eager vs compiled ({choice})",
           timing, None, sides=["eager", "compiled"], rows_per_s=N / timing["concept_s"], N=N, V=V,
           chunk_rows=chunk, chunks=-(-N // chunk), compile=choice, dtype=dtype_name(precision), suite="loss-compiled")
    ops = f"; aten ops {timing['dense_aten_ops']:,} / {timing['concept_aten_ops']:,}" if "dense_aten_ops" in timing else ""
    print(f"\n{case} ({dtype_name(precision)}): eager {timing['dense_s'] * 1e3:.1f} ms, compiled {timing['concept_s'] * 1e3:.1f} ms "
          f"({timing['speedup']:.2f}x), {-(-N // chunk)} chunks of {chunk} rows, {choice}; one chunk's arithmetic "
          f"alone: eager {timing['terms_eager_s'] * 1e3:.2f} ms, compiled {timing['terms_compiled_s'] * 1e3:.2f} ms{ops}")


def arithmetic_alone(x, head, target, chunk, terms, precision, device) -> dict:
    """One full chunk's arithmetic (``chunk_terms``, with its gradient) eager and compiled, without the matmuls:
    ``terms_eager_s``, ``terms_compiled_s`` (each call on a fresh copy of the chunk's logits: the eager arithmetic
    overwrites an fp32 chunk; the copy is timed on both sides)."""
    with torch.no_grad(), autocast(device, precision):
        logits = torch.nn.functional.linear(x[:chunk], head.weight)
    t, valid = target[:chunk], target[:chunk] != IGNORE
    count = valid.sum()
    timing = side_by_side(lambda: chunk_terms(logits.clone(), t, valid, count, True),
                          lambda: terms(logits.clone(), t, valid, count, True), rounds=9, device=device)
    return {"terms_eager_s": timing["dense_s"], "terms_compiled_s": timing["concept_s"]}
