"""A projection with its unmerged LoRA term as one Triton launch: ``x W^T + (x A^T) (s B)^T``.

For the decode step's few rows the projections are launch-bound, not bandwidth-bound (SmolLM2-135M's q/k/v
weight is 1.1 MB: a third of a microsecond of an H100's memory time), so a LoRA term done as a second launch
costs about as much as the matmul itself. Here each program computes a tile of outputs for a block of rows: the
base product and its adapters' ``z = x A^T`` in the same loop over the input (the A rows follow W's in
:class:`~scgrpo.rollout.projection.Projection`'s weight; for few rows the tile's W rows and A rows are loaded as one
operand of one dot, whose output columns are split after the loop), then ``z (s B)^T`` from the block-diagonal
``up``, all as tensor-core dots. A program whose columns all belong to one of the fused layers (q, k, v; gate,
up) reads only that layer's ranks.

The roundings are the two-launch path's (see :mod:`scgrpo.rollout.norms`): the base product (plus bias) rounded to
the model dtype, ``z`` rounded to it, the LoRA term added to the rounded base in fp32 and the sum rounded once, as
peft does with fp32 adapters (whose A and s B are here held in the model dtype).

Available where Triton is (GPUs); ``TRITON_INTERPRET=1`` runs it on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.kernels import AVAILABLE, INTERPRET
from scgrpo.rollout.norms import _device, _pow2

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _lora_matmul_kernel(
        x, stride_x,  # [M, K]
        w, stride_w,  # [OUT + R, K]: the base rows, then the adapters' A rows
        bias,  # [OUT] (HAS_BIAS)
        up, stride_up,  # [R, OUT]: the scaled B^T's, block-diagonal
        out, stride_out,  # [M, OUT]
        M,
        K: tl.constexpr, OUT: tl.constexpr, R: tl.constexpr,
        S1: tl.constexpr, S2: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr,
        PER_LAYER: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        ONE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program (i, j): rows i * BLOCK_M ... by outputs j * BLOCK_N .... With PER_LAYER the layers' output
        boundaries S1, S2 are multiples of BLOCK_N and the program reads only its layer's R0, R1 or R2 ranks."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col0 = tl.program_id(1) * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        rmask, cmask = rows < M, cols < OUT
        dtype = out.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if R > 0:
            if PER_LAYER:
                lo = tl.where(col0 >= S2, R0 + R1, tl.where(col0 >= S1, R0, 0))
                n = tl.where(col0 >= S2, R2, tl.where(col0 >= S1, R1, R0))
            else:
                lo, n = 0, R
            rr = tl.arange(0, BLOCK_R)
            live = rr < n
            z = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            # the B tile and the bias loaded first, their latency hidden behind the loop
            bt = tl.load(up + (lo + rr)[:, None] * stride_up + cols[None, :], mask=live[:, None] & cmask[None, :],
                         other=0.0)
        if HAS_BIAS:
            bv = tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)
        if ONE_DOT:  # (BLOCK_R == BLOCK_N) the tile's W rows and its A rows as one [BLOCK_K, 2 BLOCK_N] operand
            both = tl.arange(0, 2 * BLOCK_N)
            first = both < BLOCK_N
            wrow = tl.where(first, col0 + both, OUT + lo + both - BLOCK_N)
            wlive = tl.where(first, col0 + both < OUT, both - BLOCK_N < n)
            acc2 = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + kk
            kmask = ks < K
            xt = tl.load(x + rows[:, None] * stride_x + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if ONE_DOT:
                wt = tl.load(w + wrow[None, :] * stride_w + ks[:, None], mask=wlive[None, :] & kmask[:, None],
                             other=0.0)
                acc2 = tl.dot(xt, wt, acc2, input_precision=PRECISION)
            else:
                wt = tl.load(w + cols[None, :] * stride_w + ks[:, None], mask=cmask[None, :] & kmask[:, None],
                             other=0.0)
                acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
                if R > 0:
                    at = tl.load(w + (OUT + lo + rr)[None, :] * stride_w + ks[:, None],
                                 mask=live[None, :] & kmask[:, None], other=0.0)
                    z = tl.dot(xt, at, z, input_precision=PRECISION)
        if ONE_DOT:  # columns [base | z]: split in two
            acc, z = tl.split(tl.permute(tl.reshape(acc2, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        if HAS_BIAS:
            acc += bv[None, :]
        if R > 0:  # the base rounded as its matmul would round it, then the LoRA term in fp32, the sum rounded once
            acc = tl.dot(z.to(dtype), bt, acc.to(dtype).to(tl.float32), input_precision=PRECISION)
        tl.store(out + rows[:, None] * stride_out + cols[None, :], acc.to(dtype), mask=rmask[:, None] & cmask[None, :])


MAX_RANK = 64  # ranks a program reads (its A and B tiles in shared memory, every pipeline stage)


def rank_spans(ranks: int, blocks: Optional[tuple], block_n: int) -> tuple[list[int], list[int], bool]:
    """The kernel's ``(S1, S2)``, ``(R0, R1, R2)`` and ``PER_LAYER``: each fused layer's own ranks when there are
    two or three layers whose ranks are consecutive from 0 in layer order and whose output boundaries fall on tiles
    of ``block_n`` columns; otherwise every program reads all ``ranks``."""
    if ranks and blocks is not None and 1 < len(blocks) <= 3:
        ends = [end for _, end, _ in blocks][:-1]
        if sum((tuple(rk) for _, _, rk in blocks), ()) == tuple(range(ranks)) and all(e % block_n == 0 for e in ends):
            return (ends + [blocks[-1][1]])[:2], [len(rk) for _, _, rk in blocks] + [0] * (3 - len(blocks)), True
    return [0, 0], [ranks, 0, 0], False


def matmul_launch(rows: int, width: int, outputs: int) -> dict:
    """How :func:`lora_matmul` runs: ``block_m`` rows by ``block_n`` outputs a program, ``block_k`` inputs a step;
    ``one_dot``: the tile's W rows and its A rows as one operand (one dot a step; used where the ranks a program
    reads fit in ``block_n``). With 64 rows on an H100 one dot took 3.51, 2.94, 4.66 and 5.81 us for SmolLM2's
    q/k/v, o, gate/up and down against 3.79, 3.28, 4.86 and 6.41 as two (cuBLAS without adapters: 3.23, 3.15,
    4.38, 5.10; ``benchmarks/results/tune_lora_matmul_h100.json``)."""
    if INTERPRET:
        return {"block_m": 16, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 1, "one_dot": False}
    if rows > 128:
        return {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "one_dot": False}
    # few rows: narrow column tiles, for programs enough to stream the weight (scripts/tune_block_kernels.py)
    return {"block_m": 64 if rows > 32 else 16, "block_n": 32 if outputs >= 2048 else 16,
            "block_k": 128 if width > 1024 else 64, "num_warps": 4, "num_stages": 5, "one_dot": True}


def lora_matmul(x: Tensor, weight: Tensor, bias: Optional[Tensor], up: Optional[Tensor],
                blocks: Optional[tuple] = None, launch: Optional[dict] = None) -> Tensor:
    """``x W^T + b + (x A^T) up`` for ``x`` ``[M, K]``, ``weight`` ``[out + R, K]`` (W's rows, then the adapters'
    A rows), ``bias`` ``[out]`` or ``[out + R]`` (its first ``out`` entries read) or None, ``up`` ``[R, out]`` (the
    scaled, transposed B's) or None. ``blocks``: :attr:`~scgrpo.rollout.projection.Projection.blocks` (each fused
    layer's output columns and rank indices), to read only the ranks of a program's own layer where the tiles
    allow. ``launch``: :func:`matmul_launch`'s keys, to override. Returns ``[M, out]``."""
    if not AVAILABLE:
        raise RuntimeError("lora_matmul needs Triton")
    m, k = x.shape
    r = 0 if up is None else up.shape[0]
    out = weight.shape[0] - r
    if weight.shape[1] != k or out <= 0 or (up is not None and up.shape[1] != out):
        raise ValueError(f"lora_matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)}, up "
                         f"{None if up is None else tuple(up.shape)} (weight [out + R, K], up [R, out])")
    for name, t in (("x", x), ("weight", weight), ("up", up), ("bias", bias)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"lora_matmul needs rows of {name} contiguous")
    launch = {**matmul_launch(m, k, out), **(launch or {})}
    bn = launch["block_n"]
    splits, counts, per_layer = rank_spans(r, blocks, bn)
    if _pow2(max(counts)) > MAX_RANK:
        raise ValueError(f"lora_matmul reads at most {MAX_RANK} ranks a program (got {max(counts)})")
    block_r = _pow2(max(counts))
    one_dot = bool(launch.get("one_dot")) and r > 0 and block_r <= bn
    block_r = bn if one_dot else block_r
    y = torch.empty(m, out, dtype=x.dtype, device=x.device)
    with _device(x):
        _lora_matmul_kernel[(triton.cdiv(m, launch["block_m"]), triton.cdiv(out, bn))](
            x, x.stride(0), weight, weight.stride(0), bias if bias is not None else x,
            up if up is not None else x, up.stride(0) if up is not None else 0, y, y.stride(0), m,
            K=k, OUT=out, R=r, S1=splits[0], S2=splits[1], R0=counts[0], R1=counts[1], R2=counts[2],
            PER_LAYER=per_layer, HAS_BIAS=bias is not None, BLOCK_M=launch["block_m"], BLOCK_N=bn,
            BLOCK_K=min(launch["block_k"], _pow2(k)), BLOCK_R=block_r, ONE_DOT=one_dot,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return y
