"""The decoder block's computation for the compact forward, as functions of plain tensors.

:func:`layer_functions` builds a block's two halves around its attention and :func:`step_functions` a decode
step's compute between attentions, every weight an argument, so that one compiled version serves every layer;
:class:`Layer` holds one block's weights and :class:`LayerArgs` (:class:`AttentionInArgs`,
:class:`AttentionOutArgs`, each projection's :class:`ProjectionArgs`) the order in which those functions take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from scgrpo.rollout.projection import Projection, linear, low_rank


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's Llama RMSNorm, operation for operation (fp32 statistics, weight times the cast input)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add, and :func:`rms_norm` of the sum."""
    x = x + y
    return x, rms_norm(x, weight, eps)


def silu_gate(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``[..., 2 I]`` (gate's columns first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as Hugging Face applies it: x cos + rotate_half(x) sin (``cos``/``sin`` broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class ProjectionArgs(NamedTuple):
    """A projection as the layer functions take it (see :func:`~scgrpo.rollout.projection.linear`): its
    concatenated weight, bias and LoRA ``up``, or, for one that runs its layers' own forwards, the
    :class:`Projection` itself as ``weight`` and two Nones."""

    weight: Union[Tensor, Projection]  # [out + sum r, in]
    bias: Optional[Tensor]  # [out + sum r]
    up: Optional[Tensor]  # [sum r, out]

    @classmethod
    def of(cls, proj: Projection) -> "ProjectionArgs":
        return cls(proj.weight, proj.bias, proj.up) if proj.fused else cls(proj, None, None)


class AttentionInArgs(NamedTuple):
    """A block's weights before its attention, in the order ``attention_in`` and the step functions take them."""

    ln1: Tensor
    qkv_w: Union[Tensor, Projection]
    qkv_b: Optional[Tensor]
    qkv_up: Optional[Tensor]
    q_norm: Optional[Tensor]  # Qwen3's per-head norms; None for the other families
    k_norm: Optional[Tensor]


class AttentionOutArgs(NamedTuple):
    """A block's weights after its attention, in the order ``attention_out`` and the step functions take them."""

    o_w: Union[Tensor, Projection]
    o_b: Optional[Tensor]
    o_up: Optional[Tensor]
    ln2: Tensor
    gu_w: Union[Tensor, Projection]
    gu_b: Optional[Tensor]
    gu_up: Optional[Tensor]
    d_w: Union[Tensor, Projection]
    d_b: Optional[Tensor]
    d_up: Optional[Tensor]


class LayerArgs(NamedTuple):
    """A block's weights as the layer functions take them: the two halves around its attention."""

    attention_in: AttentionInArgs
    attention_out: AttentionOutArgs


@dataclass
class Layer:
    """One decoder block's weights: its norms' and its projections."""

    ln1: Tensor
    qkv: Projection
    q_norm: Optional[Tensor]
    k_norm: Optional[Tensor]
    o: Projection
    ln2: Tensor
    gate_up: Projection
    down: Projection

    def args(self) -> LayerArgs:
        """The weights as the layer functions take them (the projections' current tensors)."""
        return LayerArgs(
            AttentionInArgs(self.ln1, *ProjectionArgs.of(self.qkv), self.q_norm, self.k_norm),
            AttentionOutArgs(*ProjectionArgs.of(self.o), self.ln2, *ProjectionArgs.of(self.gate_up),
                             *ProjectionArgs.of(self.down)),
        )


def layer_functions(heads: int, kv_heads: int, head_dim: int, eps: float, unrolled: bool = False,
                    blocks: Optional[dict] = None):
    """The two halves of a decoder block for one new token per slot, as functions of plain tensors only (every
    weight an argument, the shapes closed over), so that one compiled version serves every layer:

    - ``attention_in(x [S, H], cos, sin [S, D], ln1, qkv_w, qkv_b, qkv_up, q_norm, k_norm)`` -> q
      ``[S, kv, G, D]`` (a kv head's G query heads adjacent), k and v ``[S, kv, D]`` (rotated, normalised);
    - ``attention_out(x, attn [S, kv, G, D], o_w, o_b, o_up, ln2, gu_w, gu_b, gu_up, d_w, d_b, d_up)`` -> the
      block's output ``[S, H]``.
    - ``split_heads(qkv, lead, cos, sin, q_norm, k_norm)``: ``attention_in`` after its projection.

    The cache write and the attention itself run between them, outside any compiled code. ``unrolled``: LoRA's
    low-rank terms as multiply-adds (see :func:`low_rank`), with ``blocks`` (``qkv``, ``o``, ``gate_up``, ``down``,
    ``head``: :attr:`Projection.blocks`, the same in every layer) when given."""
    group = heads // kv_heads
    spans = blocks or {}

    def attention_in(x, cos, sin, ln1, qkv_w, qkv_b, qkv_up, q_norm, k_norm):
        lead = x.shape[:-1]
        qkv = linear(rms_norm(x, ln1, eps), qkv_w, qkv_b, qkv_up, unrolled, spans.get("qkv"))
        return split_heads(qkv, lead, cos, sin, q_norm, k_norm)

    def split_heads(qkv, lead, cos, sin, q_norm, k_norm):
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.reshape(*lead, heads, head_dim)
        k, v = k.reshape(*lead, kv_heads, head_dim), v.reshape(*lead, kv_heads, head_dim)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q.reshape(*lead, kv_heads, group, head_dim), k, v

    def residual(x, y):
        # compiled: x - (-y), exactly x + y, but not matched into a bf16 addmm, whose kernel first copies x into
        # its output (a copy per projection) and adds before rounding (the eager model rounds the matmul first)
        return x - (-y) if unrolled else x + y

    def gate_and_up(h, gu_w, gu_b, gu_up):
        split = spans.get("gate_up")
        if unrolled and gu_up is not None and split is not None and len(split) == 2 and torch.is_tensor(gu_w):
            y = F.linear(h.reshape(-1, h.shape[-1]), gu_w, gu_b)  # each half's LoRA term apart: no cat to write out
            gate, up = low_rank(y, gu_up, True, split, pieces=True)
            return gate.view(*h.shape[:-1], -1), up.view(*h.shape[:-1], -1)
        return linear(h, gu_w, gu_b, gu_up, unrolled, split).chunk(2, dim=-1)

    def attention_out(x, attn, o_w, o_b, o_up, ln2, gu_w, gu_b, gu_up, d_w, d_b, d_up):
        x = residual(x, linear(attn.reshape(*x.shape[:-1], heads * head_dim), o_w, o_b, o_up, unrolled,
                               spans.get("o")))
        gate, up = gate_and_up(rms_norm(x, ln2, eps), gu_w, gu_b, gu_up)
        return residual(x, linear(F.silu(gate) * up, d_w, d_b, d_up, unrolled, spans.get("down")))

    return attention_in, attention_out, split_heads


def step_functions(heads: int, kv_heads: int, head_dim: int, eps: float, fused_attention: bool = False,
                   unrolled: bool = False, blocks: Optional[dict] = None):
    """The decode step's compute between attentions, as functions of tensors (compiled once, reused by every
    layer): ``first(x, cos, sin, *in_args)`` -> a; ``middle(x, attn, *out_args, cos, sin, *in_args)`` -> (x, a), one
    block's end and the next block's start, so that the residual add fuses into the next norm;
    ``last(x, attn, *out_args, norm, head_w, head_b, head_up)`` -> fp32 logits and the final norm's states (what the
    head reads: the policy's final hidden states).

    ``a`` is what the attention reads. For :func:`~scgrpo.rollout.kernels.decode_attention`
    (``fused_attention``): the q/k/v projection's output ``[S, (heads + 2 kv) D]``, rotated in the kernel (or
    here, after q/k norms: Qwen3). For the
    PyTorch attention: (q, kv), ``kv`` ``[2, S, kv, D]`` written into the cache in one indexed store. The cache
    write and the attention stay outside (a compiled function that writes into its input cache would copy it)."""
    attention_in, attention_out, split_heads = layer_functions(heads, kv_heads, head_dim, eps, unrolled, blocks)
    spans = blocks or {}

    def start(x, cos, sin, ln1, qkv_w, qkv_b, qkv_up, q_norm, k_norm):
        if fused_attention:
            qkv = linear(rms_norm(x, ln1, eps), qkv_w, qkv_b, qkv_up, unrolled, spans.get("qkv"))  # [S, (H + 2 kv) D]
            if q_norm is None:
                return qkv  # rotated in the kernel
            q, k, v = split_heads(qkv, x.shape[:-1], cos, sin, q_norm, k_norm)
            return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        q, k, v = attention_in(x, cos, sin, ln1, qkv_w, qkv_b, qkv_up, q_norm, k_norm)
        return q, torch.stack([k, v])

    def first(x, cos, sin, *args_in):
        return start(x, cos, sin, *args_in)

    def middle(x, attn, o_w, o_b, o_up, ln2, gu_w, gu_b, gu_up, d_w, d_b, d_up, cos, sin, *args_in):
        x = attention_out(x, attn, o_w, o_b, o_up, ln2, gu_w, gu_b, gu_up, d_w, d_b, d_up)
        return x, start(x, cos, sin, *args_in)

    def last(x, attn, o_w, o_b, o_up, ln2, gu_w, gu_b, gu_up, d_w, d_b, d_up, norm, head_w, head_b, head_up):
        x = attention_out(x, attn, o_w, o_b, o_up, ln2, gu_w, gu_b, gu_up, d_w, d_b, d_up)
        h = rms_norm(x, norm, eps)
        return linear(h, head_w, head_b, head_up, unrolled, spans.get("head")).float(), h

    return first, middle, last
