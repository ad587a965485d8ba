"""The Triton kernels of ``concept.lora_triton`` and their ops (``concept::lora_forward``,
``concept::lora_backward``) with their autograd.

Imported on first use only (``lora_triton.lora_linear``): Triton and torch's Triton support take seconds to
import, which the matmuls never need.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# tiles: 128 x 128 outputs a program, 64 of the reduction a step (bf16 on Hopper: 8 warps, 3 stages)
BLOCK_ROWS, BLOCK_OUT, BLOCK_REDUCE, WARPS, STAGES = 128, 128, 64, 8, 3
SUM_BLOCK = 1024  # elements of the adapters' gradients a program of the final sum adds up
# the backward's columns of dx a program: 128 on Hopper; 64 before it (on the A100, sm_80, 128 spills registers)
BACKWARD_COLUMNS = {9: 128, 8: 64}


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability; Hopper's elsewhere (the interpreter, a build ahead of time)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def backward_columns(device: torch.device) -> int:
    return BACKWARD_COLUMNS[min(max(capability(device)[0], 8), 9)]


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a b`` in fp32. ``UPCAST`` (Triton's interpreter only, whose ``tl.dot`` of bf16 tiles is wrong in
    Triton 3.9): the tiles in fp32 first, the same sums (a product of two bf16 or fp16 values is exact in fp32)."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _rounded(v, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``v`` in ``dtype``, rounded to nearest even. ``UPCAST`` (the interpreter, bf16 only): rounded by its
    bits first, since the interpreter's conversion truncates where a GPU's rounds."""
    if UPCAST:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, a_ptr, b_ptr, y_ptr, hs_ptr, M, N, K, R, scaling,
                    sxm, sxk, swn, swk, sar, sak, sbn, sbr, sym, syn, shm, shr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RANK: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y [M, N] = x W^T + s (x A^T) B^T; hs [M, R] = s (x A^T), written by the first column of programs."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, RANK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w_t = tl.load(w_ptr + cols[None, :] * swn + ks[:, None] * swk, mask=(cols[None, :] < N) & (ks[:, None] < K),
                      other=0.0)  # [BLOCK_K, BLOCK_N]: W^T's tile
        a_t = tl.load(a_ptr + ranks[None, :] * sar + ks[:, None] * sak, mask=(ranks[None, :] < R) & (ks[:, None] < K),
                      other=0.0)  # [BLOCK_K, RANK]: A^T's tile (its padding ranks 0)
        acc = _dot(x, w_t, acc, PRECISION, UPCAST)
        h = _dot(x, a_t, h, PRECISION, UPCAST)
    h_rounded = _rounded(h, y_ptr.dtype.element_ty, UPCAST)  # x A^T in the compute dtype, as its matmul rounds it
    b_t = tl.load(b_ptr + cols[None, :] * sbn + ranks[:, None] * sbr, mask=(cols[None, :] < N) & (ranks[:, None] < R),
                  other=0.0)  # [RANK, BLOCK_N]: B^T's tile
    acc += scaling * _dot(h_rounded, b_t, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION, UPCAST)
    tl.store(y_ptr + rows[:, None] * sym + cols[None, :] * syn, _rounded(acc, y_ptr.dtype.element_ty, UPCAST),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    if pid_n == 0:
        tl.store(hs_ptr + rows[:, None] * shm + ranks[None, :] * shr,
                 _rounded(h_rounded.to(tl.float32) * scaling, hs_ptr.dtype.element_ty, UPCAST),
                 mask=(rows[:, None] < M) & (ranks[None, :] < R))


@triton.jit
def _backward_kernel(g_ptr, x_ptr, w_ptr, a_ptr, b_ptr, hs_ptr, dx_ptr, partial_ptr, M, N, K, R, scaling,
                     sgm, sgn, sxm, sxk, swn, swk, sar, sak, sbn, sbr, shm, shr, sdm, sdk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RANK: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dx [M, K] = g W + (s g B) A, and this row tile's shares of the adapters' gradients, in fp32, in its row of
    ``partial`` [tiles, R K + N R]: ``(s g B)^T x`` over its columns of x (every program), ``g^T (s h)`` (the first
    column of programs). :func:`_sum_kernel` adds the tiles' shares in order."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, RANK)
    share = partial_ptr + pid_m * (R * K + N * R)
    hs = tl.load(hs_ptr + rows[:, None] * shm + ranks[None, :] * shr, mask=(rows[:, None] < M) & (ranks[None, :] < R),
                 other=0.0)  # [BLOCK_M, RANK]: s x A^T of these rows
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    gb = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        g = tl.load(g_ptr + rows[:, None] * sgm + ns[None, :] * sgn, mask=(rows[:, None] < M) & (ns[None, :] < N),
                    other=0.0)
        w = tl.load(w_ptr + ns[:, None] * swn + ks[None, :] * swk, mask=(ns[:, None] < N) & (ks[None, :] < K),
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        b = tl.load(b_ptr + ns[:, None] * sbn + ranks[None, :] * sbr, mask=(ns[:, None] < N) & (ranks[None, :] < R),
                    other=0.0)  # [BLOCK_N, RANK]
        acc = _dot(g, w, acc, PRECISION, UPCAST)
        gb = _dot(g, b, gb, PRECISION, UPCAST)
        if pid_k == 0:  # B's gradient, these rows' share: g^T (s h) over this tile of outputs
            grad_b = _dot(tl.trans(g), hs, tl.zeros((BLOCK_N, RANK), dtype=tl.float32), PRECISION, UPCAST)
            tl.store(share + R * K + ns[:, None] * R + ranks[None, :], grad_b,
                     mask=(ns[:, None] < N) & (ranks[None, :] < R))
    grad_h = _rounded(gb * scaling, dx_ptr.dtype.element_ty, UPCAST)  # s g B, rounded as its matmul rounds it
    a = tl.load(a_ptr + ranks[:, None] * sar + ks[None, :] * sak, mask=(ranks[:, None] < R) & (ks[None, :] < K),
                other=0.0)  # [RANK, BLOCK_K]
    acc = _dot(grad_h, a, acc, PRECISION, UPCAST)
    tl.store(dx_ptr + rows[:, None] * sdm + ks[None, :] * sdk, _rounded(acc, dx_ptr.dtype.element_ty, UPCAST),
             mask=(rows[:, None] < M) & (ks[None, :] < K))
    x = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0)  # [BLOCK_M, BLOCK_K]
    grad_a = _dot(tl.trans(grad_h), x, tl.zeros((RANK, BLOCK_K), dtype=tl.float32), PRECISION, UPCAST)
    tl.store(share + ranks[:, None] * K + ks[None, :], grad_a, mask=(ranks[:, None] < R) & (ks[None, :] < K))


@triton.jit
def _sum_kernel(partial_ptr, out_ptr, tiles, L, UPCAST: tl.constexpr, BLOCK: tl.constexpr):
    """out [L] = the sum over ``tiles`` rows of partial [tiles, L] (fp32, in row order: deterministic), rounded to
    out's dtype once."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for tile in range(0, tiles):
        total += tl.load(partial_ptr + tile * L + at, mask=at < L, other=0.0)
    tl.store(out_ptr + at, _rounded(total, out_ptr.dtype.element_ty, UPCAST), mask=at < L)


# whether Triton made these kernels for its interpreter (``TRITON_INTERPRET=1`` when it was imported)
INTERPRETED = not isinstance(_forward_kernel, triton.runtime.JITFunction)


def _rank_tile(r: int) -> int:
    """The adapter rank padded to a power of two of at least 16 (``tl.dot``'s smallest dimension)."""
    return max(16, triton.next_power_of_2(r))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (fp32: exact products, as torch.mm without TF32)


def _upcast(dtype: torch.dtype) -> bool:
    """In Triton's interpreter (bf16 only: its fp16 is not checked), the tiles upcast and the results rounded
    by their bits (:func:`_dot`, :func:`_rounded`)."""
    if not INTERPRETED or dtype == torch.float32:
        return False
    if dtype != torch.bfloat16:
        raise TypeError(f"lora kernels in Triton's interpreter: float32 or bfloat16, got {dtype}")
    return True


def _check(x, weight, lora_a, lora_b) -> None:
    if not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype):
        raise TypeError(f"lora kernels: one dtype for x, W, A, B, got {x.dtype}, {weight.dtype}, {lora_a.dtype}, "
                        f"{lora_b.dtype}")


def _launch(kernel, grid, operands, outputs, sizes, scaling: float, extra=(), **blocks) -> None:
    """``kernel`` over ``grid`` with its tensors (the operands, the outputs, then ``extra``: contiguous buffers),
    their sizes, the scale, the operands' and outputs' two strides each in the same order, and the tiles."""
    if not all(grid):  # (no rows: nothing to launch)
        return
    strides = [stride for t in (*operands, *outputs) for stride in t.stride()]
    dtype = operands[0].dtype
    wrap_triton(kernel)[grid](*operands, *outputs, *extra, *sizes, scaling, *strides, RANK=_rank_tile(sizes[-1]),
                              PRECISION=_precision(dtype), UPCAST=_upcast(dtype), num_warps=WARPS, num_stages=STAGES,
                              **blocks)


@triton_op("concept::lora_forward", mutates_args=())
def lora_forward(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [N, out], s x A^T [N, r]) for x [N, in], W [out, in], A [r, in], B [out, r]."""
    _check(x, weight, lora_a, lora_b)
    M, K = x.shape
    N, R = weight.shape[0], lora_a.shape[0]
    y, scaled_h = x.new_empty((M, N)), x.new_empty((M, R))
    _launch(_forward_kernel, (triton.cdiv(M, BLOCK_ROWS), triton.cdiv(N, BLOCK_OUT)), (x, weight, lora_a, lora_b),
            (y, scaled_h), (M, N, K, R), scaling, BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_OUT, BLOCK_K=BLOCK_REDUCE)
    return y, scaled_h


@triton_op("concept::lora_backward", mutates_args=())
def lora_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scaled_h: torch.Tensor, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [N, in], dA and dB flat [r in + out r]) for the output gradient g [N, out], the input x and ``s x A^T``
    (:func:`lora_forward`'s second output): two kernels, the second adding the row tiles' shares of dA and dB (one
    buffer: an op's outputs may not alias, so its caller takes the two views)."""
    _check(grad, weight, lora_a, lora_b)
    M, N = grad.shape
    K, R = weight.shape[1], lora_a.shape[0]
    tiles = triton.cdiv(M, BLOCK_ROWS)
    grad_x = grad.new_empty((M, K))
    # (no rows: one row of zeros, whose sum below is gradients of 0)
    partial = (torch.empty if tiles else torch.zeros)((max(tiles, 1), R * K + N * R), dtype=torch.float32,
                                                      device=grad.device)
    columns = backward_columns(grad.device)
    _launch(_backward_kernel, (tiles, triton.cdiv(K, columns)), (grad, x, weight, lora_a, lora_b, scaled_h),
            (grad_x,), (M, N, K, R), scaling, extra=(partial,), BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_REDUCE,
            BLOCK_K=columns)
    grads = grad.new_empty((R * K + N * R,))
    wrap_triton(_sum_kernel)[(triton.cdiv(R * K + N * R, SUM_BLOCK),)](partial, grads, max(tiles, 1), R * K + N * R,
                                                                       UPCAST=_upcast(grad.dtype), BLOCK=SUM_BLOCK)
    return grad_x, grads


def _setup_context(ctx, inputs, output) -> None:
    x, weight, lora_a, lora_b, scaling = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # (no zeros for s x A^T's gradient, which is never used)
    ctx.save_for_backward(x, weight, lora_a, lora_b, output[1])
    ctx.scaling = scaling


def _backward(ctx, grad, _grad_scaled_h):
    x, weight, lora_a, lora_b, scaled_h = ctx.saved_tensors
    need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
    grad_x, grads = torch.ops.concept.lora_backward(grad, x, weight, lora_a, lora_b, scaled_h, ctx.scaling)
    split = lora_a.numel()
    grad_a, grad_b = grads[:split].view_as(lora_a), grads[split:].view_as(lora_b)
    return grad_x if need_x else None, None, grad_a if need_a else None, grad_b if need_b else None, None


torch.library.register_autograd("concept::lora_forward", _backward, setup_context=_setup_context)
