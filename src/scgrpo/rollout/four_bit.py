"""A 4-bit (bitsandbytes nf4/fp4) base weight in the compact decoder, dequantized by bitsandbytes' own kernel.

QLoRA trains through ``bnb.matmul_4bit``, which (for more than one row) dequantizes the packed weight with
bitsandbytes' blockwise kernel into the compute dtype and multiplies by the result. The decoder does the same
dequantization, so it samples with exactly the values the trainer multiplies by (no second quantisation):

- **resident**: once per rollout, into the projection's concatenated bf16 weight (2 bytes a weight for the
  rollout's length; the plain-weight decode path then runs unchanged: block kernels, LoRA inside the matmuls,
  CUDA graphs);
- **streamed**: in every decode step, one whole weight at a time (:data:`STREAM_CHUNK`) into one scratch buffer
  that the next matmul reads (the largest weight's size in all, ~100 MB for an 8B model, instead of 2 bytes a
  weight). The double-quantised block scales are expanded to fp32 once per workspace, as bitsandbytes
  expands them before each dequantization.

Both are recorded in the decode step's CUDA graph like any other kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# weights dequantized at a time by a streamed projection: whole weights (on an H100, 8B shape, 64 rows: 20.4 ms a
# decode step, against 23.4 ms in runs of 8M weights sized for the L2 cache; scripts/bench_step.py --suite qwen8b,
# benchmarks/results/bench_qwen8b_sampling_dequant_h100.json)
MODES = ("auto", "resident", "streamed", "layers")
"""GenerationSettings.four_bit's values (see scgrpo.rollout.engine)"""
STREAM_CHUNK = 1 << 30
STREAM_KERNEL = "fused"
"""How a streamed projection multiplies: "fused" (:mod:`scgrpo.rollout.nf4_matmul`: the codes read inside the
matmul, for a projection's weights when it takes them all and inputs of up to :data:`FUSED_ROWS` rows; others
are dequantized) or "dequantize" (bitsandbytes' kernel into the scratch, then a matmul). On an H200 (64 rows, Qwen3-8B's
shapes) sampling takes 11.88 ms a decode step fused against 18.02 ms dequantizing
(benchmarks/results/bench_qwen8b_sampling_nf4_rowmajor_h200.json)"""
FUSED_ROWS = 64
"""The most rows of an input the fused kernel multiplies (a decode step's): a prefill's many rows go to cuBLAS on
the dequantized weight, which reads each weight once for them all, where the kernel reads it once a block of 64
rows and sums its runs of a row through fp32 partials"""


def resident_fits(copy: int, left: int, kept: bool = False) -> bool:
    """Whether a float copy of the 4-bit base (``copy`` bytes) may be made for sampling: at most half of the memory
    ``left`` when it is freed after each rollout (the rest is for the KV cache), a quarter when it is ``kept``
    through the update with the KV cache (which takes up to another quarter by default)."""
    return copy <= (0.25 if kept else 0.5) * left


def four_bit_state(weight) -> Optional[object]:
    """The bitsandbytes ``QuantState`` of a quantized 4-bit 2-D weight (``Params4bit``), else None."""
    state = getattr(weight, "quant_state", None)
    if state is None or getattr(state, "quant_type", None) not in ("nf4", "fp4"):
        return None
    shape = getattr(state, "shape", None)
    if shape is None or len(shape) != 2:
        return None
    return state


def cpu_packed(state) -> bool:
    """Whether ``state`` is in bitsandbytes' CPU inference layout: on a CPU with AVX512-BF16, ``Linear4bit``'s
    first forward in eval mode without gradients (bitsandbytes 0.50) repacks its weight for a bf16 gemm
    (``bitsandbytes.functional._convert_weight_packed_for_cpu``): the codes interleaved in blocks of 32 rows, the
    scales as bf16 ``[K / blocksize, N]``, ``nested`` off and ``dtype`` bf16 (the original in ``original_dtype``).
    It is never made on CUDA (``Params4bit.cuda`` undoes it)."""
    return bool(getattr(state, "packing_format_for_cpu", False))


def state_dtype(state) -> torch.dtype:
    """The float dtype ``state`` dequantizes to (the one it had before a CPU repacking, see :func:`cpu_packed`)."""
    return getattr(state, "original_dtype", state.dtype) if cpu_packed(state) else state.dtype


def unpack_cpu_layout(data: Tensor, rows: int, cols: int, block_n: int = 32) -> Tensor:
    """The flat packed bytes (two codes a byte, the high nibble first, row-major) of a weight in bitsandbytes' CPU
    layout (:func:`cpu_packed`): ``data`` ``[N, K / 2]`` holds, for each ``block_n`` rows and each pair of columns,
    the ``block_n`` first codes of the pairs in the low nibbles and the second in the high ones."""
    packed = data.reshape(-1, block_n)
    pairs = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # [N / B * K / 2, 2B]: (row in block, pair slot)
    codes = pairs.reshape(rows // block_n, cols // 2, block_n, 2).transpose(1, 2).reshape(-1)  # row-major
    return (codes[0::2] << 4) | codes[1::2]


def block_scales(state) -> Tensor:
    """The fp32 per-block scales of ``state``, computed as ``bitsandbytes.functional.dequantize_4bit`` computes
    them (double quantisation: the 8-bit scales dequantized blockwise, plus the offset); for a weight in
    bitsandbytes' CPU layout, the bf16 scales its CPU kernel multiplies by, in the flat blocks' order."""
    if cpu_packed(state):
        return state.absmax.t().float().reshape(-1)  # (K is a multiple of the blocksize there: whole blocks a row)
    if not getattr(state, "nested", False):
        return state.absmax.float()
    from bitsandbytes.functional import dequantize_blockwise

    absmax = dequantize_blockwise(state.absmax, state.state2)
    absmax += state.offset
    return absmax.float()


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
        self.dtype = state_dtype(state)
        packed = weight.data.reshape(-1)  # the packed bytes, whatever word type stores them (a view, made once)
        packed = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
        # (a weight that bitsandbytes repacked for its CPU gemm: its flat bytes, a copy, on the CPU only)
        self.cpu_layout = cpu_packed(state)  # (its scales are laid out for that gemm too)
        self.packed = unpack_cpu_layout(packed, self.rows, self.cols) if self.cpu_layout else packed
        self.scales: Optional[Tensor] = None

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

    def into(self, out: Tensor, start: int = 0, end: Optional[int] = None) -> Tensor:
        """Rows ``[start, end)`` of the weight, dequantized into ``out`` (contiguous, ``[end - start, K]``, the
        state's dtype). ``start`` and ``end - start`` must be multiples of :meth:`row_step` (or the whole)."""
        end = self.rows if end is None else end
        self.prepare()
        lo, hi = start * self.cols, end * self.cols
        part = self.packed[lo // 2 : hi // 2].unsqueeze(1)
        scales = self.scales[lo // self.blocksize : -(-hi // self.blocksize)]
        shape = (end - start, self.cols)
        op = torch.ops.bitsandbytes.dequantize_4bit
        if out.device.type == "cuda":  # (the kernel reads flat blocks over out.numel() weights; shape is out's)
            op.out(part, scales, self.blocksize, self.quant_type, shape, self.dtype, out=out)
        else:  # (bitsandbytes registers the in-place variant for CUDA only.) The run as one flat row: given
            # ``(m, n)``, bitsandbytes' CPU kernel on a CPU with AVX-512 (0.50) reads ``n / blocksize`` blocks a
            # row, not the flat blocks its quantizer wrote, wrong where a row is not whole blocks
            flat = op.default(part, scales, self.blocksize, self.quant_type, (shape[0] * shape[1],), self.dtype)
            out.copy_(flat.view(shape))
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
    contiguous block), the adapters' down-projections ``lora_a`` ``[R, K]`` after them. With :data:`STREAM_KERNEL`
    "fused", at most :data:`FUSED_ROWS` rows and every weight one the fused kernel takes, each is multiplied by it
    instead, into columns of the row-major output (no scratch, no transposed copy)."""
    m = x.shape[0]
    out = sum(d.rows for d in dequantizers)
    rank = 0 if lora_a is None else lora_a.shape[0]
    if STREAM_KERNEL == "fused" and m <= FUSED_ROWS:
        from scgrpo.rollout.nf4_matmul import nf4_matmul_t, supported

        if all(supported(d, x.device) for d in dequantizers):  # (the output row-major as the kernel writes it)
            y = torch.empty(m, out + rank, dtype=x.dtype, device=x.device)
            at = 0
            for d in dequantizers:
                nf4_matmul_t(x, d, y[:, at : at + d.rows].t())
                at += d.rows
            if rank:
                y[:, out:].copy_(torch.mm(x, lora_a.t()))
            return y if bias is None else y.add_(bias)
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
