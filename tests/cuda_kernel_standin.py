"""CUDA's memory made visible on the CPU, for tests that must catch what only a GPU would show.

* :class:`GarbageAllocations`: every ``empty`` allocation (``torch.empty``, ``empty_like``, ``new_empty``,
  ``empty_strided``, ...) that reaches the dispatcher (Python code's and composite operators', not those a
  kernel makes inside itself) comes back filled with garbage: NaN for floats, a huge number for integers,
  True for booleans. On CUDA such memory holds whatever the caching allocator last kept
  there (any bit pattern: NaN, 1e34, ...); on the CPU it is often zeros, which hides a read of memory nobody
  wrote. NaN is the strictest garbage: it survives a multiplication by 0 and a masked sum.
* :class:`EfficientAttentionStandIn`: torch's CUDA memory-efficient attention operators
  (``aten::_scaled_dot_product_efficient_attention`` and its backward), as ``CUDAEfficientKernel`` calls
  them, computed by the CPU flash kernel under the CUDA kernels' memory contract: the log-sum-exp's rows
  padded to a multiple of 32 with garbage; a philox seed and offset; and the backward reading the forward's
  output the way cutlass does (``kernel_backward.h``): its batch and head strides as given, its row stride
  assumed to be H x hd (``o_strideM``), i.e. the output stored [B, M, H, hd] as the forward returns it. Only the
  half-precision kernels read the output (they compute rowsum(dO * O) themselves, ``kKernelComputesDelta``);
  for float32 torch computes that sum with the true strides. A read past the output's storage gets garbage.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HALF = (torch.bfloat16, torch.float16)
ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty,
               torch.ops.aten.empty_strided, torch.ops.aten.new_empty_strided, torch.ops.aten.empty_permuted}


def fill_garbage(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    if not t.is_complex():
        return t.fill_(torch.iinfo(t.dtype).max // 2)
    return t


class GarbageAllocations(TorchDispatchMode):
    """``with GarbageAllocations():`` every empty allocation comes back full of garbage (module docstring)."""

    def __init__(self):
        super().__init__()
        self.filled = 0  # how many allocations it filled

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in ALLOCATIONS and isinstance(out, torch.Tensor):
            fill_garbage(out)
            self.filled += 1
        return out


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """The forward's log-sum-exp [B, H, M] in the kernel's [B, H, ceil(M / 32) * 32], garbage in the padding."""
    padded = fill_garbage(lse.new_empty(*lse.shape[:2], -(-lse.shape[2] // 32) * 32))
    padded[..., : lse.shape[2]] = lse
    return padded


def output_as_the_kernel_reads_it(out: torch.Tensor) -> torch.Tensor:
    """``out`` [B, H, M, hd] read as cutlass's backward reads it: element (b, h, m) at ``b * stride(0) +
    h * stride(1) + m * H * hd`` of its storage, garbage past the storage's end."""
    B, H, M, hd = out.shape
    start, (stride_b, stride_h) = out.storage_offset(), out.stride()[:2]
    storage = torch.as_strided(out, (out.untyped_storage().nbytes() // out.element_size(),), (1,), 0)
    end = start + (B - 1) * stride_b + (H - 1) * stride_h + (M - 1) * H * hd + hd
    memory = fill_garbage(out.new_empty(max(end, storage.numel())))
    memory[: storage.numel()] = storage
    return torch.as_strided(memory, (B, H, M, hd), (stride_b, stride_h, H * hd, 1), start)


class EfficientAttentionStandIn:
    """The two operators ``CUDAEfficientKernel`` calls, stood in for on the CPU (module docstring); it also
    checks the arguments the real operators require."""

    @staticmethod
    def forward_op(q, k, v, bias, compute_lse, dropout, causal, scale):
        assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2]) and compute_lse and not causal
        assert bias.dtype == q.dtype, "the CUDA kernel takes a bias in the query's dtype"
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                             attn_mask=bias[:, :1], scale=scale)
        return out, _padded_lse(lse), torch.tensor(1), torch.tensor(2)

    @staticmethod
    def backward_op(d_out, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, scale):
        assert lse.shape[-1] % 32 == 0 and int(seed) == 1 and int(offset) == 2 and grad_mask == [True, True, True, False]
        read = output_as_the_kernel_reads_it(out) if q.dtype in HALF else out  # the CPU kernel reads it for rowsum(dO * O) only
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out.contiguous(), q, k, v, read.contiguous(), lse[..., : q.shape[2]].contiguous(), 0.0, False,
            attn_mask=bias[:, :1], scale=scale)
        return (*grads, None)


def standin_cuda_kernel():
    """A ``CUDAEfficientKernel`` whose operators are :class:`EfficientAttentionStandIn`'s."""
    from concept_plugins.attention.cascade import CUDAEfficientKernel

    kernel = CUDAEfficientKernel()
    kernel.forward_op, kernel.backward_op = EfficientAttentionStandIn.forward_op, EfficientAttentionStandIn.backward_op
    return kernel
