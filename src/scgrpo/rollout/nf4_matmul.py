"""``x W^T`` with ``W`` a bitsandbytes nf4 weight, dequantized inside the matmul (one Triton kernel).

The streamed 4-bit mode (:mod:`scgrpo.rollout.four_bit`) dequantizes each weight into a bf16 scratch in every
decode step and multiplies by it: per step it writes and reads two bytes a weight besides reading the half byte of
the codes. This kernel reads the codes and the block scales and multiplies in registers: each tile of ``W`` is
the same values bitsandbytes' dequantization gives (the nf4 table entry times the block's fp32 scale, rounded once
to the compute dtype), then ``tl.dot`` with fp32 accumulation. Only the summation order differs from the
streamed mode's cuBLAS matmul.

A program takes :data:`BLOCK_N` weight rows and all of a decode batch's rows (up to 64); a weight of few rows has
its rows' length cut into runs that separate programs multiply, summed afterwards (:func:`splits`), so that a
launch fills the card. Off by default (:data:`scgrpo.rollout.four_bit.STREAM_KERNEL`): on an H200 it is still no
faster than dequantizing then multiplying (``scripts/tune_nf4_matmul.py``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.kernels import AVAILABLE, usable

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _nf4_matmul_kernel(codes_ptr, scales_ptr, table_ptr, x_ptr, out_ptr, m, n, stride_xm, stride_os, stride_on,
                           K: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                           PRECISION: tl.constexpr):
        """out[s, rn, rm] = sum over the ``s``-th of ``SPLIT`` runs of ``K`` of W[rn, k] x[rm, k] (``K`` a constant:
        one compilation a row length). ``W`` comes from its packed codes (two a byte, the high nibble first,
        row-major over the flat weight) and one fp32 scale a flat block of ``BLOCKSIZE`` weights; ``ROW_BLOCKS``:
        rows are whole blocks and a step of ``BLOCK_K`` weights lies in one block (one scale a row a step)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row = tl.where(rn < n, rn, 0).to(tl.int64)  # (rows past the weight read row 0; their results are not stored)
        half = tl.arange(0, BLOCK_K // 2)
        kk = tl.arange(0, BLOCK_K)
        codes_row = codes_ptr + row * (K // 2)  # [BN]
        m_ok = rm[None, :] < m
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        first = pid_k * (K // SPLIT)
        for step in range(0, K // SPLIT, BLOCK_K):
            k0 = first + step
            packed = tl.load(codes_row[:, None] + (k0 // 2 + half)[None, :])  # [BN, BK/2]
            high = (packed >> 4) & 0xF
            low = packed & 0xF
            codes = tl.reshape(tl.join(high, low), (BLOCK_N, BLOCK_K))  # the flat order: high, then low
            values = tl.load(table_ptr + codes.to(tl.int32))  # [BN, BK] fp32
            if ROW_BLOCKS:
                scales = tl.load(scales_ptr + row * (K // BLOCKSIZE) + k0 // BLOCKSIZE)[:, None]  # [BN, 1]
            else:
                scales = tl.load(scales_ptr + (row[:, None] * K + k0 + kk[None, :]) // BLOCKSIZE)  # [BN, BK]
            w = (values * scales).to(x_ptr.dtype.element_ty)  # rounded once, as bitsandbytes rounds
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + (k0 + kk)[:, None], mask=m_ok, other=0.0)  # [BK, BM]
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # (fp32 operands: full fp32 products, not TF32)
        out = out_ptr + pid_k * stride_os + rn[:, None] * stride_on + rm[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rn[:, None] < n) & m_ok)

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, total, m, stride_on, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """out[i // m, i % m] = sum over s of part[s, i] (``part`` fp32 ``[SPLIT, total]``), in the output's dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(part_ptr + s * total + i, mask=ok, other=0.0)
        tl.store(out_ptr + (i // m) * stride_on + i % m, acc.to(out_ptr.dtype.element_ty), mask=ok)


BLOCK_K = 64
"""Weights of a row per step of the kernel's loop (a row's length must be a multiple of it)"""
BLOCK_N = 128
"""Weight rows a program takes"""
PROGRAMS = 256
"""Programs a launch aims at (about twice an H100's or H200's 132 multiprocessors): a weight of few rows, such as a
key or value projection, has its rows' length cut into :func:`splits` runs summed afterwards (on an H200 the
splits this gives were the fastest measured for each of Qwen3-8B's projections at 128-row tiles,
benchmarks/results/tune_nf4_matmul_h200.json)"""
MAX_SPLIT = 16
NUM_WARPS = 4
NUM_STAGES = 3


def splits(n: int, k: int, m_blocks: int = 1, block_n: int = BLOCK_N) -> int:
    """Runs of a row's ``k`` weights that separate programs multiply (a power of two, each run whole steps of
    :data:`BLOCK_K`), so that a launch has about :data:`PROGRAMS` programs."""
    programs = -(-n // block_n) * m_blocks
    split = 1
    while (split * 2 <= MAX_SPLIT and programs * split < PROGRAMS and k % (split * 2 * BLOCK_K) == 0):
        split *= 2
    return split


def supported(dequantizer, device: torch.device) -> bool:
    """Whether the kernel takes ``dequantizer``'s weight (a :class:`~scgrpo.rollout.four_bit.Dequantizer`): nf4,
    bitsandbytes' flat layout, rows a multiple of :data:`BLOCK_K` long, on a GPU with Triton (or its interpreter)."""
    return (usable(device) and dequantizer.quant_type == "nf4" and not dequantizer.cpu_layout
            and dequantizer.cols % BLOCK_K == 0 and dequantizer.cols % 2 == 0)


def nf4_table(device: torch.device) -> Tensor:
    """bitsandbytes' 16 nf4 values (fp32), once per device (:func:`_nf4_table`)."""
    return _nf4_table(str(device))


@functools.cache
def _nf4_table(device: str) -> Tensor:
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type("nf4", device=torch.device(device)).float().contiguous()


def nf4_matmul_t(x: Tensor, dequantizer, out_t: Optional[Tensor] = None, block_m: Optional[int] = None,
                 block_n: int = BLOCK_N, split: Optional[int] = None, num_warps: int = NUM_WARPS,
                 num_stages: int = NUM_STAGES) -> Tensor:
    """``W x^T`` ``[N, M]`` for ``x`` ``[M, K]`` (the compute dtype) and ``dequantizer``'s nf4 weight ``W`` ``[N,
    K]``, into ``out_t`` when given (rows of a transposed output, as the streamed mode writes them). ``block_m``:
    rows of ``x`` a program takes (default: all of a decode batch up to 64, so that each weight tile is read once);
    ``split``: runs of ``K`` multiplied apart and then summed (default: :func:`splits`); ``num_warps``,
    ``num_stages``: Triton's launch settings."""
    dequantizer.prepare()  # the fp32 block scales
    m, k = x.shape
    n = dequantizer.rows
    if k != dequantizer.cols:
        raise ValueError(f"x has {k} columns, the weight {dequantizer.cols}")
    x = x.contiguous()
    block_m = block_m or min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, block_m)
    split = split or splits(n, k, m_blocks, block_n)
    if k % (split * BLOCK_K):
        raise ValueError(f"a row of {k} weights does not cut into {split} runs of whole {BLOCK_K}-weight steps")
    out_t = torch.empty(n, m, dtype=x.dtype, device=x.device) if out_t is None else out_t
    size = dequantizer.blocksize
    row_blocks = k % size == 0 and size % BLOCK_K == 0
    grid = (triton.cdiv(n, block_n), m_blocks, split)
    if split == 1:
        target, stride_s, stride_n = out_t, 0, out_t.stride(0)
    else:
        target = torch.empty(split, n, m, dtype=torch.float32, device=x.device)
        stride_s, stride_n = target.stride(0), target.stride(1)
    _nf4_matmul_kernel[grid](dequantizer.packed, dequantizer.scales, nf4_table(x.device), x, target, m, n,
                             x.stride(0), stride_s, stride_n, K=k, BLOCKSIZE=size, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=BLOCK_K, SPLIT=split, ROW_BLOCKS=row_blocks,
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        total, block = n * m, 1024
        _sum_splits_kernel[(triton.cdiv(total, block),)](target, out_t, total, m, out_t.stride(0), SPLIT=split,
                                                          BLOCK=block)
    return out_t
