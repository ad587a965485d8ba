"""The training CE through the LM head (``concept.losses.head_cross_entropy``, forward + backward) with each
chunk's arithmetic eager against compiled with the stacks (``concept.compiled.CompiledStacks.loss_terms``),
side by side in one run.

    .venv/bin/python -m pytest benchmarks/test_loss_compiled.py -s
    .venv/bin/python -m pytest benchmarks/test_loss_compiled.py -s --device cuda --dtype bf16   # + the demo recipe's shape

The compiled side uses ``--compile``'s choice, inductor's default mode where that is ``off`` (on a CPU the
generated C++; the loss is never compiled into CUDA graphs). Cases:
- ``cpu``: 1,024 rows, width 256, a 16,384-token vocabulary, chunks of 384 rows (two full chunks and a last one
  of 256: both of the compiled function's shapes), fp32;
- ``demo`` (CUDA only): the demo recipe's step on SmolLM2-135M, 128 x 127 next-token rows, width 576, the
  49,152-token vocabulary, the default chunks (24 of 682 rows), the head stored in the compute dtype (frozen,
  as ``concept.precision`` stores the base) under autocast.
The smoke run (``--benchmark-disable``) runs both sides once on a small shape, compiled by ``aot-eager``.
"""
from __future__ import annotations

import pytest
import torch

from concept.compiled import CompiledStacks
from concept.losses import CHUNK_LOGITS, IGNORE, head_cross_entropy

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
    precision = dtype if device.type == "cuda" else torch.float32
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
    benchmark.pedantic(fns["compiled"], rounds=2, iterations=1)
    record(benchmark, f"loss fwd+bwd {case} N={N} d={d} V={V} chunks of {chunk} eager vs compiled ({choice})",
           timing, None, sides=["eager", "compiled"], rows_per_s=N / timing["concept_s"], N=N, V=V,
           chunk_rows=chunk, chunks=-(-N // chunk), compile=choice, dtype=dtype_name(precision), suite="loss-compiled")
    print(f"\n{case}: eager {timing['dense_s'] * 1e3:.1f} ms, compiled {timing['concept_s'] * 1e3:.1f} ms "
          f"({timing['speedup']:.2f}x), {-(-N // chunk)} chunks of {chunk} rows, {choice}")
