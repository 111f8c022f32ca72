"""Triton kernels for the decode step's work between matmuls, with LoRA's low-rank terms inside them.

With these the decode step of a Llama-family block is eight launches, adapters or not: the add-and-norm before
attention, the q/k/v matmul, attention (:mod:`scgrpo.rollout.kernels`), the output projection, the add-and-norm
before the MLP, the gate/up matmul, the gated activation, the down projection. Unmerged LoRA rides in them:

- a projection whose input a norm makes (q/k/v, gate/up) gets its adapters' down-projections ``z = h A^T`` from
  :func:`add_norm` (``h`` and ``z`` written side by side, ``[h | z]``) and its up-projections as extra input
  columns of its weight, ``[W | s B]``: the matmul computes ``h W^T + z (s B)^T`` at once;
- a projection whose output a residual add reads (attention output, down) has its A rows appended to its weight
  (the matmul's output is ``[h W^T | z]``) and :func:`add_norm` adds ``z (s B)^T`` before the residual add.

The arithmetic, in the model dtype with fp32 statistics and accumulation: the add-and-norm rounds as Hugging
Face's Llama model does (the residual sum, the normalised input, the norm's output; on an H100 in bf16 its
``x + y`` and ``h`` are bit-identical to PyTorch doing the same operations). The LoRA terms differ from the
trainer's by roundings: the adapters' A and s B are copied in the model dtype (peft keeps them in fp32 and
computes the term in fp32), ``z`` is rounded to it, and for q/k/v and gate/up the base and LoRA products are
summed before one rounding (the trainer rounds the base output first). The sampler-vs-trainer log-probability
gap this leaves is measured in ``benchmarks/results/gpu_checks_<card>.json``.

Available where Triton is (GPUs); ``TRITON_INTERPRET=1`` runs them on CPU tensors.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.kernels import AVAILABLE, INTERPRET

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_norm_rows_kernel(
        x, stride_x,  # [M, D] residual stream
        y, stride_y,  # [M, D + R_IN] the last projection's output (HAS_Y): base columns, then z
        up, stride_up,  # [R_IN, D] its scaled B^T
        w,  # [D] norm weight
        a, stride_a,  # [R_OUT, D] the next projection's A rows
        x_out, stride_xo,  # [M, D] x + y (HAS_Y)
        h_out, stride_h,  # [M, D + R_OUT]: the normed input, then its z
        M, eps,
        D: tl.constexpr, R_IN: tl.constexpr, R_OUT: tl.constexpr, HAS_Y: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_RO: tl.constexpr,
    ):
        """Program (i, j): rows i * BLOCK_M ... one after another, each whole in registers, and ranks j * BLOCK_RO
        ... of ``z`` (each of a row's programs adds and norms the row; the first stores it). The LoRA products are
        multiply-adds: a rank at a time in, a [ranks, columns] product reduced over the columns out."""
        first = tl.program_id(1) == 0
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        ro = tl.program_id(1) * BLOCK_RO + tl.arange(0, BLOCK_RO)
        dtype = h_out.dtype.element_ty
        wv = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            row = tl.program_id(0) * BLOCK_M + i
            live = row < M
            m1 = cmask & live
            xv = tl.load(x + row * stride_x + cols, mask=m1, other=0.0).to(tl.float32)
            if HAS_Y:
                t = tl.load(y + row * stride_y + cols, mask=m1, other=0.0).to(tl.float32)
                if R_IN > 0:
                    lora = tl.zeros([BLOCK_D], tl.float32)
                    for j in tl.static_range(R_IN):
                        zj = tl.load(y + row * stride_y + D + j, mask=live, other=0.0).to(tl.float32)
                        lora += zj * tl.load(up + j * stride_up + cols, mask=cmask, other=0.0).to(tl.float32)
                    t = (t + lora.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                xv = (xv + t).to(dtype).to(tl.float32)
                tl.store(x_out + row * stride_xo + cols, xv.to(dtype), mask=m1 & first)
            rstd = tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
            h = (wv * (xv * rstd).to(dtype).to(tl.float32)).to(dtype)
            tl.store(h_out + row * stride_h + cols, h, mask=m1 & first)
            if R_OUT > 0:
                av = tl.load(a + ro[:, None] * stride_a + cols[None, :], mask=(ro[:, None] < R_OUT) & cmask[None, :],
                             other=0.0).to(tl.float32)  # [BRO, BD]
                z = tl.sum(av * h.to(tl.float32)[None, :], axis=1)
                tl.store(h_out + row * stride_h + D + ro, z.to(dtype), mask=(ro < R_OUT) & live)

    @triton.jit
    def _add_norm_tiles_kernel(
        x, stride_x, y, stride_y, up, stride_up, w, a, stride_a, x_out, stride_xo, h_out, stride_h,
        M, eps,
        D: tl.constexpr, R_IN: tl.constexpr, R_OUT: tl.constexpr, HAS_Y: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_RI: tl.constexpr, BLOCK_RO: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Program (i, j): sixteen or more rows (arguments as above) in column steps of two passes (the sums, then
        the norm), and ranks j * BLOCK_RO ... of ``z``; the LoRA products as tensor-core dots, so each program reads
        the adapters once for all its rows. Every program of a row block stores the same x_out and h and reads
        back its own stores."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        kk = tl.arange(0, BLOCK_K)
        dtype = h_out.dtype.element_ty
        sq = tl.zeros([BLOCK_M], tl.float32)
        ri = tl.arange(0, BLOCK_RI)
        if R_IN > 0:
            z = tl.load(y + rows[:, None] * stride_y + D + ri[None, :], mask=rmask[:, None] & (ri[None, :] < R_IN),
                        other=0.0)  # [BM, BRI]
        for k0 in tl.static_range(0, D, BLOCK_K):  # pass 1: x + (base + z B) into x_out; the sum of squares
            cols = k0 + kk
            m2 = rmask[:, None] & (cols[None, :] < D)
            xv = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_Y:
                t = tl.load(y + rows[:, None] * stride_y + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                if R_IN > 0:
                    u = tl.load(up + ri[:, None] * stride_up + cols[None, :],
                                mask=(ri[:, None] < R_IN) & (cols[None, :] < D), other=0.0)  # [BRI, BK]
                    lora = tl.dot(z, u, input_precision=PRECISION)
                    t = (t + lora.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                xv = (xv + t).to(dtype).to(tl.float32)
                tl.store(x_out + rows[:, None] * stride_xo + cols[None, :], xv.to(dtype), mask=m2)
            sq += tl.sum(xv * xv, axis=1)
        rstd = tl.rsqrt(sq / D + eps)
        if HAS_Y:
            tl.debug_barrier()  # pass 2 reads what other threads of the program stored
        ro = tl.program_id(1) * BLOCK_RO + tl.arange(0, BLOCK_RO)
        zacc = tl.zeros([BLOCK_M, BLOCK_RO], tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_K):  # pass 2: h = w * round(x rstd) into h_out; z = h A^T
            cols = k0 + kk
            cmask = cols < D
            m2 = rmask[:, None] & cmask[None, :]
            if HAS_Y:
                xv = tl.load(x_out + rows[:, None] * stride_xo + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            else:
                xv = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            wv = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
            h = (wv[None, :] * (xv * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
            tl.store(h_out + rows[:, None] * stride_h + cols[None, :], h, mask=m2)
            if R_OUT > 0:
                av = tl.load(a + ro[:, None] * stride_a + cols[None, :], mask=(ro[:, None] < R_OUT) & cmask[None, :],
                             other=0.0)  # [BRO, BK]
                zacc = tl.dot(h, tl.trans(av), zacc, input_precision=PRECISION)
        if R_OUT > 0:
            tl.store(h_out + rows[:, None] * stride_h + D + ro[None, :], zacc.to(dtype),
                     mask=rmask[:, None] & (ro[None, :] < R_OUT))

    @triton.jit
    def _silu_mul_kernel(gu, stride_gu, out, stride_out, I: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        dtype = out.dtype.element_ty
        g = tl.load(gu + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # silu, rounded as the model's activation is
        tl.store(out + row * stride_out + cols, (act * u).to(dtype), mask=mask)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def norm_launch(rows: int, width: int, ranks: int) -> dict:
    """How :func:`add_norm` runs. ``block_m`` 16 or more: the tiles kernel, ``block_m`` rows a program in column
    steps of ``block_k``, the LoRA products as tensor-core dots (each program reads the adapters once for its
    rows). Below 16: the rows kernel, ``block_m`` rows a program one after another and ``block_r`` of ``z``'s
    ranks (a row's ``z`` split over programs: more multiprocessors busy, fewer adapter rows each)."""
    if INTERPRET:  # (the CPU interpreter runs programs one after another)
        return {"block_m": 16, "block_k": 256, "block_r": 16, "num_warps": 4}
    # scripts/tune_add_norm.py on an H100, SmolLM2-135M's width (576), 16 ranks in and 48 (q/k/v) or 32 (gate/up)
    # out; other widths are not tuned
    if ranks and width > 1024:  # the rows kernel would hold [block_r, width] products in registers
        return {"block_m": 16, "block_k": 256, "block_r": 32, "num_warps": 4}
    if rows > 128 and ranks > 32:  # 512 rows, q/k/v: 8.3 us, the rows kernel's best 11.2
        return {"block_m": 16, "block_k": 256, "block_r": 32, "num_warps": 4}
    if rows > 128 and ranks:  # 512 rows, gate/up: 7.5 us, the tiles kernel's best 8.2
        return {"block_m": 2, "block_k": 0, "block_r": 32, "num_warps": 4}
    if rows > 128:  # no ranks out: a plain add and norm, 1.8 us at 512 rows
        return {"block_m": 1, "block_k": 0, "block_r": 16, "num_warps": 4}
    # 64 rows: q/k/v's 48 ranks in halves (3.4 us), gate/up's 32 in 16s (3.1 us); no ranks 1.6 us
    return {"block_m": 1, "block_k": 0, "block_r": 32 if ranks > 32 else 16, "num_warps": 8}


def add_norm(x: Tensor, y: Optional[Tensor], up: Optional[Tensor], weight: Tensor, eps: float,
             a: Optional[Tensor] = None, launch: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """The residual add and RMSNorm between projections, with LoRA terms (see the module docstring).

    ``x`` ``[M, D]``: the residual stream. ``y`` ``[M, D + r]`` or None: the last projection's output (base
    columns, then its adapters' ``z``), added to ``x`` with ``z up`` (``up`` ``[r, D]``, None when ``r`` is 0).
    ``weight`` ``[D]``: the norm's. ``a`` ``[R, D]`` or None: the next projection's A rows.
    Returns ``(x + y's sum, [norm(x + ...) | z])``, the second ``[M, D + R]``; with ``y`` None the first is ``x``.
    ``launch``: :func:`norm_launch`'s keys, to override."""
    if not AVAILABLE:
        raise RuntimeError("add_norm needs Triton")
    m, d = x.shape
    r_in = 0 if up is None else up.shape[0]
    r_out = 0 if a is None else a.shape[0]
    if y is None and up is not None:
        raise ValueError("add_norm: `up` without `y` (the ranks' z come from y's last columns)")
    if y is not None and (y.shape[0] != m or y.shape[1] != d + r_in):
        raise ValueError(f"add_norm: y {tuple(y.shape)} for x {tuple(x.shape)} and {r_in} ranks")
    for name, t in (("x", x), ("y", y), ("up", up), ("a", a)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"add_norm needs rows of {name} contiguous")
    x_out = torch.empty_like(x) if y is not None else x
    h = torch.empty(m, d + r_out, dtype=x.dtype, device=x.device)
    launch = {**norm_launch(m, d, r_out), **(launch or {})}
    block_m = launch["block_m"]
    ref = y if y is not None else x
    args = (x, x.stride(0), ref, ref.stride(0), up if up is not None else x, up.stride(0) if up is not None else 0,
            weight, a if a is not None else x, a.stride(0) if a is not None else 0,
            x_out, x_out.stride(0), h, h.stride(0), m, eps)
    shape = dict(D=d, R_IN=r_in, R_OUT=r_out, HAS_Y=y is not None, BLOCK_M=block_m, num_warps=launch["num_warps"])
    with _device(x):
        if block_m >= 16:
            block_r = min(_pow2(launch["block_r"]), _pow2(r_out))
            _add_norm_tiles_kernel[(triton.cdiv(m, block_m), triton.cdiv(r_out, block_r) if r_out else 1)](
                *args, **shape, BLOCK_K=launch["block_k"], BLOCK_RI=_pow2(r_in), BLOCK_RO=block_r,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
        else:
            block_r = min(_pow2(launch["block_r"], 1), _pow2(r_out, 1))
            _add_norm_rows_kernel[(triton.cdiv(m, block_m), triton.cdiv(r_out, block_r) if r_out else 1)](
                *args, **shape, BLOCK_D=_pow2(d), BLOCK_RO=block_r)
    return x_out, h


def silu_mul(gate_up: Tensor, block: int = 1024) -> Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[M, 2 I]`` (gate columns first), rounded as the model rounds."""
    if not AVAILABLE:
        raise RuntimeError("silu_mul needs Triton")
    m, width = gate_up.shape
    inner = width // 2
    if gate_up.stride(-1) != 1 or width != 2 * inner:
        raise ValueError(f"silu_mul needs [M, 2 I] with contiguous rows (got {tuple(gate_up.shape)})")
    out = torch.empty(m, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, _pow2(inner))
    with _device(gate_up):
        _silu_mul_kernel[(m, triton.cdiv(inner, block))](gate_up, gate_up.stride(0), out, out.stride(0), I=inner,
                                                         BLOCK=block, num_warps=4)
    return out
