"""A matmul with LoRA's low-rank term in its epilogue: ``y = x W^T + round(x A^T) up (+ bias)`` in one Triton kernel.

Unmerged LoRA otherwise costs a second kernel per projection (the up-projection, or multiply-adds that re-read
``up`` for every row); here each program computes its tile of ``x W^T`` and, in the same pass over ``x``, the
tile's rows of ``z = x A^T`` (every column block recomputes them: BLOCK_R / BLOCK_N more multiply-adds than the
matmul's, BLOCK_R = max(16, r rounded up to a power of two)), then adds ``z up`` for its columns before storing.
``z`` is rounded to ``up``'s dtype first, as peft's ``lora_A`` output is to the model's.

Measured against cuBLAS by ``scripts/bench_lora_gemm.py``; not yet wired into the decode step.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.kernels import AVAILABLE

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _lora_gemm_kernel(
        x, stride_xm, w, stride_wn, a, stride_ar, up, stride_ur, bias, y, stride_ym,
        M, N, R, K: tl.constexpr,  # K fixed per projection (and the CPU interpreter loops only to constants)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        zacc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            xk = tl.load(x + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                         other=0.0)
            wk = tl.load(w + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                         other=0.0)
            ak = tl.load(a + rr[:, None] * stride_ar + kk[None, :], mask=(rr[:, None] < R) & (kk[None, :] < K),
                         other=0.0)
            acc = tl.dot(xk, tl.trans(wk), acc, input_precision=PRECISION)
            zacc = tl.dot(xk, tl.trans(ak), zacc, input_precision=PRECISION)
        u = tl.load(up + rr[:, None] * stride_ur + rn[None, :], mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(zacc.to(u.dtype), u, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rm[:, None] * stride_ym + rn[None, :], acc.to(y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def lora_gemm(x: Tensor, weight: Tensor, a: Tensor, up: Tensor, bias: Optional[Tensor] = None,
              block_m: int = 64, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
              num_stages: int = 3) -> Tensor:
    """``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``a`` ``[R, K]``, ``up`` ``[R, N]`` -> ``[M, N]`` (see the module
    docstring); rows of every operand contiguous."""
    if not AVAILABLE:
        raise RuntimeError("lora_gemm needs Triton")
    m, k = x.shape
    n, r = weight.shape[0], a.shape[0]
    shapes_agree = weight.shape[1] == k and a.shape[1] == k and tuple(up.shape) == (r, n)
    if not shapes_agree or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"lora_gemm shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, a {tuple(a.shape)}, "
                         f"up {tuple(up.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    if not (x.stride(1) == weight.stride(1) == a.stride(1) == up.stride(1) == 1):
        raise ValueError("lora_gemm needs operands with contiguous rows")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _lora_gemm_kernel[grid](
            x, x.stride(0), weight, weight.stride(0), a, a.stride(0), up, up.stride(0),
            bias if bias is not None else x, out, out.stride(0), m, n, r, k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=max(16, triton.next_power_of_2(r)),
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages,
        )
    return out
