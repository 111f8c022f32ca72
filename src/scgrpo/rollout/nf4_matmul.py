"""``x W^T`` with ``W`` a bitsandbytes nf4 weight, dequantized inside the matmul (one Triton kernel).

The streamed 4-bit mode (:mod:`scgrpo.rollout.four_bit`) dequantizes each weight into a bf16 scratch in every
decode step and multiplies by it: per step it writes and reads two bytes a weight besides reading the half byte of
the codes. This kernel reads the codes and the block scales and multiplies in registers: each tile of ``W`` is
the same values bitsandbytes' dequantization gives (the nf4 table entry times the block's fp32 scale, rounded once
to the compute dtype), then ``tl.dot`` with fp32 accumulation. Only the summation order differs from the
streamed mode's cuBLAS matmul.

A program takes :data:`BLOCK_N` weight rows and all of a decode batch's rows (up to 64); a weight of few rows has
its rows' length cut into runs that separate programs multiply, summed afterwards (:func:`splits`), so that a
launch fills the card. Codes become values by one of :data:`LOOKUPS`: a look-up in memory a code ("table"), one
a byte for its two values ("pairs"), or none, byte permutes in registers ("registers",
:mod:`scgrpo.rollout.nf4_lookup`). The product is ``x W^T`` with the weight tile through shared memory
(:data:`ORDERS`: a register operand races in Triton 3.6's pipelined Hopper matmul).

On an H200 (Qwen3-8B's projections, 64 rows, each shape at its best launch, ``scripts/tune_nf4_matmul.py``,
benchmarks/results/tune_nf4_matmul_orders_h200.json) a decode step's projections take 6.8 ms against 12.3 ms
dequantizing then multiplying (630 against 345 GB/s), and every weight of every tuned launch is bitsandbytes' own
over 20 passes (``scripts/check_nf4_matmul.py``, benchmarks/results/check_nf4_matmul_orders_h200.json, where the
register-operand product at its launch returns wrong weights in 16 of 20).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout import nf4_lookup
from scgrpo.rollout.kernels import AVAILABLE, INTERPRET, usable

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _nf4_matmul_kernel(codes_ptr, scales_ptr, table_ptr, x_ptr, out_ptr, m, n, stride_xm, stride_os, stride_on,
                           stride_om,
                           K: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                           LOOKUP: tl.constexpr, LOOKUP_PTX: tl.constexpr, PRECISION: tl.constexpr,
                           ORDER: tl.constexpr):
        """out[s, rn, rm] (at ``s * stride_os + rn * stride_on + rm * stride_om``) = sum over the ``s``-th of
        ``SPLIT`` runs of ``K`` of W[rn, k] x[rm, k] (``K`` a constant: one compilation a row length). ``W`` comes
        from its packed codes (two a byte, the high nibble first, row-major over the flat weight) and one fp32
        scale a flat block of ``BLOCKSIZE`` weights; ``ROW_BLOCKS``: rows are whole blocks and a step of ``BLOCK_K``
        weights is whole blocks or lies in one (a row's scales of a step are read once, not per weight).
        ``LOOKUP`` (:data:`LOOKUPS`' index) says how codes become values:
        0, ``table_ptr`` holds the 16 values, looked up a code; 1, it holds each byte's two values in one 64-bit word
        (the high nibble's in the low half), looked up a byte; 2, ``LOOKUP_PTX`` (:mod:`scgrpo.rollout.nf4_lookup`)
        turns each 32-bit word of codes into its eight values in registers. ``ORDER`` (:data:`ORDERS`' index): 0,
        the product is ``x W^T`` (the tile of ``W`` the second operand); 1, ``W x^T``."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row = tl.where(rn < n, rn, 0).to(tl.int64)  # (rows past the weight read row 0; their results are not stored)
        half = tl.arange(0, BLOCK_K // 2)
        kk = tl.arange(0, BLOCK_K)
        m_ok = rm[None, :] < m
        x_ok = rm[:, None] < m
        if ORDER == 0:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        first = pid_k * (K // SPLIT)
        # (pointers advanced by a step each iteration: no per-weight address arithmetic in the loop)
        words_ptrs = (codes_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] * (K // 8)
                      + (first // 8 + tl.arange(0, BLOCK_K // 8))[None, :])  # [BN, BK/8] (LOOKUP 2)
        packed_ptrs = codes_ptr + row[:, None] * (K // 2) + (first // 2 + half)[None, :]  # [BN, BK/2] (else)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (first + kk)[None, :]  # [BM, BK]: contiguous along K
        if LOOKUP == 2 and LOOKUP_PTX != "":  # the table's byte planes (nf4_lookup.plane_registers), once
            planes = table_ptr.to(tl.pointer_type(tl.int32))
            p0, p1, p2, p3 = tl.load(planes + 0), tl.load(planes + 1), tl.load(planes + 2), tl.load(planes + 3)
            p4, p5, p6, p7 = tl.load(planes + 4), tl.load(planes + 5), tl.load(planes + 6), tl.load(planes + 7)
            p8, p9, p10, p11 = tl.load(planes + 8), tl.load(planes + 9), tl.load(planes + 10), tl.load(planes + 11)
            p12, p13, p14, p15 = tl.load(planes + 12), tl.load(planes + 13), tl.load(planes + 14), tl.load(planes + 15)
        for step in range(0, K // SPLIT, BLOCK_K):
            k0 = first + step
            if LOOKUP == 2:
                words = tl.load(words_ptrs)
                words_ptrs += BLOCK_K // 8
                if LOOKUP_PTX == "":  # (Triton's interpreter runs no PTX: the same words through the table)
                    v0 = tl.load(table_ptr + ((words >> 4) & 0xF)).to(tl.int32, bitcast=True)
                    v1 = tl.load(table_ptr + (words & 0xF)).to(tl.int32, bitcast=True)
                    v2 = tl.load(table_ptr + ((words >> 12) & 0xF)).to(tl.int32, bitcast=True)
                    v3 = tl.load(table_ptr + ((words >> 8) & 0xF)).to(tl.int32, bitcast=True)
                    v4 = tl.load(table_ptr + ((words >> 20) & 0xF)).to(tl.int32, bitcast=True)
                    v5 = tl.load(table_ptr + ((words >> 16) & 0xF)).to(tl.int32, bitcast=True)
                    v6 = tl.load(table_ptr + ((words >> 28) & 0xF)).to(tl.int32, bitcast=True)
                    v7 = tl.load(table_ptr + ((words >> 24) & 0xF)).to(tl.int32, bitcast=True)
                else:
                    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                        LOOKUP_PTX, "=r,=r,=r,=r,=r,=r,=r,=r" + ",r" * 17,
                        [words, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15],
                        dtype=(tl.int32,) * 8, is_pure=True, pack=1)
                # weight 4a + 2b + c of a word: the last axis of the outermost join is c, the first a
                values = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
                values = tl.reshape(values, (BLOCK_N, BLOCK_K)).to(tl.float32, bitcast=True)
            else:
                packed = tl.load(packed_ptrs)  # [BN, BK/2]
                packed_ptrs += BLOCK_K // 2
                if LOOKUP == 1:
                    word = tl.load(table_ptr + packed.to(tl.int32))  # [BN, BK/2] int64
                    v_high = word.to(tl.int32).to(tl.float32, bitcast=True)
                    v_low = (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                else:
                    v_high = tl.load(table_ptr + ((packed >> 4) & 0xF).to(tl.int32))  # [BN, BK/2] fp32
                    v_low = tl.load(table_ptr + (packed & 0xF).to(tl.int32))
                values = tl.reshape(tl.join(v_high, v_low), (BLOCK_N, BLOCK_K))  # the flat order: high, then low
            if ROW_BLOCKS:
                if BLOCK_K <= BLOCKSIZE:
                    scales = tl.load(scales_ptr + row * (K // BLOCKSIZE) + k0 // BLOCKSIZE)[:, None]  # [BN, 1]
                else:  # [BN, BK / BLOCKSIZE] spread over each block's weights
                    nb = tl.arange(0, BLOCK_K // BLOCKSIZE)
                    s2 = tl.load(scales_ptr + row[:, None] * (K // BLOCKSIZE) + k0 // BLOCKSIZE + nb[None, :])
                    scales = tl.reshape(tl.broadcast_to(s2[:, :, None], (BLOCK_N, BLOCK_K // BLOCKSIZE, BLOCKSIZE)),
                                        (BLOCK_N, BLOCK_K))
            else:
                scales = tl.load(scales_ptr + (row[:, None] * K + k0 + kk[None, :]) // BLOCKSIZE)  # [BN, BK]
            w = (values * scales).to(x_ptr.dtype.element_ty)  # rounded once, as bitsandbytes rounds
            xs = tl.load(x_ptrs, mask=x_ok, other=0.0)  # [BM, BK]
            x_ptrs += BLOCK_K
            # (fp32 operands: full fp32 products, not TF32)
            if ORDER == 0:
                acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)  # [BM, BN]
            else:
                acc = tl.dot(w, tl.trans(xs), acc, input_precision=PRECISION)  # [BN, BM]
        if ORDER == 0:
            out = out_ptr + pid_k.to(tl.int64) * stride_os + rn[None, :] * stride_on + rm[:, None] * stride_om
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rn[None, :] < n) & x_ok)
        else:
            out = out_ptr + pid_k.to(tl.int64) * stride_os + rn[:, None] * stride_on + rm[None, :] * stride_om
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rn[:, None] < n) & m_ok)

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, total, inner, stride_outer, stride_inner, SPLIT: tl.constexpr,
                           BLOCK: tl.constexpr):
        """sum over s of part[s, i] (``part`` fp32 ``[SPLIT, total]``), in the output's dtype, at
        ``(i // inner) * stride_outer + (i % inner) * stride_inner`` of ``out``."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(part_ptr + s * total + i, mask=ok, other=0.0)
        tl.store(out_ptr + (i // inner) * stride_outer + (i % inner) * stride_inner, acc.to(out_ptr.dtype.element_ty),
                 mask=ok)


STEP = 64
"""The shortest step of the kernel's loop along a row: a row's length must be a multiple of it"""
BLOCK_K = 128
"""Weights of a row per step of the kernel's loop (rows whose length it does not divide take :data:`STEP`)"""
BLOCK_N = 64
"""Weight rows a program takes"""
PROGRAMS = 256
"""Programs a launch aims at (about twice an H100's or H200's 132 multiprocessors): a weight of few rows, such as a
key or value projection, has its rows' length cut into :func:`splits` runs summed afterwards (the split of a shape
in :data:`TUNED` was measured instead)"""
MAX_SPLIT = 16
LOOKUPS = ("table", "pairs", "registers")
"""How the kernel turns codes into values (its ``LOOKUP``): a look-up in memory a code, one a byte, none"""
LOOKUP = "registers"
"""The default of :data:`LOOKUPS` ("registers" needs rows of whole 32-bit words, else "pairs" serves)"""
ORDERS = ("xw", "wx")
"""The kernel's product (its ``ORDER``): ``x W^T``, the weight tile the second operand (through shared memory), or
``W x^T``, the weight tile the first (in registers). Triton 3.6 pipelines a product by a register operand
(Hopper's wgmma) so that the next step overwrites those registers before the product has read them, unless
ptxas is 13.3 or later (triton-lang/triton#9433; Triton 3.6 ships ptxas 12.8): "wx" is for measurement only"""
ORDER = "xw"
NUM_WARPS = 4
NUM_STAGES = 3
_QWEN3_8B = {  # NxK: (block_k, block_n, num_warps, num_stages, split)
    "4096x4096": (128, 64, 4, 4, 4), "1024x4096": (128, 64, 8, 3, 8), "12288x4096": (128, 64, 4, 3, 2),
    "4096x12288": (128, 128, 8, 3, 8)}
TUNED: dict[str, dict] = {
    shape: dict(block_k=bk, block_n=bn, num_warps=w, num_stages=st, split=sp, lookup="registers", order="xw")
    for shape, (bk, bn, w, st, sp) in _QWEN3_8B.items()}
"""Settings by weight shape (``"NxK"``: any of :func:`launch_settings`' names), measured by
``scripts/tune_nf4_matmul.py`` (its ``launches``): Qwen3-8B's projections at 64 rows on an H200
(benchmarks/results/tune_nf4_matmul_orders_h200.json; the module defaults are its MLP's)"""


def splits(n: int, k: int, m_blocks: int = 1, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
           programs_wanted: int = PROGRAMS) -> int:
    """Runs of a row's ``k`` weights that separate programs multiply (a power of two, each run whole steps of
    ``block_k``), so that a launch has about ``programs_wanted`` programs."""
    programs = -(-n // block_n) * m_blocks
    split = 1
    while (split * 2 <= MAX_SPLIT and programs * split < programs_wanted and k % (split * 2 * block_k) == 0):
        split *= 2
    return split


def supported(dequantizer, device: torch.device) -> bool:
    """Whether the kernel takes ``dequantizer``'s weight (a :class:`~scgrpo.rollout.four_bit.Dequantizer`): nf4,
    bitsandbytes' flat layout, rows a multiple of :data:`STEP` long, on a GPU with Triton (or its interpreter)."""
    return (usable(device) and dequantizer.quant_type == "nf4" and not dequantizer.cpu_layout
            and dequantizer.cols % STEP == 0)


def registers_usable(dequantizer) -> bool:
    """Whether the "registers" look-up takes the weight: rows of whole 32-bit words of codes, 4-byte aligned. (Under
    Triton's interpreter, which runs no PTX, the kernel reads the same words and looks their codes up in memory.)"""
    return dequantizer.cols % 8 == 0 and dequantizer.packed.data_ptr() % 4 == 0


def nf4_table(device: torch.device) -> Tensor:
    """bitsandbytes' 16 nf4 values (fp32), once per device (:func:`_nf4_table`)."""
    return _nf4_table(str(device))


@functools.cache
def _nf4_table(device: str) -> Tensor:
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type("nf4", device=torch.device(device)).float().contiguous()


def nf4_pair_table(device: torch.device) -> Tensor:
    """For each byte ``b``, the fp32 values of its two codes in one int64 word: the high nibble's (``b >> 4``, the
    even weight) in the low 32 bits, the low nibble's in the high ones; 256 words, once per device."""
    return _nf4_pair_table(str(device))


@functools.cache
def _nf4_pair_table(device: str) -> Tensor:
    bits = nf4_table(torch.device(device)).cpu().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    byte = torch.arange(256)
    return ((bits[byte & 0xF] << 32) | bits[byte >> 4]).to(device)


def nf4_plane_table(device: torch.device) -> Tensor:
    """The nf4 table's byte planes as the "registers" look-up takes them (:func:`nf4_lookup.plane_registers`, int32),
    once per device."""
    return _nf4_plane_table(str(device))


@functools.cache
def _nf4_plane_table(device: str) -> Tensor:
    words = torch.tensor(nf4_lookup.plane_registers(), dtype=torch.int64)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).to(device)


def launch_settings(n: int, k: int, **given) -> dict:
    """The kernel's settings for a weight ``[n, k]``: those ``given`` (not None), else :data:`TUNED`'s for the
    shape, else the module's defaults."""
    tuned = TUNED.get(f"{n}x{k}", {})
    defaults = dict(block_n=BLOCK_N, split=None, num_warps=NUM_WARPS, num_stages=NUM_STAGES, block_k=BLOCK_K,
                    lookup=LOOKUP, order=ORDER)
    return {name: given[name] if given.get(name) is not None else tuned.get(name, default)
            for name, default in defaults.items()}


def nf4_matmul_t(x: Tensor, dequantizer, out_t: Optional[Tensor] = None, block_m: Optional[int] = None,
                 block_n: Optional[int] = None, split: Optional[int] = None, num_warps: Optional[int] = None,
                 num_stages: Optional[int] = None, block_k: Optional[int] = None,
                 lookup: Optional[str] = None, order: Optional[str] = None) -> Tensor:
    """``W x^T`` ``[N, M]`` for ``x`` ``[M, K]`` (the compute dtype) and ``dequantizer``'s nf4 weight ``W`` ``[N,
    K]``, into ``out_t`` when given: rows of a transposed output (``[N, M]``, unit stride along M), or the transpose
    of columns of a row-major one (``y[:, a:b].t()``, unit stride along N). ``block_m``:
    rows of ``x`` a program takes (default: all of a decode batch up to 64, so that each weight tile is read once);
    ``split``: runs of ``K`` multiplied apart and then summed (default: :func:`splits`); ``num_warps``,
    ``num_stages``: Triton's launch settings; ``block_k``: the kernel's ``BLOCK_K``; ``lookup``: one of
    :data:`LOOKUPS`; ``order``: one of :data:`ORDERS`. Settings not given come from :func:`launch_settings`."""
    dequantizer.prepare()  # the fp32 block scales
    m, k = x.shape
    n = dequantizer.rows
    if k != dequantizer.cols:
        raise ValueError(f"x has {k} columns, the weight {dequantizer.cols}")
    x = x.contiguous()
    launch = launch_settings(n, k, block_n=block_n, split=split, num_warps=num_warps, num_stages=num_stages,
                             block_k=block_k, lookup=lookup, order=order)
    if launch["order"] not in ORDERS:
        raise ValueError(f"order {launch['order']!r}: one of {ORDERS}")
    block_m = block_m or min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, block_m)
    if m_blocks > 1 and split is None:  # (a tuned split is for one block of rows: :func:`splits` decides for more)
        launch["split"] = None
    if block_k is None and k % (launch["block_k"] * (split or 1)):  # (a row the default step does not cut: the
        launch.update(block_k=STEP, split=split)  # shortest step, and a split of its own unless one was given)
    block_n, split, block_k = launch["block_n"], launch["split"], launch["block_k"]
    split = split or splits(n, k, m_blocks, block_n, block_k)
    if k % (split * block_k):
        raise ValueError(f"a row of {k} weights does not cut into {split} runs of whole {block_k}-weight steps")
    out_t = torch.empty(n, m, dtype=x.dtype, device=x.device) if out_t is None else out_t
    size = dequantizer.blocksize
    row_blocks = k % size == 0 and (size % block_k == 0 or block_k % size == 0)
    grid = (triton.cdiv(n, block_n), m_blocks, split)
    m_inner = out_t.stride(1) == 1  # (rows of a transposed output; else columns of a row-major one)
    if split == 1:
        target = out_t
    else:  # fp32 partial sums laid out as the output is
        target = torch.empty(split, *((n, m) if m_inner else (m, n)), dtype=torch.float32, device=x.device)
        target = target if m_inner else target.transpose(1, 2)
    lookup = launch["lookup"]
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup {lookup!r}: one of {LOOKUPS}")
    if lookup == "registers" and not registers_usable(dequantizer):
        lookup = "pairs"
    in_registers = lookup == "registers" and not INTERPRET
    table = (nf4_plane_table(x.device) if in_registers else nf4_pair_table(x.device) if lookup == "pairs"
             else nf4_table(x.device))
    _nf4_matmul_kernel[grid](dequantizer.packed, dequantizer.scales, table, x, target, m, n,
                             x.stride(0), target.stride(0) if split > 1 else 0, target.stride(-2),
                             target.stride(-1), K=k, BLOCKSIZE=size, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, ROW_BLOCKS=row_blocks,
                             LOOKUP=LOOKUPS.index(lookup), LOOKUP_PTX=nf4_lookup.ptx() if in_registers else "",
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=launch["num_warps"],
                             num_stages=launch["num_stages"], ORDER=ORDERS.index(launch["order"]))
    if split > 1:
        total, block = n * m, 1024
        inner, outer, step = ((m, out_t.stride(0), out_t.stride(1)) if m_inner  # (the partials' memory order)
                              else (n, out_t.stride(1), out_t.stride(0)))
        _sum_splits_kernel[(triton.cdiv(total, block),)](target, out_t, total, inner, outer, step, SPLIT=split,
                                                          BLOCK=block)
    return out_t
