"""Triton kernels for the decode step's work between matmuls, with LoRA's low-rank terms inside them.

With these the decode step of a Llama-family block is eight launches: the add-and-norm before attention, the
q/k/v matmul, attention (:mod:`scgrpo.rollout.kernels`), the output projection, the add-and-norm before the MLP,
the gate/up matmul, the gated activation, the down projection (the prefill runs the same kernels over its
positions). Every projection's weight carries its adapters' A rows after its own
(:class:`~scgrpo.rollout.projection.Projection`). For few rows an adapted projection whose input is not too wide is
one launch with its LoRA term inside (:mod:`scgrpo.rollout.lora_matmul`; the add-and-norms and the gated
activation left without LoRA terms are then ``torch.compile``'d, see
:class:`~scgrpo.rollout.compact.CompactDecoder`); otherwise the matmul's output is ``[x W^T | z]`` with
``z = x A^T``, and ``z (s B)^T`` is added where the output is read anyway: by :func:`add_norm` for the attention
output and down (before the residual add), by :func:`silu_mul` for gate/up; for q/k/v by :func:`lora_add`, a
ninth launch, before attention (inside the attention kernel, whose programs each take one row, every row would
read its own copy of the B's). The B products of many rows at once are tensor-core dots. :func:`scaled_copy`
copies the adapters into the projections' buffers before each rollout, in one launch.

The arithmetic, in the model dtype with fp32 statistics and accumulation: the base output is rounded by the
matmul, its LoRA term added in fp32 and the sum rounded once (as peft does with fp32 adapters); the add-and-norm
then rounds as Hugging Face's Llama model does (the residual sum, the normalised input, the norm's output; on an
H100 in bf16 its ``x + y`` and ``h`` are bit-identical to PyTorch doing the same operations). The LoRA terms
differ from the trainer's by roundings: A and s B are copied in the model dtype (peft keeps them in fp32) and
``z`` is rounded to it. The sampler-vs-trainer log-probability gap this leaves is measured in
``benchmarks/results/gpu_checks_<card>.json``.

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
    def _add_norm_kernel(
        x, stride_x,  # [M, D] residual stream
        y, stride_y,  # [M, D + R] the last projection's output (HAS_Y): base columns, then its adapters' z
        up, stride_up,  # [R, D] their scaled B^T
        w,  # [D] norm weight
        x_out, stride_xo,  # [M, D] x + y (HAS_Y)
        h_out, stride_h,  # [M, D] the normed input
        M, eps,
        D: tl.constexpr, R: tl.constexpr, HAS_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program i: rows i * BLOCK_M ... one after another, each whole in registers; LoRA's term as multiply-adds,
        a rank at a time (the B rows stay in the multiprocessor's cache for the program's next rows)."""
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        dtype = h_out.dtype.element_ty
        wv = tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            row = tl.program_id(0) * BLOCK_M + i
            live = row < M
            m1 = cmask & live
            xv = tl.load(x + row * stride_x + cols, mask=m1, other=0.0).to(tl.float32)
            if HAS_Y:
                t = tl.load(y + row * stride_y + cols, mask=m1, other=0.0).to(tl.float32)
                for j in tl.static_range(R):
                    zj = tl.load(y + row * stride_y + D + j, mask=live, other=0.0).to(tl.float32)
                    t += zj * tl.load(up + j * stride_up + cols, mask=cmask, other=0.0).to(tl.float32)
                xv = (xv + t.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                tl.store(x_out + row * stride_xo + cols, xv.to(dtype), mask=m1)
            rstd = tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
            h = (wv * (xv * rstd).to(dtype).to(tl.float32)).to(dtype)
            tl.store(h_out + row * stride_h + cols, h, mask=m1)

    @triton.jit
    def _silu_mul_kernel(
        gu, stride_gu,  # [M, 2 I + RG + RU]: gate, up, then the adapters' z (gate's ranks, then up's)
        lora, stride_lora,  # [RG + RU, 2 I] their scaled B^T, block-diagonal
        out, stride_out,  # [M, I]
        M,
        I: tl.constexpr, RG: tl.constexpr, RU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
        BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program (i, j): rows i * BLOCK_M ... by columns j * BLOCK ... (16 rows or more with LoRA terms, whose
        products are tensor-core dots)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < M
        cmask = cols < I
        mask = rmask[:, None] & cmask[None, :]
        dtype = out.dtype.element_ty
        at = gu + rows[:, None] * stride_gu + cols[None, :]
        g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(at + I, mask=mask, other=0.0).to(tl.float32)
        if RG + RU > 0:  # the LoRA terms as tensor-core dots, summed with the base in fp32 and rounded once
            rr = tl.arange(0, BLOCK_R)
            z_at = gu + rows[:, None] * stride_gu + 2 * I + rr[None, :]
            b_at = lora + rr[:, None] * stride_lora + cols[None, :]
            if RG > 0:
                zg = tl.load(z_at, mask=rmask[:, None] & (rr[None, :] < RG), other=0.0)  # [BM, BR]
                bg = tl.load(b_at, mask=(rr[:, None] < RG) & cmask[None, :], other=0.0)  # [BR, BLOCK]
                g = tl.dot(zg, bg, g, input_precision=PRECISION)
            if RU > 0:
                zu = tl.load(z_at + RG, mask=rmask[:, None] & (rr[None, :] < RU), other=0.0)
                bu = tl.load(b_at + RG * stride_lora + I, mask=(rr[:, None] < RU) & cmask[None, :], other=0.0)
                u = tl.dot(zu, bu, u, input_precision=PRECISION)
            g, u = g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # silu, rounded as the model's activation is
        tl.store(out + rows[:, None] * stride_out + cols[None, :], (act * u).to(dtype), mask=mask)

    @triton.jit
    def _lora_add_kernel(
        y, stride_y,  # [M, OUT + R]: a projection's base output, then its adapters' z; the first OUT columns updated
        up, stride_up,  # [R, OUT] their scaled B^T
        M,
        OUT: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Program (i, j): rows i * BLOCK_M ... by columns j * BLOCK ...: ``y + z up`` as a tensor-core dot into the
        fp32 base, rounded once, written over the base."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        rr = tl.arange(0, BLOCK_R)
        rmask, cmask = rows < M, cols < OUT
        at = y + rows[:, None] * stride_y + cols[None, :]
        mask = rmask[:, None] & cmask[None, :]
        base = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(y + rows[:, None] * stride_y + OUT + rr[None, :], mask=rmask[:, None] & (rr[None, :] < R), other=0.0)
        b = tl.load(up + rr[:, None] * stride_up + cols[None, :], mask=(rr[:, None] < R) & cmask[None, :], other=0.0)
        tl.store(at, tl.dot(z, b, base, input_precision=PRECISION).to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def _scaled_copy_kernel(table, scales, src_like, dst_like, BLOCK: tl.constexpr):
        """Program (i, j): elements ``j BLOCK ...`` (row-major) of copy i, ``dst[a, b] = scale_i src[a, b]`` in
        fp32, rounded once. Table row i: source and destination addresses, rows, columns, both tensors' strides."""
        entry = table + tl.program_id(0) * 8
        cols = tl.load(entry + 3)
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = e < tl.load(entry + 2) * cols
        a, b = e // cols, e % cols
        src = tl.load(entry).to(tl.pointer_type(src_like.dtype.element_ty))
        dst = tl.load(entry + 1).to(tl.pointer_type(dst_like.dtype.element_ty))
        v = tl.load(src + a * tl.load(entry + 4) + b * tl.load(entry + 5), mask=live, other=0.0).to(tl.float32)
        v = v * tl.load(scales + tl.program_id(0))
        tl.store(dst + a * tl.load(entry + 6) + b * tl.load(entry + 7), v.to(dst_like.dtype.element_ty), mask=live)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def norm_launch(rows: int, width: int, ranks: int) -> dict:
    """How :func:`add_norm` runs: ``block_m`` rows a program, one after another, ``num_warps`` warps."""
    if INTERPRET:  # (the CPU interpreter runs programs one after another)
        return {"block_m": 4, "num_warps": 4}
    return {"block_m": 1, "num_warps": 4 if rows > 128 else 8}


def add_norm(x: Tensor, y: Optional[Tensor], up: Optional[Tensor], weight: Tensor, eps: float,
             launch: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """The residual add and RMSNorm between projections, with the last projection's LoRA term.

    ``x`` ``[M, D]``: the residual stream. ``y`` ``[M, D + r]`` or None: the last projection's output (base
    columns, then its adapters' ``z``), added to ``x`` with ``z up`` (``up`` ``[r, D]``, None when ``r`` is 0).
    ``weight`` ``[D]``: the norm's. Returns ``(x + y's sum, norm(x + ...))``; with ``y`` None the first is ``x``.
    ``launch``: :func:`norm_launch`'s keys, to override."""
    if not AVAILABLE:
        raise RuntimeError("add_norm needs Triton")
    m, d = x.shape
    r = 0 if up is None else up.shape[0]
    if y is None and up is not None:
        raise ValueError("add_norm: `up` without `y` (the ranks' z come from y's last columns)")
    if y is not None and (y.shape[0] != m or y.shape[1] != d + r):
        raise ValueError(f"add_norm: y {tuple(y.shape)} for x {tuple(x.shape)} and {r} ranks")
    for name, t in (("x", x), ("y", y), ("up", up)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"add_norm needs rows of {name} contiguous")
    x_out = torch.empty_like(x) if y is not None else x
    h = torch.empty_like(x)
    launch = {**norm_launch(m, d, r), **(launch or {})}
    ref = y if y is not None else x
    with _device(x):
        _add_norm_kernel[(triton.cdiv(m, launch["block_m"]),)](
            x, x.stride(0), ref, ref.stride(0), up if up is not None else x, up.stride(0) if up is not None else 0,
            weight, x_out, x_out.stride(0), h, h.stride(0), m, eps,
            D=d, R=r, HAS_Y=y is not None, BLOCK_M=launch["block_m"], BLOCK_D=_pow2(d),
            num_warps=launch["num_warps"])
    return x_out, h


def silu_launch(rows: int, ranks: int) -> dict:
    """How :func:`silu_mul` runs: ``block_m`` rows by ``block`` columns a program (``block_m`` 16 or more with
    LoRA terms)."""
    if not ranks:
        return {"block_m": 1, "block": 1024, "num_warps": 4}
    return {"block_m": 16, "block": 64, "num_warps": 8 if rows <= 128 else 4}


def silu_mul(gate_up: Tensor, up: Optional[Tensor] = None, ranks: tuple[int, int] = (0, 0),
             launch: Optional[dict] = None) -> Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[M, 2 I]`` (gate columns first), rounded as the model rounds.

    With LoRA's terms still to add, ``gate_up`` ``[M, 2 I + R]`` ends with the adapters' ``z``, ``up``
    ``[R, 2 I]`` holds their scaled, transposed B's and ``ranks`` says how many of the R are gate's and up's.
    ``launch``: :func:`silu_launch`'s keys, to override."""
    if not AVAILABLE:
        raise RuntimeError("silu_mul needs Triton")
    m, width = gate_up.shape
    r = sum(ranks)
    inner = (width - r) // 2
    if gate_up.stride(-1) != 1 or width != 2 * inner + r or (r > 0) != (up is not None) or (
            up is not None and (tuple(up.shape) != (r, 2 * inner) or up.stride(-1) != 1)):
        raise ValueError(f"silu_mul needs [M, 2 I + R] with contiguous rows and up [R, 2 I] (got {tuple(gate_up.shape)}"
                         f", {None if up is None else tuple(up.shape)}, ranks {tuple(ranks)})")
    out = torch.empty(m, inner, dtype=gate_up.dtype, device=gate_up.device)
    launch = {**silu_launch(m, r), **(launch or {})}
    block = min(launch["block"], _pow2(inner))
    if r and launch["block_m"] < 16:
        raise ValueError(f"silu_mul with LoRA terms takes 16 rows a program or more (got {launch['block_m']})")
    with _device(gate_up):
        _silu_mul_kernel[(triton.cdiv(m, launch["block_m"]), triton.cdiv(inner, block))](
            gate_up, gate_up.stride(0), up if up is not None else gate_up, up.stride(0) if up is not None else 0,
            out, out.stride(0), m, I=inner, RG=ranks[0], RU=ranks[1], BLOCK_M=launch["block_m"], BLOCK=block,
            BLOCK_R=_pow2(max(ranks)), PRECISION="ieee" if gate_up.dtype == torch.float32 else "tf32",
            num_warps=launch["num_warps"])
    return out


def lora_add(y: Tensor, up: Tensor, launch: Optional[dict] = None) -> Tensor:
    """Adds a projection's LoRA term in place: ``y[:, :out] += y[:, out:] up`` for ``y`` ``[M, out + R]`` (the
    matmul's output with the adapters' A rows: base columns, then ``z``) and ``up`` ``[R, out]`` (their scaled,
    transposed B's), the sum taken in fp32 and rounded once. Returns ``y``. ``launch``: ``block_m`` (16 or
    more), ``block``, ``num_warps``."""
    if not AVAILABLE:
        raise RuntimeError("lora_add needs Triton")
    m, width = y.shape
    r, out = up.shape
    if width != out + r or y.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"lora_add needs y [M, out + R] and up [R, out] with contiguous rows (got {tuple(y.shape)}, "
                         f"{tuple(up.shape)})")
    launch = {"block_m": 16, "block": 64, "num_warps": 4, **(launch or {})}
    block = min(launch["block"], _pow2(out))
    with _device(y):
        _lora_add_kernel[(triton.cdiv(m, launch["block_m"]), triton.cdiv(out, block))](
            y, y.stride(0), up, up.stride(0), m, OUT=out, R=r, BLOCK_M=launch["block_m"], BLOCK=block,
            BLOCK_R=_pow2(r), PRECISION="ieee" if y.dtype == torch.float32 else "tf32", num_warps=launch["num_warps"])
    return y


def scaled_copy(copies: list[tuple[Tensor, Tensor, float]], block: int = 1024, tables: Optional[dict] = None) -> None:
    """``dst.copy_(scale * src)`` for each ``(dst, src, scale)`` of 2-D tensors on one device, any strides, as
    one launch per pair of dtypes (a refresh copies hundreds of adapter matrices, many into transposed views,
    which PyTorch's multi-tensor copy would launch one by one). The product is taken in fp32 and rounded once
    to ``dst``'s dtype. ``tables``: kept between calls, it holds each launch's table of addresses, shapes and
    strides, reused while the tensors' addresses, the sources' shapes and strides and the scales are the same
    (a caller whose destinations may change shape or strides at the same address clears it)."""
    if not AVAILABLE:
        raise RuntimeError("scaled_copy needs Triton")
    groups: dict = {}
    for entry in copies:
        if entry[0].numel():
            groups.setdefault((entry[1].dtype, entry[0].dtype), []).append(entry)
    for dtypes, group in groups.items():
        dsts, srcs, scales = zip(*group)
        key = (tuple(map(Tensor.data_ptr, srcs)), tuple(map(Tensor.data_ptr, dsts)), tuple(map(Tensor.size, srcs)),
               tuple(map(Tensor.stride, srcs)), scales)
        found = None if tables is None else tables.get(dtypes)
        if found is None or found[0] != key:
            device = dsts[0].device
            for dst, src in zip(dsts, srcs):
                if dst.dim() != 2 or dst.shape != src.shape or dst.device != device or src.device != device:
                    raise ValueError(f"scaled_copy: {tuple(src.shape)} on {src.device} into {tuple(dst.shape)} on "
                                     f"{dst.device} (2-D, same shape, one device)")
            table = torch.tensor([(s.data_ptr(), d.data_ptr(), *d.shape, *s.stride(), *d.stride())
                                  for d, s in zip(dsts, srcs)], dtype=torch.int64).to(device)
            found = (key, table, torch.tensor(scales, dtype=torch.float32).to(device), max(d.numel() for d in dsts))
            if tables is not None:
                tables[dtypes] = found
        _, table, scale_t, most = found
        with _device(dsts[0]):
            _scaled_copy_kernel[(len(group), triton.cdiv(most, block))](table, scale_t, srcs[0], dsts[0], BLOCK=block)
