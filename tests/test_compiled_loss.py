"""The training CE's per-chunk arithmetic compiled with the stacks (``concept.compiled.CompiledStacks.loss_terms``
over ``concept.losses.chunk_terms``): the chunked CE with it equals the eager chunked CE in fp32 (<= 1e-6
relative), loss and the x / weight / bias gradients, with ``IGNORE`` targets, several chunks and a last partial
one; two graphs (a full chunk, the last) without a graph break serve every later call (a recompile raises).
Real inductor on a tiny chunk: the eager arithmetic's ops (a ``TorchDispatchMode`` counts them) become one
generated kernel on a CPU (a couple on CUDA). Negative controls: a compiled chunk run with a mutated gradient
scale or with its mask dropped fails the same comparison.

On CUDA (``cuda``-marked: the GPU kit's ``exact`` stage): ``on``'s loss in inductor's default mode equals eager
in fp32, a bf16 chunk of the demo's shape is at most 3 Triton kernels, and its outputs are not in CUDA graphs'
memory. The models' training steps with the loss compiled (no recompile over 20 steps, equal to eager) are
``tests/test_compile.py``'s.
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from concept.compiled import CompiledStacks
from concept.losses import IGNORE, chunk_terms, head_cross_entropy
from tests.test_head_loss import RTOL, assert_same, case, loss_and_grads, relative

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = 7  # case()'s 50 rows: 7 chunks of 7 and a last one of 1
VOCAB = 37  # case()'s


def ce(x, head, target, terms=None):
    return head_cross_entropy(x, head, target, chunk_logits=ROWS * VOCAB, terms=terms)


def test_compiled_chunks_equal_the_eager_chunked_ce(fresh_dynamo):
    x, head, target = case()
    terms = CompiledStacks("aot-eager").loss_terms("cpu")
    ref = loss_and_grads(lambda: ce(x, head, target), x, head)
    assert_same(loss_and_grads(lambda: ce(x, head, target, terms), x, head), ref)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # a full chunk, the last
    with torch.no_grad():  # evaluation: the loss alone, two graphs of its own (another code object)
        assert relative(ce(x, head, target, terms), ref[0]) <= RTOL
    assert counters["stats"]["unique_graphs"] == 4 and not counters["graph_break"]
    torch._dynamo.config.error_on_recompile = True  # from now on a recompile raises
    assert_same(loss_and_grads(lambda: ce(x, head, target, terms), x, head), ref)
    with torch.no_grad():
        assert relative(ce(x, head, target, terms), ref[0]) <= RTOL
    # bf16 (autocast's head; new graphs: another dtype): the compiled chunks' gradients equal eager's to bf16 rounding
    torch._dynamo.config.error_on_recompile = False
    xb, hb = x.detach().bfloat16().requires_grad_(), head.to(torch.bfloat16)
    inputs = (xb, hb.weight, hb.bias)
    got, want = (torch.autograd.grad(ce(xb, hb, target, run), inputs) for run in (terms, None))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("broken", ["scale mutated", "mask dropped"])
def test_negative_control_a_broken_compiled_chunk_fails_the_comparison(fresh_dynamo, broken):
    x, head, target = case()
    compiled = CompiledStacks("aot-eager").loss_terms("cpu")
    if broken == "scale mutated":  # the gradient scaled by 1 / (count + 1)
        terms = lambda logits, t, valid, count, grad: compiled(logits, t, valid, count + 1, grad)  # noqa: E731
    else:  # the ignored rows counted (as targets of class 0)
        terms = lambda logits, t, valid, count, grad: compiled(logits, t, torch.ones_like(valid), count, grad)  # noqa: E731
    ref = loss_and_grads(lambda: ce(x, head, target), x, head)
    with pytest.raises(AssertionError):
        assert_same(loss_and_grads(lambda: ce(x, head, target, terms), x, head), ref)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_inductor_fuses_a_chunk_into_one_kernel(fresh_dynamo):
    """torch's default mode (inductor's C++ on a CPU; ~10 s to compile this tiny chunk): the chunk's ops, each a
    pass over [rows, V] eagerly, are one generated kernel, its loss and gradient equal to eager's."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(12, VOCAB, generator=g), torch.randint(0, VOCAB, (12,), generator=g)
    target[::5] = IGNORE
    valid = target != IGNORE
    original, eager_logits = logits.clone(), logits.clone()  # (the eager arithmetic overwrites an fp32 chunk)
    with OpCounter() as counter:
        want = chunk_terms(eager_logits, target, valid, valid.sum(), True)
    assert len(counter.ops) >= 15 and {"aten.scatter_add_.default", "aten.exp_.default"} <= set(counter.ops)
    terms = CompiledStacks("default").loss_terms("cpu")
    got, codes = run_and_get_code(terms, logits, target, valid, valid.sum(), True)
    kernels = sum(code.count("async_compile.cpp_pybinding(") + code.count("async_compile.triton(") for code in codes)
    assert kernels == 1 and not counters["graph_break"], codes
    assert relative(got[0], want[0]) <= RTOL and relative(got[1], want[1]) <= RTOL
    assert torch.equal(logits, original) and not torch.equal(eager_logits, original)  # compiled: its input unwritten


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_chunks_equal_eager_in_a_few_triton_kernels(fresh_dynamo):
    """``on`` (CUDA graphs for the stacks) compiles the loss in inductor's default mode: fp32 equal to the eager
    chunked CE within 1e-6 relative (loss, x / weight / bias gradients); a bf16 chunk of the demo recipe's shape
    (682 x 49,152) in at most 3 Triton kernels, within bf16 rounding of eager, and its outputs are its own (no
    CUDA graph's memory: the next call leaves them as they were)."""
    from torch._inductor.utils import run_and_get_code

    x, head, target = case()
    x, head, target = x.detach().cuda().requires_grad_(), head.cuda(), target.cuda()
    ref = loss_and_grads(lambda: ce(x, head, target), x, head)
    assert_same(loss_and_grads(lambda: ce(x, head, target, CompiledStacks("on").loss_terms("cuda")), x, head), ref)

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = [torch.randn(682, 49152, device="cuda", generator=g).bfloat16() for _ in range(2)]
    t = torch.randint(0, 49152, (682,), device="cuda", generator=g)
    t[::17] = IGNORE
    valid = t != IGNORE
    terms = CompiledStacks("on").loss_terms("cuda")
    (part, grad), codes = run_and_get_code(terms, logits[0], t, valid, valid.sum(), True)
    kernels = sum(code.count("async_compile.triton(") for code in codes)
    assert 1 <= kernels <= 3 and not counters["graph_break"], codes
    kept = part.clone(), grad.clone()
    terms(logits[1], t, valid, valid.sum(), True)
    assert torch.equal(part, kept[0]) and torch.equal(grad, kept[1])
    want = chunk_terms(logits[0].clone(), t, valid, valid.sum(), True)
    assert relative(part, want[0]) <= 1e-5
    assert ((grad.float() - want[1].float()).abs() <= 2 ** -8 * want[1].float().abs() + 1e-7).all()
