"""A 4-bit (bitsandbytes nf4/fp4) base weight in the compact decoder, dequantized by bitsandbytes' own kernel.

QLoRA trains through ``bnb.matmul_4bit``, which (for more than one row) dequantizes the packed weight with
bitsandbytes' blockwise kernel into the compute dtype and multiplies by the result. The decoder does the same
dequantization, so it samples with exactly the values the trainer multiplies by (no second quantisation):

- **resident**: once per rollout, into the projection's concatenated bf16 weight (2 bytes a weight for the
  rollout's length; the plain-weight decode path then runs unchanged: block kernels, LoRA inside the matmuls,
  CUDA graphs);
- **streamed**: in every decode step, a few million weights at a time into one scratch buffer that each matmul
  reads while it is still in the GPU's L2 cache (a few tens of MB of scratch in all, instead of 2 bytes a
  weight). The double-quantised block scales are expanded to fp32 once per workspace, as bitsandbytes
  expands them before each dequantization.

Both are recorded in the decode step's CUDA graph like any other kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.kernels import AVAILABLE
from scgrpo.rollout.kernels import usable as triton_usable

# weights dequantized at a time by a streamed projection whose rows the nf4 kernel does not take (prefills, fp4):
# whole weights (on an H100, 8B shape, 64 rows: 20.4 ms a decode step, against 23.4 ms in runs of 8M weights
# sized for the L2 cache: scripts/bench_step.py --suite qwen8b, benchmarks/results/bench_qwen8b_sampling_h100.json)
STREAM_CHUNK = 1 << 30
# rows up to which a streamed nf4 projection is the fused kernel below (decode steps); above, dequantize + cuBLAS
NF4_KERNEL_ROWS = 128
# the kernel's tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) for every width when set; see nf4_launch
NF4_TILES: Optional[tuple] = None

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _nf4_matmul_kernel(
        x, stride_x,  # [M, K] in the model dtype
        packed,  # [N * K / 2] bytes: element 2j of the flattened weight in byte j's high nibble, 2j + 1 in its low
        scales,  # [N * K / BLOCKSIZE] fp32 block scales
        code,  # [16] fp32: the 4-bit code's values
        bias,  # [N] (HAS_BIAS)
        out, stride_out,  # [M, N] (a column slice of a wider output: row stride stride_out)
        M, N,
        K: tl.constexpr, BLOCKSIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (j, i): outputs j * BLOCK_N ... of rows i * BLOCK_M .... Each weight is dequantized as
        bitsandbytes does, the code value times the block's fp32 scale rounded once to the model dtype, and
        multiplied by x's even and odd columns apart (two dots, no interleaving)."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        half = tl.arange(0, BLOCK_K // 2)
        rmask, cmask = rows < M, cols < N
        dtype = out.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            even = k0 + 2 * half  # [BK/2]
            byte = tl.load(packed + cols[:, None] * (K // 2) + (k0 // 2 + half)[None, :], mask=cmask[:, None], other=0)
            scale = tl.load(scales + cols[:, None] * (K // BLOCKSIZE) + (even // BLOCKSIZE)[None, :],
                            mask=cmask[:, None], other=0.0)
            w_even = (tl.load(code + ((byte >> 4) & 15).to(tl.int32)) * scale).to(dtype)  # [BN, BK/2]
            w_odd = (tl.load(code + (byte & 15).to(tl.int32)) * scale).to(dtype)
            x_even = tl.load(x + rows[:, None] * stride_x + even[None, :], mask=rmask[:, None], other=0.0)
            x_odd = tl.load(x + rows[:, None] * stride_x + (even + 1)[None, :], mask=rmask[:, None], other=0.0)
            acc = tl.dot(x_even, tl.trans(w_even), acc)
            acc = tl.dot(x_odd, tl.trans(w_odd), acc)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out + rows[:, None] * stride_out + cols[None, :], acc.to(dtype), mask=rmask[:, None] & cmask[None, :])


def nf4_launch(rows: int, n: int, k: int) -> Optional[dict]:
    """The kernel's tiles for ``rows`` x ``k`` inputs and ``n`` outputs, or None where it does not run (``k`` not a
    multiple of a tile)."""
    block_n, block_k, warps, stages = NF4_TILES or (32 if n <= 8192 else 64, 256, 4, 3)
    while block_k > 32 and k % block_k:
        block_k //= 2
    if k % block_k:
        return None
    block_m = max(16, min(64, 1 << max(0, (rows - 1).bit_length())))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def resident_fits(copy: int, left: int) -> bool:
    """Whether a float copy of the 4-bit base (``copy`` bytes) may be kept while sampling: at most half of the
    memory ``left`` (the rest is for the KV cache)."""
    return copy <= 0.5 * left


def four_bit_state(weight) -> Optional[object]:
    """The bitsandbytes ``QuantState`` of a quantized 4-bit 2-D weight (``Params4bit``), else None."""
    state = getattr(weight, "quant_state", None)
    if state is None or getattr(state, "quant_type", None) not in ("nf4", "fp4"):
        return None
    shape = getattr(state, "shape", None)
    if shape is None or len(shape) != 2:
        return None
    return state


def block_scales(state) -> Tensor:
    """The fp32 per-block scales of ``state``, computed as ``bitsandbytes.functional.dequantize_4bit`` computes
    them (double quantisation: the 8-bit scales dequantized blockwise, plus the offset)."""
    if not getattr(state, "nested", False):
        return state.absmax.float()
    from bitsandbytes.functional import dequantize_blockwise

    absmax = dequantize_blockwise(state.absmax, state.state2)
    absmax += state.offset
    return absmax.float()


_CODES: dict = {}


def code_table(quant_type: str, device: torch.device) -> Tensor:
    """The 16 fp32 values of a 4-bit code (bitsandbytes' own table), one copy per device."""
    key = (quant_type, str(device))
    if key not in _CODES:
        from bitsandbytes.functional import get_4bit_type

        _CODES[key] = get_4bit_type(quant_type, device=device).float().contiguous()
    return _CODES[key]


class Dequantizer:
    """Rows of one 4-bit weight ``[N, K]`` into a float buffer, with bitsandbytes' kernel. ``scales`` (fp32
    block scales) are computed by :meth:`prepare` and dropped by :meth:`release`."""

    def __init__(self, weight) -> None:
        state = four_bit_state(weight)
        if state is None:
            raise ValueError("not a quantized 4-bit weight")
        self.weight = weight
        self.state = state
        self.rows, self.cols = (int(d) for d in state.shape)
        self.blocksize = int(state.blocksize)
        self.quant_type = state.quant_type
        self.dtype = state.dtype
        self.scales: Optional[Tensor] = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def row_aligned(self, rows: int) -> bool:
        """Whether a run of ``rows`` whole rows starts on a block and a byte boundary."""
        return (rows * self.cols) % self.blocksize == 0 and (rows * self.cols) % 2 == 0

    def row_step(self) -> int:
        """The fewest rows whose runs start on block and byte boundaries (``rows`` if none)."""
        for step in range(1, self.rows + 1):
            if self.row_aligned(step):
                return step
        return self.rows

    def prepare(self) -> None:
        if self.scales is None:
            self.scales = block_scales(self.state)

    def release(self) -> None:
        self.scales = None

    def kernel_runs(self, rows: int) -> bool:
        """Whether :meth:`matmul_into` takes ``rows`` rows (nf4, whole blocks per weight row, Triton's device)."""
        return (self.quant_type == "nf4" and rows <= NF4_KERNEL_ROWS and self.cols % self.blocksize == 0
                and self.cols % 2 == 0 and triton_usable(self.weight.device)
                and nf4_launch(rows, self.rows, self.cols) is not None)

    def matmul_into(self, x: Tensor, out: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """``x W^T (+ bias)`` into ``out`` ``[M, N]`` (rows contiguous; a column slice is fine) with the fused
        kernel: the weight dequantized tile by tile as :meth:`into` would, never written out."""
        self.prepare()
        packed = self.weight.data.reshape(-1)
        if packed.dtype != torch.uint8:
            packed = packed.view(torch.uint8)
        m = x.shape[0]
        launch = nf4_launch(m, self.rows, self.cols)
        grid = (triton.cdiv(self.rows, launch["BLOCK_N"]), triton.cdiv(m, launch["BLOCK_M"]))
        code = code_table(self.quant_type, x.device)
        _nf4_matmul_kernel[grid](x, x.stride(0), packed, self.scales, code, bias if bias is not None else x,
                                 out, out.stride(0), m, self.rows, K=self.cols, BLOCKSIZE=self.blocksize,
                                 HAS_BIAS=bias is not None, **launch)
        return out

    def into(self, out: Tensor, start: int = 0, end: Optional[int] = None) -> Tensor:
        """Rows ``[start, end)`` of the weight, dequantized into ``out`` (contiguous, ``[end - start, K]``, the
        state's dtype). ``start`` and ``end - start`` must be multiples of :meth:`row_step` (or the whole)."""
        end = self.rows if end is None else end
        self.prepare()
        packed = self.weight.data.reshape(-1)
        if packed.dtype != torch.uint8:
            packed = packed.view(torch.uint8)
        lo, hi = start * self.cols, end * self.cols
        part = packed[lo // 2 : hi // 2].unsqueeze(1)
        scales = self.scales[lo // self.blocksize : -(-hi // self.blocksize)]
        shape = (end - start, self.cols)
        op = torch.ops.bitsandbytes.dequantize_4bit
        if out.device.type == "cuda":
            op.out(part, scales, self.blocksize, self.quant_type, shape, self.dtype, out=out)
        else:  # (bitsandbytes registers the in-place variant for CUDA only)
            out.copy_(op.default(part, scales, self.blocksize, self.quant_type, shape, self.dtype).reshape(shape))
        return out


def chunk_plan(dequantizers: list[Dequantizer], chunk: int) -> list[tuple[int, int, int, int]]:
    """(weight index, first row, end row, output row) runs of at most ``chunk`` weights each (at least
    :meth:`Dequantizer.row_step` rows), covering every weight's rows in order."""
    plan = []
    offset = 0
    for i, d in enumerate(dequantizers):
        step = d.row_step()
        rows = max(step, (chunk // max(d.cols, 1)) // step * step)
        for start in range(0, d.rows, rows):
            end = min(d.rows, start + rows)
            plan.append((i, start, end, offset + start))
        offset += d.rows
    return plan


def streamed_matmul(x: Tensor, dequantizers: list[Dequantizer], plan: list[tuple[int, int, int, int]],
                    scratch: Tensor, lora_a: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """``[x W_1^T | ... | x W_k^T | x A^T] (+ bias)`` for ``x`` ``[M, K]``: each run of ``plan`` dequantized into
    ``scratch`` and multiplied at once (``W x^T`` into rows of the transposed output, so every run writes a
    contiguous block), the adapters' down-projections ``lora_a`` ``[R, K]`` after them."""
    m = x.shape[0]
    out = sum(d.rows for d in dequantizers)
    rank = 0 if lora_a is None else lora_a.shape[0]
    if all(d.kernel_runs(m) for d in dequantizers):  # decode steps: nf4 tiles dequantized inside the matmul
        x = x.contiguous()
        y = torch.empty(m, out + rank, dtype=x.dtype, device=x.device)
        at = 0
        for d in dequantizers:
            d.matmul_into(x, y[:, at : at + d.rows], None if bias is None else bias[at : at + d.rows])
            at += d.rows
        if rank:
            y[:, out:] = x @ lora_a.t() if bias is None else torch.addmm(bias[out:], x, lora_a.t())
        return y
    y_t = torch.empty(out + rank, m, dtype=x.dtype, device=x.device)
    x_t = x.t()
    cols = dequantizers[0].cols
    for i, start, end, at in plan:
        w = scratch[: (end - start) * cols].view(end - start, cols)
        dequantizers[i].into(w, start, end)
        torch.mm(w, x_t, out=y_t[at : at + end - start])
    if rank:
        torch.mm(lora_a, x_t, out=y_t[out:])
    if bias is None:
        return y_t.t().contiguous()
    return torch.add(y_t.t(), bias, out=torch.empty(m, out + rank, dtype=x.dtype, device=x.device))  # (row-major)
