"""A Triton kernel for the decode step's attention: one new token per slot, grouped key/value heads.

:func:`decode_attention` does, in one launch per layer, what the step otherwise spends five on (rotary
positions of q and k, the cache write, the mask, attention, the output's layout): each program takes one slot
and one key/value head, rotates the new q (its G query heads) and k from the projection's raw output, writes
k and v into the cache at the slot's position, and attends over the slot's own cache entries only (a loop
bounded by its length, not by a padded length with a mask), with an online softmax in fp32.

The arithmetic: the projection's output is rounded to the cache dtype, q and k are rotated in fp32 and rounded
once (the Hugging Face model rounds after each bf16 operation: bf16 greedy decodes agree a little less often,
fp32 ones token for token), scores and the softmax are fp32, the probabilities are rounded to the cache dtype
for the value product (as flash attention does), the output accumulates in fp32.

Available where Triton is (GPUs); :data:`AVAILABLE` says so. ``TRITON_INTERPRET=1`` runs it on CPU tensors.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager path serves
    triton = None

AVAILABLE = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def usable(device: torch.device) -> bool:
    return AVAILABLE and (device.type == "cuda" or INTERPRET)


def supports(head_dim: int) -> bool:
    """Head sizes the kernel takes: powers of two from 32 to 256 (it works on halves of a head)."""
    return 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


if AVAILABLE:

    @triton.jit
    def _decode_attention_kernel(
        qkv, stride_qkv,  # [S, (H + 2 KV) D]
        cos, sin, stride_rope,  # [Lmax, D]
        lens,  # [S] int64: the new token's position = entries already in the slot's cache
        cache, stride_ckv, stride_cs, stride_ch, stride_cl,  # one layer: [2, S, KV, Lmax, D], last stride 1
        out, stride_out,  # [S, H D]
        scale,
        partial_ml, partial_acc, arrived,  # SPLITS > 1: [S KV SPLITS, 2, BG], [S KV SPLITS, BG, D] fp32, [S KV] int32
        G: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
        ROTATE: tl.constexpr, PRECISION: tl.constexpr, STOP: tl.constexpr,
    ):
        s = tl.program_id(0)
        g = tl.program_id(1)
        j = tl.program_id(2)  # which part of the row's entries (SPLITS > 1); part 0 holds the new token
        pos = tl.load(lens + s)
        gi = tl.arange(0, BLOCK_G)
        d1 = tl.arange(0, HALF)
        gmask = gi < G
        heads = g * G + gi  # this kv head's query heads
        q_col = heads[:, None] * D + d1[None, :]  # [BG, HALF]: first halves
        k_col = (KV * G + g) * D + d1  # [HALF]
        v_col = (KV * G + KV + g) * D + d1
        row = qkv + s * stride_qkv
        q1 = tl.load(row + q_col, mask=gmask[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(row + q_col + HALF, mask=gmask[:, None], other=0.0).to(tl.float32)
        k1 = tl.load(row + k_col).to(tl.float32)
        k2 = tl.load(row + k_col + HALF).to(tl.float32)
        v1 = tl.load(row + v_col).to(tl.float32)
        v2 = tl.load(row + v_col + HALF).to(tl.float32)
        dtype = cache.dtype.element_ty
        # the projection's output is rounded to the model dtype before anything else reads it
        q1, q2 = q1.to(dtype).to(tl.float32), q2.to(dtype).to(tl.float32)
        k1, k2 = k1.to(dtype).to(tl.float32), k2.to(dtype).to(tl.float32)
        if ROTATE:  # x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
            c1 = tl.load(cos + pos * stride_rope + d1).to(tl.float32)
            c2 = tl.load(cos + pos * stride_rope + d1 + HALF).to(tl.float32)
            s1 = tl.load(sin + pos * stride_rope + d1).to(tl.float32)
            s2 = tl.load(sin + pos * stride_rope + d1 + HALF).to(tl.float32)
            q1, q2 = q1 * c1[None, :] - q2 * s1[None, :], q2 * c2[None, :] + q1 * s2[None, :]
            k1, k2 = k1 * c1 - k2 * s1, k2 * c2 + k1 * s2
        q1, q2 = q1.to(dtype), q2.to(dtype)
        k1, k2 = k1.to(dtype), k2.to(dtype)
        v1, v2 = v1.to(dtype), v2.to(dtype)
        base_k = cache + s * stride_cs + g * stride_ch
        base_v = base_k + stride_ckv
        first = j == 0
        tl.store(base_k + pos * stride_cl + d1, k1, mask=first & (d1 < HALF))
        tl.store(base_k + pos * stride_cl + d1 + HALF, k2, mask=first & (d1 < HALF))
        tl.store(base_v + pos * stride_cl + d1, v1, mask=first & (d1 < HALF))
        tl.store(base_v + pos * stride_cl + d1 + HALF, v2, mask=first & (d1 < HALF))
        # the new token itself, from registers (its cache entry is not read back), in part 0's sums
        own = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
               + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)) * scale  # [BG]
        m = tl.where(first, own, float("-inf"))
        l = tl.where(first, tl.full([BLOCK_G], 1.0, tl.float32), 0.0)
        weight = tl.where(first, 1.0, 0.0)
        acc1 = tl.zeros([BLOCK_G, HALF], tl.float32) + weight * v1.to(tl.float32)[None, :]
        acc2 = tl.zeros([BLOCK_G, HALF], tl.float32) + weight * v2.to(tl.float32)[None, :]
        if SPLITS == 1:
            lo, hi = 0, pos
        else:  # part j: entries [lo, hi), parts of whole blocks
            part = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_N) * BLOCK_N
            lo = j * part
            hi = tl.minimum(lo + part, pos)
        n_off = tl.arange(0, BLOCK_N)
        # a fixed bound where Triton's CPU interpreter runs it (it cannot loop to a loaded value)
        for start in range(lo if STOP == 0 else 0, hi if STOP == 0 else STOP, BLOCK_N):
            n = start + n_off
            nmask = (n >= lo) & (n < hi)
            at = n[:, None] * stride_cl + d1[None, :]
            kb1 = tl.load(base_k + at, mask=nmask[:, None], other=0.0)
            kb2 = tl.load(base_k + at + HALF, mask=nmask[:, None], other=0.0)
            scores = (tl.dot(q1, tl.trans(kb1), input_precision=PRECISION)
                      + tl.dot(q2, tl.trans(kb2), input_precision=PRECISION)) * scale  # [BG, BN]
            scores = tl.where(nmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no (-inf) - (-inf)
            alpha = tl.exp(m - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            vb1 = tl.load(base_v + at, mask=nmask[:, None], other=0.0)
            vb2 = tl.load(base_v + at + HALF, mask=nmask[:, None], other=0.0)
            pd = p.to(dtype)
            acc1 = acc1 * alpha[:, None] + tl.dot(pd, vb1, input_precision=PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(pd, vb2, input_precision=PRECISION)
            m = m_new
        o_col = heads[:, None] * D + d1[None, :]
        o_row = out + s * stride_out
        if SPLITS == 1:
            tl.store(o_row + o_col, (acc1 / l[:, None]).to(out.dtype.element_ty), mask=gmask[:, None])
            tl.store(o_row + o_col + HALF, (acc2 / l[:, None]).to(out.dtype.element_ty), mask=gmask[:, None])
        else:  # each part leaves its (max, sum, weighted values); the last to arrive merges them
            pair = s * KV + g
            at_ml = partial_ml + (pair * SPLITS + j) * 2 * BLOCK_G + gi
            tl.store(at_ml, m)
            tl.store(at_ml + BLOCK_G, l)
            at_acc = partial_acc + (pair * SPLITS + j) * BLOCK_G * D + gi[:, None] * D + d1[None, :]
            tl.store(at_acc, acc1)
            tl.store(at_acc + HALF, acc2)
            tl.debug_barrier()  # every thread's stores before the arrival is counted
            if tl.atomic_add(arrived + pair, 1, sem="acq_rel") == SPLITS - 1:
                big = tl.full([BLOCK_G], float("-inf"), tl.float32)
                for i in tl.static_range(SPLITS):
                    big = tl.maximum(big, tl.load(partial_ml + (pair * SPLITS + i) * 2 * BLOCK_G + gi,
                                                  cache_modifier=".cg"))
                total = tl.zeros([BLOCK_G], tl.float32)
                sum1 = tl.zeros([BLOCK_G, HALF], tl.float32)
                sum2 = tl.zeros([BLOCK_G, HALF], tl.float32)
                for i in tl.static_range(SPLITS):
                    at_i = partial_ml + (pair * SPLITS + i) * 2 * BLOCK_G + gi
                    factor = tl.exp(tl.load(at_i, cache_modifier=".cg") - big)  # an empty part: exp(-inf) = 0
                    total += factor * tl.load(at_i + BLOCK_G, cache_modifier=".cg")
                    acc_i = partial_acc + (pair * SPLITS + i) * BLOCK_G * D + gi[:, None] * D + d1[None, :]
                    sum1 += factor[:, None] * tl.load(acc_i, cache_modifier=".cg")
                    sum2 += factor[:, None] * tl.load(acc_i + HALF, cache_modifier=".cg")
                tl.store(o_row + o_col, (sum1 / total[:, None]).to(out.dtype.element_ty), mask=gmask[:, None])
                tl.store(o_row + o_col + HALF, (sum2 / total[:, None]).to(out.dtype.element_ty), mask=gmask[:, None])
                tl.atomic_xchg(arrived + pair, 0)  # ready for the next layer's launch


    @triton.jit
    def _prefill_attention_kernel(
        qkv, stride_qkv,  # [N T, (H + 2 KV) D]: row r's position p at r T + p
        cos, sin, stride_rope,  # [Lmax, D]
        lengths,  # [N] int64: real tokens of each row (the rest are padding)
        slots,  # [N] int64: each row's cache slot
        cache, stride_ckv, stride_cs, stride_ch, stride_cl,  # one layer: [2, S, KV, Lmax, D], last stride 1
        out, stride_out,  # [N T, H D]
        scale, T,
        G: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, H: tl.constexpr, KV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, STOP: tl.constexpr,
    ):
        r = tl.program_id(0)
        h = tl.program_id(1)
        mb = tl.program_id(2)
        g = h // G
        length = tl.load(lengths + r)
        slot = tl.load(slots + r)
        d1 = tl.arange(0, HALF)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query positions
        m_in = m < T
        rows = qkv + (r * T) * stride_qkv
        dtype = cache.dtype.element_ty
        q_at = m[:, None] * stride_qkv + h * D + d1[None, :]
        q1 = tl.load(rows + q_at, mask=m_in[:, None], other=0.0).to(dtype).to(tl.float32)
        q2 = tl.load(rows + q_at + HALF, mask=m_in[:, None], other=0.0).to(dtype).to(tl.float32)
        rope_m = m[:, None] * stride_rope + d1[None, :]
        c1 = tl.load(cos + rope_m, mask=m_in[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(cos + rope_m + HALF, mask=m_in[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(sin + rope_m, mask=m_in[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(sin + rope_m + HALF, mask=m_in[:, None], other=0.0).to(tl.float32)
        q1, q2 = (q1 * c1 - q2 * s1).to(dtype), (q2 * c2 + q1 * s2).to(dtype)
        k_col = (H + g) * D + d1
        v_col = (H + KV + g) * D + d1
        base_k = cache + slot * stride_cs + g * stride_ch
        base_v = base_k + stride_ckv
        if h % G == 0:  # the kv head's first query head writes its block's keys (rotated) and values
            w = (m_in & (m < length))[:, None]  # (a padding position's are never read: not written)
            at = m[:, None] * stride_qkv
            k1 = tl.load(rows + at + k_col[None, :], mask=m_in[:, None], other=0.0).to(dtype).to(tl.float32)
            k2 = tl.load(rows + at + k_col[None, :] + HALF, mask=m_in[:, None], other=0.0).to(dtype).to(tl.float32)
            k1, k2 = (k1 * c1 - k2 * s1).to(dtype), (k2 * c2 + k1 * s2).to(dtype)
            c_at = m[:, None] * stride_cl + d1[None, :]
            tl.store(base_k + c_at, k1, mask=w)
            tl.store(base_k + c_at + HALF, k2, mask=w)
            tl.store(base_v + c_at, tl.load(rows + at + v_col[None, :], mask=w).to(dtype), mask=w)
            tl.store(base_v + c_at + HALF, tl.load(rows + at + v_col[None, :] + HALF, mask=w).to(dtype), mask=w)
        # keys past the row's length are padding: never loaded (a query there attends to the real tokens only)
        hi = tl.minimum(tl.minimum((mb + 1) * BLOCK_M, T), length)
        mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc2 = tl.zeros([BLOCK_M, HALF], tl.float32)
        n_off = tl.arange(0, BLOCK_N)
        # a fixed bound where Triton's CPU interpreter runs it (it cannot loop to a loaded value)
        for start in range(0, hi if STOP == 0 else STOP, BLOCK_N):
            n = start + n_off
            n_in = n < hi
            at = n[:, None] * stride_qkv
            rope_n = n[:, None] * stride_rope + d1[None, :]
            kc1 = tl.load(cos + rope_n, mask=n_in[:, None], other=0.0).to(tl.float32)
            kc2 = tl.load(cos + rope_n + HALF, mask=n_in[:, None], other=0.0).to(tl.float32)
            ks1 = tl.load(sin + rope_n, mask=n_in[:, None], other=0.0).to(tl.float32)
            ks2 = tl.load(sin + rope_n + HALF, mask=n_in[:, None], other=0.0).to(tl.float32)
            kb1 = tl.load(rows + at + k_col[None, :], mask=n_in[:, None], other=0.0).to(dtype).to(tl.float32)
            kb2 = tl.load(rows + at + k_col[None, :] + HALF, mask=n_in[:, None], other=0.0).to(dtype).to(tl.float32)
            kb1, kb2 = (kb1 * kc1 - kb2 * ks1).to(dtype), (kb2 * kc2 + kb1 * ks2).to(dtype)
            scores = (tl.dot(q1, tl.trans(kb1), input_precision=PRECISION)
                      + tl.dot(q2, tl.trans(kb2), input_precision=PRECISION)) * scale  # [BM, BN]
            visible = n_in[None, :] & (n[None, :] <= m[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(mx, tl.max(scores, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no (-inf) - (-inf)
            alpha = tl.exp(mx - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            vb1 = tl.load(rows + at + v_col[None, :], mask=n_in[:, None], other=0.0).to(dtype)
            vb2 = tl.load(rows + at + v_col[None, :] + HALF, mask=n_in[:, None], other=0.0).to(dtype)
            pd = p.to(dtype)
            acc1 = acc1 * alpha[:, None] + tl.dot(pd, vb1, input_precision=PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(pd, vb2, input_precision=PRECISION)
            mx = m_new
        l = tl.where(l == 0.0, 1.0, l)  # a row of no tokens (a padding row): zeros
        o_at = out + (r * T + m[:, None]) * stride_out + h * D + d1[None, :]
        tl.store(o_at, (acc1 / l[:, None]).to(out.dtype.element_ty), mask=m_in[:, None])
        tl.store(o_at + HALF, (acc2 / l[:, None]).to(out.dtype.element_ty), mask=m_in[:, None])


def default_launch(programs: int, cache_len: int) -> dict:
    """Keys/values per loop iteration, warps per program, pipelining stages, parts per row: the fastest of
    ``scripts/tune_decode_attention.py`` on an H100 (many short rows: small blocks and programs; long rows:
    long blocks; few long rows: each row's entries split over several programs, so that every multiprocessor
    streams part of the cache)."""
    if programs >= 1024:
        return {"block_n": 32, "num_warps": 2, "num_stages": 2, "splits": 1}
    if cache_len >= 512 and programs <= 256:  # Qwen2.5-1.5B shape, 32 rows: 11.0 us unsplit, 9.4 us in 8 parts
        return {"block_n": 32, "num_warps": 2, "num_stages": 2, "splits": min(8, max(2, 512 // programs))}
    return {"block_n": 128 if cache_len >= 512 else 64, "num_warps": 4, "num_stages": 2, "splits": 1}


def _split_buffers(device: torch.device, pairs: int, splits: int, block_g: int, dim: int,
                   kept: Optional[dict] = None):
    """Scratch for the parts' partial results and the per-(slot, head) arrival counters, which the merging
    program sets back to zero: allocated once per shape into ``kept`` (the caller's, e.g. a decoder's), outside any
    CUDA graph capture (a capture's own allocation is not kept, and its zero fill is recorded in the graph)."""
    key = (device, pairs, splits, block_g, dim)
    if kept is not None and key in kept:
        return kept[key]
    buffers = (torch.empty(pairs * splits * 2 * block_g, dtype=torch.float32, device=device),
               torch.empty(pairs * splits * block_g * dim, dtype=torch.float32, device=device),
               torch.zeros(pairs, dtype=torch.int32, device=device))
    if kept is not None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        kept[key] = buffers
    return buffers


def decode_attention(qkv: Tensor, lens: Tensor, cache: Tensor, cos: Tensor, sin: Tensor, heads: int, scale: float,
                     rotate: bool = True, launch: Optional[dict] = None, scratch: Optional[dict] = None) -> Tensor:
    """Attention of one new token per slot; returns ``[S, heads * D]``.

    ``qkv`` ``[S, (heads + 2 kv) D]``: the projection's output, LoRA's term included (q, k, v; q and k rotated
    here when ``rotate``, else already rotated; any row stride).
    ``lens`` ``[S]``: each slot's position (its cache entries before this token). ``cache`` ``[2, S, kv, Lmax, D]``
    (one layer): k and v are written at ``lens``, which must be below ``Lmax`` (not checked: a GPU-side check
    would synchronise; the slot decoder clamps). ``cos``/``sin`` ``[Lmax, D]``. ``scratch``: where a split launch's
    partial results are kept between calls (a decoder's; None: allocated for this call)."""
    s = qkv.shape[0]
    _, _, kv, _, dim = cache.shape
    group = heads // kv
    if not supports(dim) or cache.stride(-1) != 1 or qkv.stride(-1) != 1:
        raise ValueError(f"decode_attention needs contiguous head dims, a power of two from 32 to 256 (got {dim})")
    out = torch.empty(s, heads * dim, dtype=cache.dtype, device=cache.device)
    launch = {**default_launch(s * kv, cache.shape[3]), **(launch or {})}
    splits, block_g = launch.get("splits", 1), max(16, triton.next_power_of_2(group))
    partial_ml, partial_acc, arrived = (_split_buffers(cache.device, s * kv, splits, block_g, dim, scratch) if splits > 1
                                        else (out, out, out))
    with torch.cuda.device(cache.device) if cache.device.type == "cuda" else contextlib.nullcontext():
        _decode_attention_kernel[(s, kv, splits)](
            qkv, qkv.stride(0),
            cos, sin, cos.stride(0), lens,
            cache, cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            out, out.stride(0), scale, partial_ml, partial_acc, arrived,
            G=group, KV=kv, D=dim, HALF=dim // 2, BLOCK_G=block_g,
            BLOCK_N=launch["block_n"], SPLITS=splits, ROTATE=rotate, PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
            STOP=cache.shape[3] if cache.device.type == "cpu" else 0, num_warps=launch["num_warps"],
            num_stages=launch["num_stages"],
        )
    return out


PREFILL_BLOCK = 64
"""Query and key positions per program and per loop iteration of :func:`prefill_attention`"""


def prefill_attention(qkv: Tensor, lengths: Tensor, slots: Tensor, cache: Tensor, cos: Tensor, sin: Tensor,
                      heads: int, scale: float, block: int = PREFILL_BLOCK) -> Tensor:
    """Causal attention of whole prompts from position 0, in one launch per layer; returns ``[N T, heads * D]``.

    ``qkv`` ``[N T, (heads + 2 kv) D]``: the projection's output for ``N`` right-padded prompts of ``T``
    positions (row ``r``'s position ``p`` at ``r T + p``; any row stride), LoRA's term included; q and k are
    rotated here, as :func:`decode_attention` does (in fp32, rounded once). ``lengths`` ``[N]``: each prompt's
    real tokens; keys past them are neither read nor written, so a padding position's output is finite but
    meaningless, and a row of length 0 (padding a batch to a recorded shape) writes nothing and outputs zeros.
    ``slots`` ``[N]``: the cache slots whose first ``lengths`` positions receive the rotated keys and the values.
    ``cache`` ``[2, S, kv, Lmax, D]`` (one layer, ``Lmax >= T``); ``cos``/``sin`` ``[Lmax, D]``."""
    _, _, kv, lmax, dim = cache.shape
    n = lengths.shape[0]
    t = qkv.shape[0] // max(n, 1)
    if not supports(dim) or cache.stride(-1) != 1 or qkv.stride(-1) != 1 or n * t != qkv.shape[0] or t > lmax:
        raise ValueError(f"prefill_attention needs [N T, ...] rows, T <= the cache length and contiguous head dims, "
                         f"a power of two from 32 to 256 (got {tuple(qkv.shape)} for {n} rows, D {dim}, cache {lmax})")
    out = torch.empty(n * t, heads * dim, dtype=cache.dtype, device=cache.device)
    with torch.cuda.device(cache.device) if cache.device.type == "cuda" else contextlib.nullcontext():
        _prefill_attention_kernel[(n, heads, triton.cdiv(t, block))](
            qkv, qkv.stride(0), cos, sin, cos.stride(0), lengths, slots,
            cache, cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            out, out.stride(0), scale, t,
            G=heads // kv, D=dim, HALF=dim // 2, H=heads, KV=kv, BLOCK_M=block, BLOCK_N=block,
            PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
            STOP=t if cache.device.type == "cpu" else 0, num_warps=4, num_stages=2,
        )
    return out
