"""Exactness with CUDA's memory made visible on the CPU (tests/cuda_kernel_standin.py).

The GPU lease of 2026-11-27 found cascade's bf16 gradients off by ~1e34 on an H100 (tests/test_cuda.py;
logits right, fp32 right). The cause: its CUDA kernel wrapper handed the merged output to the memory-efficient
backward stored [n, H, M, hd], and that kernel reads the output with a row stride of H x hd (it assumes the
[n, M, H, hd] storage its forward returns): wrong rows, and past the tensor's end (memory nobody wrote) for the
last heads. Only the half-precision kernels read the output (rowsum(dO * O)); in float32 torch computes it.
On the CPU the fused kernel is another one, so nothing showed.

Here, on the CPU: the test_cuda.py comparison (the padded batch, logits and the new modules' gradients
against the naive float32 reference, with the same tolerances) for every attention backend the CPU runs, in
fp32 and under bf16 autocast, with every ``empty`` allocation full of garbage (NaN); cascade also through its
CUDA kernel wrapper with the CUDA operators stood in for under their memory contract (the same tiny backbone
as test_cuda.py: 2 KV heads, which the layout bug needs). Not ``flex``: it has no backward on the CPU, and
its CPU forward is compiled, which a dispatch mode cannot wrap (its bf16 forward: tests/test_bf16.py).
And the training CE, whose input gradient is an empty tensor filled chunk by chunk (concept/losses.py).
Negative controls: the wrapper as it was (the output stored [n, H, M, hd]) fails in bf16 and passes in fp32,
as on the GPU; a merge that leaves rows of an empty allocation unwritten is caught by the garbage.
"""
from __future__ import annotations

import pytest
import torch

import concept
import concept_plugins.attention.cascade as cascade
from concept.losses import next_token_loss
from tests.conftest import randomize_new_modules, tiny_config
from tests.cuda_kernel_standin import GarbageAllocations, standin_cuda_kernel
from tests.test_cuda import (SHARPEN, TOLERANCES, assert_gradients_match, assert_logits_match, new_module_grads,
                             reference)

pytestmark = pytest.mark.usefixtures("one_thread")

# a backend with its CPU configuration (tests/conftest.py); cascade-cuda: cascade's CUDA kernel wrapper over the
# stood-in operators
CASES = ["sdpa", "chunked", "auto", "xformers", "cascade", "cascade-cuda"]


def model_for(case: str, state: dict):
    """The tiny sharpened model of ``state`` with the case's attention backend (CPU, float32, eval)."""
    model = concept.build(tiny_config(attention=case.removesuffix("-cuda")))
    model.load_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module")
def base():
    """The weights (test_cuda.py's tiny model: random new modules, attention sharpened) and the reference:
    the padded batch, its concept ids, logits and gradients by the naive loop (float32)."""
    model = randomize_new_modules(concept.build(tiny_config())).eval()
    with torch.no_grad():
        for n, p in model.backbone.named_parameters():
            if "q_proj" in n or "k_proj" in n:
                p.mul_(SHARPEN)
    return model.state_dict(), reference(model)


def stand_in_the_cuda_kernel(monkeypatch) -> None:
    """Cascade's kernels: its CUDA wrapper over the stood-in operators."""
    monkeypatch.setattr(cascade, "device_kernel", lambda device: standin_cuda_kernel())


def run(case: str, dtype: str, base):
    """Logits and the new modules' gradients of the case, every empty allocation full of garbage."""
    state, (ids, mask, keep, valid, concept_ids, ref, ref_grads) = base
    model = model_for(case, state)
    with GarbageAllocations():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(ids, attention_mask=mask, keep=keep, concept_ids=concept_ids).logits
        grads = new_module_grads(model, logits, ids, valid)
    assert logits.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    return logits, grads


def check(case: str, dtype: str, base) -> None:
    """test_cuda.py's check on the CPU: logits and gradients within the dtype's tolerance of the reference."""
    *_, valid, _, ref, ref_grads = base[1]
    logits, grads = run(case, dtype, base)
    assert_logits_match(f"{case} {dtype}", logits, ref, valid, TOLERANCES[dtype])
    assert_gradients_match(f"{case} {dtype}", grads, ref_grads, TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_every_backend_matches_the_naive_reference_with_garbage_in_empty_memory(base, case, dtype, monkeypatch):
    if case == "cascade-cuda":
        stand_in_the_cuda_kernel(monkeypatch)
    check(case, dtype, base)


def test_garbage_fills_every_kind_of_empty_allocation():
    x = torch.zeros(2, 3)
    with GarbageAllocations() as garbage:
        made = [torch.empty(4), torch.empty_like(x), x.new_empty(5), torch.empty_strided((2, 2), (1, 2)),
                torch.empty(3, dtype=torch.long), torch.empty(2, dtype=torch.bool)]
    assert garbage.filled == len(made)
    assert all(t.isnan().all() for t in made[:4]) and (made[4] > 2 ** 40).all() and made[5].all()


def test_negative_control_the_output_in_the_layout_the_kernel_does_not_read(base, monkeypatch):
    """The wrapper before the fix (the merged output passed stored [n, H, M, hd]): bf16 gradients fail, fp32
    passes (the float32 kernel does not read the output), as on the H100."""
    stand_in_the_cuda_kernel(monkeypatch)
    monkeypatch.setattr(cascade, "_heads_inner", lambda x: x.contiguous())
    check("cascade-cuda", "fp32", base)
    with pytest.raises(AssertionError, match="gradients differ"):
        check("cascade-cuda", "bf16", base)


def test_negative_control_a_row_left_unwritten_in_an_empty_allocation(base, monkeypatch):
    """A merge that writes only the rows with a prefix part into an empty tensor (forgetting the others):
    NaN logits at real tokens under the garbage."""
    real_merge = cascade.merge_parts

    def forgetful_merge(out_a, lse_a, out_b, lse_b):
        out, lse = real_merge(out_a, lse_a, out_b, lse_b)
        kept = out.new_empty(out.shape)
        both = torch.isfinite(lse_b)[..., None].expand_as(out)
        kept[both] = out[both]
        return kept, lse

    monkeypatch.setattr(cascade, "merge_parts", forgetful_merge)
    with pytest.raises(AssertionError, match="non-finite logits"):
        check("cascade", "fp32", base)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_training_loss_and_its_gradients_with_garbage_in_empty_memory(base, dtype, monkeypatch):
    """The training CE (``head_cross_entropy``: its input gradient is an empty tensor filled chunk by chunk, here
    in 6 chunks of 8 rows, the last one short) equals the reference's mean CE, and its gradients the reference's."""
    monkeypatch.setattr("concept.losses.CHUNK_LOGITS", 8 * 97)  # 8 rows of the tiny backbone's 97 logits
    state, (ids, mask, keep, valid, concept_ids, ref, ref_grads) = base
    model = model_for("chunked", state)
    with GarbageAllocations() as garbage:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(ids, attention_mask=mask, keep=keep, concept_ids=concept_ids, labels=ids).loss
        loss.backward()
    assert garbage.filled > 0  # the CE's empty gradient among them
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_loss = float(next_token_loss(ref.detach(), ids, valid))
    assert abs(float(loss.detach()) - ref_loss) <= TOLERANCES[dtype]["logits"] * ref_loss
    assert_gradients_match(f"training loss {dtype}", grads, ref_grads, TOLERANCES[dtype])
