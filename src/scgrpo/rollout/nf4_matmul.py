"""``x W^T`` with ``W`` a bitsandbytes nf4 weight, dequantized inside the matmul (one Triton kernel).

The streamed 4-bit mode (:mod:`scgrpo.rollout.four_bit`) dequantizes each weight into a bf16 scratch in every
decode step and multiplies by it: per step it writes and reads two bytes a weight besides reading the half byte of
the codes. This kernel reads the codes and the block scales and multiplies in registers: each tile of ``W`` is
the same values bitsandbytes' dequantization gives (the nf4 table entry times the block's fp32 scale, rounded once
to the compute dtype), then ``tl.dot`` with fp32 accumulation. Only the summation order differs from the
streamed mode's cuBLAS matmul.

Off by default (:data:`scgrpo.rollout.four_bit.STREAM_KERNEL`): its speed is to be measured against the streamed
mode's before it replaces it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.kernels import AVAILABLE, usable

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _nf4_matmul_kernel(codes_ptr, scales_ptr, table_ptr, x_ptr, out_ptr, m, n, stride_xm, stride_on,
                           K: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """out[rn, rm] = sum_k W[rn, k] x[rm, k] (``K`` columns, a constant: one compilation a row length): ``W``
        from its packed codes (two a byte, the high nibble first,
        row-major over the flat weight) and one fp32 scale a flat block of ``BLOCKSIZE`` weights."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rn[:, None] < n
        half = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            flat = rn[:, None] * K + k0  # [BN, 1] the flat index of the tile's first weight in each row
            packed = tl.load(codes_ptr + flat // 2 + half[None, :], mask=row_ok, other=0)  # [BN, BK/2]
            high = (packed >> 4) & 0xF
            low = packed & 0xF
            codes = tl.reshape(tl.join(high, low), (BLOCK_N, BLOCK_K))  # the flat order: high, then low
            values = tl.load(table_ptr + codes.to(tl.int32))  # [BN, BK] fp32
            cols = k0 + tl.arange(0, BLOCK_K)
            scales = tl.load(scales_ptr + (rn[:, None] * K + cols[None, :]) // BLOCKSIZE, mask=row_ok, other=0.0)
            w = (values * scales).to(x_ptr.dtype.element_ty)  # rounded once, as bitsandbytes rounds
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + cols[:, None], mask=rm[None, :] < m, other=0.0)  # [BK, BM]
            acc += tl.dot(w, xt)
        out = out_ptr + rn[:, None] * stride_on + rm[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (rm[None, :] < m))


BLOCK_K = 64
"""Weights of a row per step of the kernel's loop (a row's length must be a multiple of it)"""


def supported(dequantizer, device: torch.device) -> bool:
    """Whether the kernel takes ``dequantizer``'s weight (a :class:`~scgrpo.rollout.four_bit.Dequantizer`): nf4,
    bitsandbytes' flat layout, rows a multiple of :data:`BLOCK_K` long, on a GPU with Triton (or its interpreter)."""
    from scgrpo.rollout.four_bit import cpu_packed

    return (usable(device) and dequantizer.quant_type == "nf4" and not cpu_packed(dequantizer.state)
            and dequantizer.cols % BLOCK_K == 0 and dequantizer.cols % 2 == 0)


_TABLES: dict = {}


def nf4_table(device: torch.device) -> Tensor:
    """bitsandbytes' 16 nf4 values (fp32), once per device."""
    key = str(device)
    if key not in _TABLES:
        from bitsandbytes.functional import get_4bit_type

        _TABLES[key] = get_4bit_type("nf4", device=device).float().contiguous()
    return _TABLES[key]


def nf4_matmul_t(x: Tensor, dequantizer, out_t: Optional[Tensor] = None, block_m: Optional[int] = None,
                 block_n: int = 64) -> Tensor:
    """``W x^T`` ``[N, M]`` for ``x`` ``[M, K]`` (the compute dtype) and ``dequantizer``'s nf4 weight ``W`` ``[N,
    K]``, into ``out_t`` when given (rows of a transposed output, as the streamed mode writes them). ``block_m``:
    rows of ``x`` a program takes (default: all of a decode batch up to 64, so that each weight tile is read once;
    launch settings not yet tuned)."""
    dequantizer.prepare()  # the fp32 block scales
    m, k = x.shape
    n = dequantizer.rows
    if k != dequantizer.cols:
        raise ValueError(f"x has {k} columns, the weight {dequantizer.cols}")
    x = x.contiguous()
    block_m = block_m or min(64, max(16, triton.next_power_of_2(m)))
    out_t = torch.empty(n, m, dtype=x.dtype, device=x.device) if out_t is None else out_t
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _nf4_matmul_kernel[grid](dequantizer.packed, dequantizer.scales, nf4_table(x.device), x, out_t, m, n,
                             x.stride(0), out_t.stride(0), K=k, BLOCKSIZE=dequantizer.blocksize, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    return out_t
