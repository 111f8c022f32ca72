"""A compact forward pass for decoding, over a Hugging Face Llama-family model's own weights.

Llama, Mistral, Qwen2, Qwen3 and SmolLM (a Llama) share one decoder block: RMSNorm, attention with rotary
positions and grouped key/value heads (Qwen2 adds q/k/v biases, Qwen3 RMS-normalises q and k per head), a
SiLU-gated MLP. :class:`CompactDecoder` runs that block with

- the q/k/v projections as one matmul and gate/up as one (the weights concatenated once and kept while the
  base weights do not change),
- LoRA unmerged, as low-rank adds: the adapters' down-projections ride in the same matmul as the base weight
  (their rows appended to it), their up-projections are a block-diagonal matmul added on (compiled:
  multiply-adds, fused into the kernel that reads the projection where the compiler can). On a GPU, with compile
  on, adapters, plain float weights and no q/k norms, the step between matmuls is instead
  :mod:`scgrpo.rollout.norms`' Triton kernels, which add the up-projections where they read each matmul's
  output, or, for few rows and inputs up to 1024 wide, :mod:`scgrpo.rollout.lora_matmul`'s projections with the
  whole LoRA term inside (the prefill uses those block kernels wherever they run). Sampling thus runs the policy being trained, not a rounded
  merge of it (the adapters are held in the model dtype: see :mod:`scgrpo.rollout.norms` for the roundings),
- its own KV cache ``[layers, 2, slots, kv_heads, length, head_dim]`` in which every row starts at index 0 (no
  left padding): a row's position is its cache length. On a GPU one Triton kernel per layer
  (:mod:`scgrpo.rollout.kernels`) rotates q and k, writes the cache and attends over each row's own entries;
  elsewhere PyTorch's attention reads the first ``L`` entries (``L`` a bucket of the longest live row),
  masking each row at its own length.

Nothing here is tied to a fixed batch or length: :mod:`scgrpo.rollout.slots` records the decode step as a CUDA
graph per slot count (and, for PyTorch attention, per length bucket). Models it cannot run exactly (another block, sliding windows that a run can
reach, dynamic RoPE, DoRA, sharded weights) are reported by :func:`unsupported_reason` and decoded through the
Hugging Face forward instead. A 4-bit (bitsandbytes) base is dequantized with bitsandbytes' own kernel, once per
rollout or inside each step (:mod:`scgrpo.rollout.four_bit`), or run through its layers' own forwards.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from scgrpo.rollout import four_bit, kernels, lora_matmul, norms
from scgrpo.rollout.four_bit import Dequantizer, chunk_plan, four_bit_state, state_dtype, streamed_matmul

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FOUR_BIT_MODES = four_bit.MODES
# see CompactDecoder.lora_matmul_rows. On an H100 (SmolLM2 shape, r=16, benchmarks/results/session_h100/
# bench_rollout_lora_call_{f,h}.json) 64-row rollouts took 178.5 ms with the LoRA terms inside the matmuls (down's
# after) against 192.8 ms with every term after (188.8 against 202.0 in another call, timed in turn); at 512 rows
# q/k/v and o inside or after measured the same (366.9 / 362.8 ms, calls d and e, before the one-dot kernel)
LORA_MATMUL_ROWS = 128
# ... and for inputs up to this wide: each of its programs computes its rows' z over the whole input, so a long
# input with few output tiles (SmolLM2's down projection: 1536 inputs, 36 tiles of 16 outputs at 64 rows) is
# faster as cuBLAS with the A rows (5.02 us) and the B product in the add-and-norm after it (2.04 against 1.42 us
# LoRA-free) than inside (5.81 us): scripts/tune_block_kernels.py on an H100; for q/k/v, o and gate/up (576
# inputs) inside is faster
LORA_MATMUL_WIDTH = 1024


class Compiled:
    """``torch.compile(fn)`` that falls back to ``fallback`` (default ``fn`` itself: the same computation, written
    for eager execution where that differs), for good and with one warning, when compilation fails (an
    unsupported pattern in this torch/Triton version): slower, never wrong. Shapes start static and only the
    dimensions seen to change (the slot count) become dynamic, so reductions over the hidden size compile to
    single kernels."""

    def __init__(self, fn, name: str, fallback=None) -> None:
        self.fn, self.name = fallback or fn, name
        self.compiled = torch.compile(fn, dynamic=None)
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure: the eager function is exact
                self.failed = True
                log.warning("torch.compile of the %s failed (%s: %s); running it uncompiled",
                            self.name, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return self.fn(*args, **kwargs)


def _inner(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _base_layer(module):
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def memory_free(device: torch.device) -> int:
    """Bytes that new tensors on the GPU ``device`` can take: the card's free memory plus what PyTorch's caching
    allocator holds reserved but unused (after an update that peaked high, most of what the card lacks). An
    upper bound: a large tensor fits in the cache only where whole cached segments are free (else the allocator
    returns them to the card and allocates anew), and a ``set_per_process_memory_fraction`` cap is not read;
    its callers take a half or a quarter of it."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _is_plain(weight: Tensor) -> bool:
    """A float weight used as it is (not a bitsandbytes 4/8-bit parameter, which may even have a float dtype
    when its packed storage is bf16)."""
    if hasattr(weight, "quant_state") or hasattr(weight, "SCB") or type(weight).__name__ in ("Params4bit", "Int8Params"):
        return False
    if weight.element_size() == 1:  # float8 checkpoints keep their scales elsewhere
        return False
    return weight.dtype.is_floating_point and type(weight.data) is torch.Tensor


def _lora_parts(module) -> list[tuple[Tensor, Tensor, float]]:
    """(A ``[r, in]``, B ``[out, r]``, scale) of each active adapter of a peft LoRA layer; [] for a plain one.
    (Read through the modules' own dicts: a refresh asks this of every linear layer before each rollout, and
    ``nn.Module.__getattr__`` would cost more host time than the copies.)"""
    children = module.__dict__.get("_modules", {})
    lora_a, lora_b = children.get("lora_A"), children.get("lora_B")
    if lora_a is None or lora_b is None or getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    parts = []
    for name in module.active_adapters:
        a = lora_a._modules.get(name)
        if a is not None:
            parts.append((a._parameters["weight"], lora_b._modules[name]._parameters["weight"],
                          float(module.scaling[name])))
    return parts


def unsupported_reason(model, max_length: int) -> Optional[str]:
    """Why :class:`CompactDecoder` cannot decode ``model`` exactly up to ``max_length`` tokens, or None."""
    causal_lm = _inner(model)
    config = causal_lm.config
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} (compact forward: {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, None)
    rotary = getattr(backbone, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return f"RoPE type {rotary.rope_type!r} (frequencies change with length)"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = any(t == "sliding_attention" for t in layer_types) or (kind == "mistral" and window)
    if uses_window and window and window < max_length:
        return f"sliding-window attention ({window} tokens) within the {max_length}-token rollouts"
    for module in causal_lm.modules():
        if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
            return "DoRA adapters"
        if hasattr(module, "lora_B") and any(getattr(b, "bias", None) is not None for b in module.lora_B.values()):
            return "LoRA with biases"
        # FSDP swaps parameter objects between rollouts: decode through the HF forward
        if any(cls.__name__ in ("FSDPModule", "FullyShardedDataParallel") for cls in type(module).__mro__):
            return "sharded (FSDP) weights"
    for param in causal_lm.parameters():
        if type(param.data) is not torch.Tensor and param.data.__class__.__name__ == "DTensor":
            return "sharded (DTensor) weights"
    lm_head = causal_lm.get_output_embeddings()
    if _lora_parts(lm_head) or not _is_plain(_base_layer(lm_head).weight):
        return "an adapted or quantised output head"
    if not _is_plain(backbone.embed_tokens.weight) or hasattr(backbone.embed_tokens, "lora_embedding_A"):
        return "an adapted or quantised embedding"
    return None


class Projection:
    """Linear layers that read the same input, as one matmul plus one low-rank matmul for their adapters.

    ``weight`` is ``[W_1; ...; W_k; A_1; ...; A_m]`` (outputs, then adapter ranks), ``up`` the block-diagonal
    ``[sum r, sum out]`` of the scaled, transposed B's (rows along the outputs, so that reading one rank's
    column of every output is one contiguous load): ``y = (x W^T)[:out] + (x W^T)[out:] up``.

    ``ranks``: how many of the rank rows are each layer's (in order; 0 for a layer without adapters).

    The concatenation costs one copy of the layers' weights (kept between rollouts unless released). :meth:`refresh`
    updates it in place (base rows, adapters and biases: one device copy); storage is reallocated only when the
    layout changes (shapes, dtypes, which adapters, their ranks), so a CUDA graph that reads it stays valid. Layers
    whose base weight is not a plain float tensor (4-bit) run their own forward instead."""

    def __init__(self, modules: list, dtype: torch.dtype, four_bit: str = "layers") -> None:
        self.modules = modules
        self.dtype = dtype
        self.bases = [_base_layer(m) for m in modules]
        states = [four_bit_state(b.weight) for b in self.bases]
        self.sizes = [int(s.shape[0]) if s is not None else b.weight.shape[0] for b, s in zip(self.bases, states)]
        self.width = int(states[0].shape[1]) if states[0] is not None else self.bases[0].weight.shape[1]
        self.out = sum(self.sizes)
        # "plain" float weights; a 4-bit base dequantized "resident" (per rollout) or "streamed" (per step) by
        # bitsandbytes' kernel (:mod:`scgrpo.rollout.four_bit`), or run through the "layers"' own forwards
        if all(_is_plain(b.weight) for b in self.bases):
            self.mode = "plain"
        elif four_bit in ("resident", "streamed") and all(s is not None and state_dtype(s) == dtype for s in states):
            self.mode = four_bit
        else:
            self.mode = "layers"
        self.fused = self.mode in ("plain", "resident")  # one matmul over ``weight``
        self.streamed = self.mode == "streamed"
        self.dequantizers: list[Dequantizer] = []
        self.plan: list[tuple[int, int, int, int]] = []  # streamed: see four_bit.chunk_plan
        self.scratch: Optional[Tensor] = None  # streamed: the decoder's shared dequantization buffer
        self.weight: Optional[Tensor] = None
        self.bias: Optional[Tensor] = None
        self.up: Optional[Tensor] = None
        self.lora_a: Optional[Tensor] = None  # streamed: the adapters' A rows ``[sum r, in]``
        self.ranks: tuple[int, ...] = (0,) * len(modules)
        self.blocks: Optional[tuple] = None  # see :func:`low_rank`
        self._layout = None
        self.refresh()

    @property
    def chunk_numel(self) -> int:
        """Streamed: the most weights one run of :attr:`plan` dequantizes (the scratch it needs)."""
        return max(((end - start) * self.width for _, start, end, _ in self.plan), default=0)

    def release(self) -> None:
        """Drops the concatenated copies (rebuilt, in new storage, by the next :meth:`refresh`), and the views into
        them that refresh writes through (a view keeps its whole storage alive)."""
        self.weight = self.bias = self.up = self.lora_a = self.scratch = None
        self._targets, self._lora_targets = [], []
        for d in self.dequantizers:
            d.release()
        self._layout = None

    def refresh(self, copies: Optional["Copies"] = None) -> bool:
        """Returns whether storage was (re)allocated, rather than updated in place. The copies of the weights go
        into ``copies`` when given (the caller runs them, with other projections'), else are done here. A resident
        4-bit base is dequantized here, into the concatenated weight."""
        if self.mode == "layers":
            return False
        loras = [(i, a, b, s) for i, m in enumerate(self.modules) for a, b, s in _lora_parts(m)]
        rank = sum(a.shape[0] for _, a, _, _ in loras)
        weights = [b.weight for b in self.bases]
        plain = self.mode == "plain"
        single = plain and len(self.bases) == 1 and not loras and weights[0].dtype == self.dtype
        shapes = (tuple((tuple(w.shape), w.dtype) for w in weights) if plain
                  else tuple((w.data_ptr(), w.quant_state.shape, w.quant_state.dtype) for w in weights))
        layout = (self.mode, shapes, tuple((i, a.shape[0]) for i, a, _, _ in loras),
                  single, single and weights[0].data_ptr(), tuple(b.bias is not None for b in self.bases))
        allocated = layout != self._layout
        device = weights[0].device
        width = self.width
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes) + 1)]
        if allocated:
            has_bias = any(b.bias is not None for b in self.bases)
            self.up = self.blocks = self.lora_a = None
            self.weight = None  # (freed before a new copy is made)
            if single:
                self.weight = weights[0].detach()  # the layer's own tensor: nothing to copy
            elif self.streamed:  # no base rows: they are dequantized in each step; the A rows apart
                self.lora_a = torch.empty(rank, width, dtype=self.dtype, device=device) if rank else None
            else:
                self.weight = torch.empty(self.out + rank, width, dtype=self.dtype, device=device)
            if not single:
                self.up = torch.zeros(rank, self.out, dtype=self.dtype, device=device) if rank else None
            self.bias = torch.zeros(self.out + rank, dtype=self.dtype, device=device) if has_bias else None
            self._layout = layout
            if not plain:
                self.dequantizers = [Dequantizer(w) for w in weights]
                self.plan = chunk_plan(self.dequantizers, four_bit.STREAM_CHUNK) if self.streamed else []
            # one pass over the adapters: each layer's rank columns, and where each refresh copies to, as views
            # made once (base rows, A rows, the scaled B's blocks seen as B)
            self._targets = [] if single or self.streamed else [self.weight[a:b] for a, b in zip(starts, starts[1:])]
            a_rows = self.lora_a if self.streamed else (self.weight[self.out :] if self.weight is not None else None)
            self._lora_targets = []
            ranks: list[list[int]] = [[] for _ in self.sizes]
            col = 0
            for i, a, _, _ in loras:
                r = a.shape[0]
                ranks[i] += range(col, col + r)
                self._lora_targets.append((a_rows[col : col + r], self.up[col : col + r, starts[i] : starts[i + 1]].t()))
                col += r
            self.ranks = tuple(len(r) for r in ranks)
            if rank:
                self.blocks = tuple((starts[i], starts[i + 1], tuple(r)) for i, r in enumerate(ranks))
        own = copies is None
        copies = Copies() if own else copies
        # one device copy per rollout, base weights too: in-place `.data` edits leave no version trace to check
        if plain:
            copies.plain += zip(self._targets, weights)
        elif self.streamed:
            for d in self.dequantizers:
                d.prepare()  # the fp32 block scales, kept with the workspace
        else:
            with torch.no_grad():
                for target, d in zip(self._targets, self.dequantizers):
                    d.into(target)
                    d.release()  # (the scales are needed again only at the next rollout)
        for (a_at, b_at), (_, a, b, scale) in zip(self._lora_targets, loras):
            copies.scaled += [(a_at, a, 1.0), (b_at, b, scale)]
        if self.bias is not None:  # cheap, and biases may train while the weights do not
            self.bias[: self.out].copy_(torch.cat([
                b.bias.detach() if b.bias is not None else torch.zeros(n, dtype=self.dtype, device=device)
                for b, n in zip(self.bases, self.sizes)]))
        if own:
            copies.run()
        return allocated

    def matmul(self, x: Tensor) -> Tensor:
        """Streamed: ``[M, in]`` -> ``[M, out + sum r]``, the base outputs then the adapters' ``x A^T`` (bias
        added), the layout of a fused projection's matmul."""
        return streamed_matmul(x, self.dequantizers, self.plan, self.scratch, self.lora_a, self.bias)

    def __call__(self, x: Tensor) -> Tensor:
        """``[..., in]`` -> ``[..., sum out]``."""
        if self.mode == "layers":
            return torch.cat([m(x) for m in self.modules], dim=-1)
        if self.streamed:
            y = low_rank(self.matmul(x.reshape(-1, x.shape[-1])), self.up)
            return y.view(*x.shape[:-1], -1)
        return fused_linear(x, self.weight, self.bias, self.up)


class Copies:
    """Weight copies gathered from many projections, done as a few launches (a model's refresh is hundreds of
    small tensors: one launch each would cost more host time than a decode step). The adapters' A and B go
    through :func:`~scgrpo.rollout.norms.scaled_copy` where Triton runs (B's into transposed views, and
    fp32 adapters into a bf16 model, are not what PyTorch's multi-tensor copy does in one launch)."""

    def __init__(self, tables: Optional[dict] = None, kernel: bool = True) -> None:
        self.plain: list[tuple[Tensor, Tensor]] = []  # (destination, source)
        self.scaled: list[tuple[Tensor, Tensor, float]] = []  # (destination, source, scale): scale * source
        self.tables = tables  # scaled_copy's, kept by the caller between refreshes
        self.kernel = kernel  # scaled_copy where Triton runs; False after it failed (run's return value)

    @torch.no_grad()
    def run(self) -> bool:
        """Does the copies; returns False when the copy kernel failed (done the other way instead)."""
        ok = True
        if self.plain:
            torch._foreach_copy_([d for d, _ in self.plain], [t for _, t in self.plain])
        if self.scaled and self.kernel and kernels.usable(self.scaled[0][0].device):  # in fp32, rounded once
            try:
                norms.scaled_copy(self.scaled, tables=self.tables)
                self.scaled = []
            except Exception as err:  # noqa: BLE001 - PyTorch's copies compute the same (the kernel's repeat)
                ok = False
                log.warning("the adapter copy kernel failed (%s: %s); copying with PyTorch", type(err).__name__,
                            str(err).splitlines()[0] if str(err) else "")
        if self.scaled:
            ones = [(d, t) for d, t, k in self.scaled if k == 1.0]
            if ones:
                torch._foreach_copy_([d for d, _ in ones], [t for _, t in ones])
            rest = [(d, t.float(), k) for d, t, k in self.scaled if k != 1.0]
            if rest:
                scaled = torch._foreach_mul([t for _, t, _ in rest], [k for _, _, k in rest])
                torch._foreach_copy_([d for d, _, _ in rest], scaled)
        self.plain, self.scaled = [], []
        return ok


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], up: Optional[Tensor],
                 unrolled: bool = False, blocks: Optional[tuple] = None) -> Tensor:
    shape = x.shape[:-1]
    y = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)  # [n, out + r]
    return low_rank(y, up, unrolled, blocks).view(*shape, -1)


def low_rank(y: Tensor, up: Optional[Tensor], unrolled: bool = False, blocks: Optional[tuple] = None,
             pieces: bool = False):
    """``y[:, :out] + y[:, out:] up`` for the output ``[n, out + r]`` of a projection with LoRA rows (``up`` ``[r, out]``;
    ``y`` itself without). ``unrolled``: as ``r`` multiply-adds, which a compiler fuses into whatever reads the result (no
    second matmul, no copies of the slices); a matmul otherwise. ``blocks`` (:attr:`Projection.blocks`): each layer's
    output columns ``[start, end)`` with the ranks of its own adapters, so that an unrolled output column adds its own
    layer's ranks only (``up`` is block-diagonal: q's columns need q's 16 ranks, not q, k and v's 48). ``pieces``
    (unrolled, with ``blocks``): each block's output apart, as a list (no concatenation for the compiler to
    write out when the reader splits them again: gate and up)."""
    if up is None:
        return y
    rank, out = up.shape
    if unrolled and isinstance(rank, int) and rank <= 256:
        spans = blocks if blocks is not None else ((0, out, tuple(range(rank))),)
        parts = []
        for start, end, ranks in spans:
            piece = y[:, start:end]
            for j in ranks:
                piece = piece + y[:, out + j : out + j + 1] * up[j, start:end]
            parts.append(piece)
        if pieces:
            return parts
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return torch.addmm(y[:, :out], y[:, out:], up)  # base + (x A^T) (s B)^T


def linear(x: Tensor, weight, bias: Optional[Tensor], up: Optional[Tensor], unrolled: bool = False,
           blocks: Optional[tuple] = None) -> Tensor:
    """:func:`fused_linear`, or a :class:`Projection` that runs its own layers (passed as ``weight``)."""
    if isinstance(weight, Projection):
        return weight(x)
    return fused_linear(x, weight, bias, up, unrolled, blocks)


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


@dataclass
class Layer:
    ln1: Tensor
    qkv: Projection
    q_norm: Optional[Tensor]
    k_norm: Optional[Tensor]
    o: Projection
    ln2: Tensor
    gate_up: Projection
    down: Projection


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
    ``last(x, attn, *out_args, norm, head_w, head_b, head_up)`` -> fp32 logits.

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
        return linear(rms_norm(x, norm, eps), head_w, head_b, head_up, unrolled, spans.get("head")).float()

    return first, middle, last


class CompactDecoder:
    """The decode-time forward of a Llama-family model (see the module docstring); ``model`` may be a peft
    model. Call :meth:`refresh` before each rollout (after the optimiser changed the adapters)."""

    def __init__(self, model, compile_layers: bool = False, block_kernels: Optional[bool] = None,
                 lora_matmul_rows: Optional[int] = None, four_bit: str = "auto",
                 memory_budget: Optional[int] = None, keep_workspace: bool = False) -> None:
        causal_lm = _inner(model)
        self.config = config = causal_lm.config
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        self.embed = backbone.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.norm = backbone.norm.weight
        self.eps = float(config.rms_norm_eps)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        self.rotary = backbone.rotary_emb
        self.head = Projection([causal_lm.get_output_embeddings()], self.dtype)
        # the step as Triton kernels between the matmuls (:mod:`scgrpo.rollout.norms`): GPUs, plain float weights,
        # the attention kernel, no q/k norms (Qwen3 keeps the compiled step; 4-bit QLoRA bases the layers' own
        # forwards). By default with compile on and unmerged adapters at construction (the decoder is kept per model):
        # with adapters faster than the compiled step in scripts/bench_rollout.py; without, neither step was
        # faster in every call (64 rows: 1.41/1.25, 1.31/1.36, 1.38/1.52 ms a step, block/compiled)
        linears = [m for block in backbone.layers for m in (
            block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj, block.self_attn.o_proj,
            block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj)]
        self.four_bit = self._four_bit_mode(four_bit, linears, memory_budget, keep_workspace)
        self.layers: list[Layer] = []
        for block in backbone.layers:
            attn, mlp = block.self_attn, block.mlp
            self.layers.append(Layer(
                ln1=block.input_layernorm.weight,
                qkv=Projection([attn.q_proj, attn.k_proj, attn.v_proj], self.dtype, self.four_bit),
                q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None,
                o=Projection([attn.o_proj], self.dtype, self.four_bit),
                ln2=block.post_attention_layernorm.weight,
                gate_up=Projection([mlp.gate_proj, mlp.up_proj], self.dtype, self.four_bit),
                down=Projection([mlp.down_proj], self.dtype, self.four_bit),
            ))
        self._projections = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if self.four_bit in ("resident", "streamed") and any(
                p.mode == "layers" and four_bit_state(p.bases[0].weight) is not None for p in self._projections):
            log.info("4-bit weights not stored for %s (the model's dtype): their layers' own forwards decode them",
                     self.dtype)
        self.scratch: Optional[Tensor] = None  # streamed 4-bit projections' shared dequantization buffer
        possible = (all(p.mode != "layers" for p in self._projections) and kernels.usable(self.device)
                    and kernels.supports(self.head_dim) and not hasattr(backbone.layers[0].self_attn, "q_norm"))
        adapted = any(_lora_parts(m) for m in linears)
        self.block_kernels = possible and (compile_layers and adapted if block_kernels is None else block_kernels)
        # the prefill with the same kernels wherever they run, whichever decode step runs (fewer launches: a prefill
        # is host-bound); a failure falls back to the eager layers for good, with a warning
        self.prefill_kernels = possible
        # with the block kernels, up to this many rows a step an adapted projection's LoRA term is computed inside
        # its matmul (one launch, :mod:`scgrpo.rollout.lora_matmul`); above, by the kernel that reads its output
        self.lora_matmul_rows = LORA_MATMUL_ROWS if lora_matmul_rows is None else lora_matmul_rows
        self.lora_matmul_width = LORA_MATMUL_WIDTH
        self.fused = all(p.fused for p in self._projections)
        self._ensure_scratch()
        self.attention_in, self.attention_out, self.split_heads = layer_functions(self.heads, self.kv_heads,
                                                                                  self.head_dim, self.eps)
        self.compiled = bool(compile_layers and self.fused)  # (the sampling is compiled too)
        self.block_failed = False
        # the Triton attention kernel where it runs (GPUs) and no projection runs its layers' own forwards
        self.fused_attention = (all(p.mode != "layers" for p in self._projections) and kernels.usable(self.device)
                                and kernels.supports(self.head_dim))
        self._spans: Optional[dict] = None
        self._build_steps()
        # with the block kernels and compile on, a LoRA-free add-and-norm or gated activation (LoRA terms inside
        # the matmuls, or no adapters) is the compiler's kernel, as in the compiled step: 1.42 against 1.67 us
        # and 1.31 against 1.47 on an H100 at 64 rows (scripts/profile_rollout.py); the block kernels if it fails.
        # It rounds as the compiled step does (fused operations keep fp32 between them; the Triton kernels round
        # after each operation, as the model does): the bf16 sampler-vs-trainer log-prob gap of
        # scripts/bench_rollout.py's 64-row LoRA case measured 0.0059 mean, 0.031 max with it, 0.0058 and 0.035
        # with the Triton kernels
        self._plain_norm = self._plain_silu = None
        if self.compiled and self.block_kernels and self.device.type == "cuda":
            self._plain_norm = Compiled(add_rms_norm, "add and norm",
                                        fallback=lambda x, y, w, eps: norms.add_norm(x, y, None, w, eps))
            self._plain_silu = Compiled(silu_gate, "gated activation", fallback=norms.silu_mul)
        self._rope: Optional[tuple[Tensor, Tensor]] = None
        self._copy_tables: dict = {}
        self.copy_kernel = True  # the adapters' copies as one launch (norms.scaled_copy) where Triton runs
        self.version = 0

    def _block_layout(self) -> Optional[dict]:
        """Each projection's :attr:`Projection.blocks`, when every layer has the same (else None: the unrolled
        terms then run over all ranks)."""
        spans = {"head": self.head.blocks}
        for name in ("qkv", "o", "gate_up", "down"):
            found = {getattr(layer, name).blocks for layer in self.layers}
            if len(found) != 1:
                return None
            spans[name] = found.pop()
        return spans

    @property
    def _compiles_layers(self) -> bool:
        """The layer code is ``torch.compile``'d (not the block kernels, nor their eager fallback)."""
        return self.compiled and not (self.block_kernels or self.block_failed)

    def _build_steps(self) -> None:
        shapes = (self.heads, self.kv_heads, self.head_dim, self.eps, self.fused_attention)
        self._first, self._middle, self._last = step_functions(*shapes)
        if self._compiles_layers:  # LoRA terms unrolled for the compiler to fuse; the eager versions as the fallback
            self._spans = self._block_layout()
            first, middle, last = step_functions(*shapes, unrolled=True, blocks=self._spans)
            self._first = Compiled(first, "decode step (first block)", fallback=self._first)
            self._middle = Compiled(middle, "decode step (blocks)", fallback=self._middle)
            self._last = Compiled(last, "decode step (output head)", fallback=self._last)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def refresh(self) -> None:
        """Picks up the adapters' (and any changed base weights') current values, in place where it can;
        ``version`` changes when a tensor had to be rebuilt (recorded CUDA graphs then hold stale pointers)."""
        copies = Copies(self._copy_tables, kernel=self.copy_kernel)
        rebuilt = self.head.refresh(copies)
        for proj in self._projections:
            rebuilt |= proj.refresh(copies)
        rebuilt |= self._ensure_scratch()
        if rebuilt:  # (new buffers: tables of their shapes and strides built afresh)
            self._copy_tables.clear()
        self.copy_kernel = copies.run() and self.copy_kernel
        if rebuilt:
            self.version += 1
            if self._compiles_layers and self._block_layout() != self._spans:  # other adapters: other unrolled terms
                self._build_steps()

    def release(self) -> None:
        """Drops the concatenated weight copies until the next :meth:`refresh` (which reallocates them)."""
        self.head.release()
        for proj in self._projections:
            proj.release()
        self.scratch = None
        self.version += 1

    @staticmethod
    def _four_bit_mode(requested: str, linears: list, memory_budget: Optional[int], keep_workspace: bool) -> str:
        """How 4-bit base layers are multiplied by (see :mod:`scgrpo.rollout.four_bit`): ``requested``, or for
        "auto" "resident" when a float copy of the layers takes at most half of the memory left (``memory_budget``
        bytes for the whole process, else :func:`memory_free`), or a quarter when ``keep_workspace`` keeps it
        (with the KV cache) through the update, "streamed" otherwise; "resident" on a CPU."""
        if requested not in FOUR_BIT_MODES:
            raise ValueError(f"four_bit={requested!r}: expected one of {FOUR_BIT_MODES}")
        if requested != "auto":
            return requested
        states = [four_bit_state(_base_layer(m).weight) for m in linears]
        if not any(s is not None for s in states):
            return "resident"  # (nothing is 4-bit: the setting does not matter)
        copy = sum(int(s.shape[0]) * int(s.shape[1]) * torch.empty(0, dtype=s.dtype).element_size()
                   for s in states if s is not None)
        device = _base_layer(linears[0]).weight.device
        if device.type != "cuda":
            return "resident"
        left = (memory_budget - torch.cuda.memory_allocated(device) if memory_budget is not None
                else memory_free(device))
        return "resident" if four_bit.resident_fits(copy, left, kept=keep_workspace) else "streamed"

    def _ensure_scratch(self) -> bool:
        """Allocates the streamed projections' shared buffer when missing or too small; True when it did."""
        need = max((p.chunk_numel for p in self._projections if p.streamed), default=0)
        if not need:
            return False
        grown = self.scratch is None or self.scratch.numel() < need
        if grown:
            self.scratch = None
            self.scratch = torch.empty(need, dtype=self.dtype, device=self.device)
        for p in self._projections:
            if p.streamed:
                p.scratch = self.scratch
        return grown

    def rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """``[length, D]`` cos and sin from the model's own rotary module (any static RoPE scaling)."""
        if self._rope is None or self._rope[0].shape[0] < length:
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            positions = torch.arange(length, device=self.device).unsqueeze(0)
            cos, sin = self.rotary(probe, positions)
            self._rope = (cos[0].contiguous(), sin[0].contiguous())
            self.version += 1
        return self._rope[0][:length], self._rope[1][:length]

    def new_cache(self, slots: int, length: int) -> Tensor:
        """``[layers, 2 (keys, values), slots, kv_heads, length, head_dim]`` (the layout attention reads fastest)."""
        return torch.zeros(self.num_layers, 2, slots, self.kv_heads, length, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def cache_bytes_per_row(self, length: int) -> int:
        return 2 * self.num_layers * self.kv_heads * length * self.head_dim * self.embed.element_size()

    def logits(self, x: Tensor) -> Tensor:
        return self.head(rms_norm(x, self.norm, self.eps)).float()

    @staticmethod
    def _p(proj: Projection) -> tuple:
        return (proj.weight, proj.bias, proj.up) if proj.fused else (proj, None, None)

    def _args(self, layer: Layer) -> tuple:
        p = self._p
        return (layer.ln1, *p(layer.qkv), layer.q_norm, layer.k_norm, *p(layer.o), layer.ln2, *p(layer.gate_up),
                *p(layer.down))

    @property
    def compile_failed(self) -> bool:
        return self.block_failed or any(getattr(f, "failed", False) for f in (
            self._first, self._middle, self._last, self._plain_norm, self._plain_silu))

    @torch.no_grad()
    def decode(self, tokens: Tensor, lens: Tensor, cache: Tensor, length: int) -> Tensor:
        """Logits ``[S, V]`` fp32 of the next token of every slot, after feeding ``tokens`` ``[S]`` at positions
        ``lens`` ``[S]`` (written into ``cache`` ``[layers, 2, S, kv, Lmax, D]`` there); attends to the first
        ``length`` cache entries. Reads nothing back to the host, so a CUDA graph can record it."""
        s, cache_len = tokens.shape[0], cache.shape[4]
        cos_table, sin_table = self.rope_tables(cache_len)
        x = F.embedding(tokens, self.embed)  # [S, H]
        if self.block_kernels:
            try:
                return self._decode_blocks(x, lens, cache, cos_table, sin_table)
            except Exception as err:  # noqa: BLE001 - a kernel that fails to build or launch: the eager step is exact
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # (a graph's warm-up step, uncaptured, meets the failure first)
                self.block_kernels, self.block_failed = False, True
                log.warning("the decode step's block kernels failed (%s: %s); decoding with the uncompiled step",
                            type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        args = [self._args(layer) for layer in self.layers]
        if self.fused_attention:  # one kernel per layer: rotation, cache write, attention over each row's length
            cos, sin = cos_table[lens], sin_table[lens]  # read by the compiled code only for q/k norms (Qwen3)
            a = self._first(x, cos, sin, *args[0][:6])
            for i, layer in enumerate(self.layers):
                attn = kernels.decode_attention(a, lens, cache[i], cos_table, sin_table, self.heads, self.scaling,
                                                rotate=layer.q_norm is None)
                if i + 1 < self.num_layers:
                    x, a = self._middle(x, attn, *args[i][6:], cos, sin, *args[i + 1][:6])
            return self._last(x, attn, *args[-1][6:], self.norm, *self._p(self.head))
        cos, sin = cos_table[lens], sin_table[lens]  # [S, D]
        # additive mask, built once per step for every layer (a boolean one is converted inside each attention)
        visible = torch.arange(length, device=lens.device) <= lens.unsqueeze(1)  # [S, L]
        mask = torch.zeros(s, 1, 1, length, dtype=cache.dtype, device=lens.device).masked_fill(
            ~visible.view(s, 1, 1, length), float("-inf"))
        slots = torch.arange(s, device=lens.device)
        q, kv = self._first(x, cos, sin, *args[0][:6])
        for i in range(self.num_layers):
            cache[i, :, slots, :, lens] = kv.transpose(0, 1)  # [S, 2, kv, D] at each slot's position
            attn = F.scaled_dot_product_attention(q, cache[i, 0, :, :, :length], cache[i, 1, :, :, :length],
                                                  attn_mask=mask, scale=self.scaling)  # [S, kv, G, D]
            if i + 1 < self.num_layers:
                x, (q, kv) = self._middle(x, attn, *args[i][6:], cos, sin, *args[i + 1][:6])
        return self._last(x, attn, *args[-1][6:], self.norm, *self._p(self.head))

    def _decode_blocks(self, x: Tensor, lens: Tensor, cache: Tensor, cos_table: Tensor, sin_table: Tensor) -> Tensor:
        """:meth:`decode` as eight launches a block (:mod:`scgrpo.rollout.norms`); see :meth:`_block_layers`."""
        x, y, up = self._block_layers(x, lambda i, qkv: kernels.decode_attention(
            qkv, lens, cache[i], cos_table, sin_table, self.heads, self.scaling), decode=True)
        _, h = self._add_norm(x, y, up, self.norm, compiled=True)
        return F.linear(h, self.head.weight, self.head.bias).float()

    def _add_norm(self, x: Tensor, y: Optional[Tensor], up: Optional[Tensor], weight: Tensor,
                  compiled: bool) -> tuple[Tensor, Tensor]:
        """:func:`norms.add_norm`, or (``compiled``, no LoRA term to add) its compiled version where there is one."""
        if compiled and y is not None and up is None and self._plain_norm is not None:
            return self._plain_norm(x, y, weight, self.eps)
        return norms.add_norm(x, y, up, weight, self.eps)

    def _block_layers(self, x: Tensor, attend, decode: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The layers over rows ``x`` ``[M, H]`` with the block kernels between the matmuls; ``attend(i, qkv)``:
        layer ``i``'s attention output ``[M, heads D]`` from its q/k/v projection (LoRA term added; ``[M, out]``
        or wider, its first ``out`` columns read). Returns the residual stream, the last down projection's output
        and the ``up`` still to add to it (the final norm's to do).

        LoRA's terms: in a decode step (``decode``), up to :attr:`lora_matmul_rows` rows and
        :attr:`lora_matmul_width` inputs an adapted projection is one launch with its term inside
        (:mod:`scgrpo.rollout.lora_matmul`); otherwise the A products come out of the matmul (``[x W^T | z]``) and
        the B products go into the kernel that reads it (a ninth launch for q/k/v). With compile on, a decode
        step's add-and-norm or gated activation without LoRA terms is ``torch.compile``'d."""
        rows = x.shape[0]

        def project(h: Tensor, proj: Projection) -> tuple[Tensor, Optional[Tensor]]:
            """The output, and the ``up`` still to add to its last columns (None when added)."""
            if proj.streamed:  # the 4-bit base dequantized run by run (the A products in its last columns)
                return proj.matmul(h), proj.up
            if (decode and proj.up is not None and rows <= self.lora_matmul_rows
                    and h.shape[1] <= self.lora_matmul_width and max(proj.ranks) <= lora_matmul.MAX_RANK):
                try:
                    return lora_matmul.lora_matmul(h, proj.weight, proj.bias, proj.up, proj.blocks), None
                except Exception as err:  # noqa: BLE001 - the two-launch path computes the same
                    if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                        raise
                    self.lora_matmul_rows = 0
                    log.warning("the LoRA matmul kernel failed (%s: %s); adding LoRA terms after the matmuls",
                                type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return F.linear(h, proj.weight, proj.bias), proj.up

        y = up = None
        for i, layer in enumerate(self.layers):
            x, h = self._add_norm(x, y, up, layer.ln1, decode)
            qkv, qkv_up = project(h, layer.qkv)  # [M, out (+ R)]: q, k, v (then their adapters' z)
            if qkv_up is not None:
                norms.lora_add(qkv, qkv_up)
            y, up = project(attend(i, qkv), layer.o)
            x, h = self._add_norm(x, y, up, layer.ln2, decode)
            gate_up, gu_up = project(h, layer.gate_up)
            if decode and gu_up is None and self._plain_silu is not None:
                act = self._plain_silu(gate_up)
            else:
                act = norms.silu_mul(gate_up, gu_up, layer.gate_up.ranks if gu_up is not None else (0, 0))
            y, up = project(act, layer.down)
        return x, y, up

    @torch.no_grad()
    def prefill(self, ids: Tensor, lengths: Tensor, slots: Tensor, cache: Tensor) -> Tensor:
        """Runs right-padded prompts ``ids`` ``[n, T]`` (``lengths`` ``[n]`` real tokens each) from position 0,
        stores their keys/values in cache rows ``slots`` ``[n]`` and returns the fp32 logits ``[n, V]`` after
        each prompt's last token. Where the block kernels can run (:attr:`prefill_kernels`), the work between
        the matmuls is theirs (fewer launches, the decode step's roundings), else the eager layer code's."""
        n, t = ids.shape
        cos, sin = self.rope_tables(cache.shape[4])
        cos, sin = cos[:t].unsqueeze(0), sin[:t].unsqueeze(0)  # [1, T, D]
        positions = torch.arange(t, device=ids.device)
        causal = positions.view(1, t) <= positions.view(t, 1)  # [T, T]
        mask = (causal.unsqueeze(0) & (positions.view(1, 1, t) < lengths.view(n, 1, 1))).unsqueeze(1)  # [n,1,T,T]
        x = F.embedding(ids, self.embed)  # [n, T, H]
        if self.prefill_kernels:
            try:
                return self._prefill_blocks(x, lengths, slots, cache, cos, sin, mask)
            except Exception as err:  # noqa: BLE001 - as in decode: the eager layers are exact
                self.prefill_kernels = False
                log.warning("the prefill's block kernels failed (%s: %s); prefilling with the eager layers",
                            type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        for i, layer in enumerate(self.layers):
            args = self._args(layer)
            q, k, v = self.attention_in(x, cos, sin, *args[:6])  # [n, T, kv, G, D], [n, T, kv, D] x 2
            x = self.attention_out(x, self._prefill_attention(i, q, k, v, slots, cache, mask), *args[6:])
        last = x[torch.arange(n, device=ids.device), lengths - 1]  # [n, H]
        return self.logits(last)

    def _prefill_attention(self, i: int, q: Tensor, k: Tensor, v: Tensor, slots: Tensor, cache: Tensor,
                           mask: Tensor) -> Tensor:
        """Layer ``i``'s keys and values ``[n, T, kv, D]`` into the cache rows ``slots``, and the causal attention
        of ``q`` ``[n, T, kv, G, D]`` over them: ``[n, T, heads, D]``."""
        t = q.shape[1]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, kv, T, D]
        cache[i, 0, slots, :, :t] = k
        cache[i, 1, slots, :, :t] = v
        q = q.flatten(2, 3).transpose(1, 2)  # [n, heads, T, D]
        group = self.heads // self.kv_heads
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                              attn_mask=mask, scale=self.scaling)  # [n, heads, T, D]
        return attn.transpose(1, 2)

    def _prefill_blocks(self, x: Tensor, lengths: Tensor, slots: Tensor, cache: Tensor, cos: Tensor, sin: Tensor,
                        mask: Tensor) -> Tensor:
        """:meth:`prefill` with :meth:`_decode_blocks`' kernels between the matmuls (LoRA's B products added by
        the kernels that read each output), over the ``n T`` positions as rows."""
        n, t, width = x.shape

        def attend(i: int, qkv: Tensor) -> Tensor:
            q, k, v = self.split_heads(qkv[:, : self.layers[i].qkv.out].view(n, t, -1), (n, t), cos, sin, None, None)
            return self._prefill_attention(i, q, k, v, slots, cache, mask).reshape(n * t, -1)

        x, y, up = self._block_layers(x.reshape(n * t, width), attend, decode=False)
        last = torch.arange(n, device=x.device) * t + lengths - 1  # each prompt's last position
        _, h = norms.add_norm(x[last], y[last], up, self.norm, self.eps)
        return F.linear(h, self.head.weight, self.head.bias).float()

def length_bucket(length: int, limit: int) -> int:
    """Attention length for a step whose longest live row needs ``length`` entries: rounded up to a multiple of
    64 (256 past 1,024), at most ``limit``. Few buckets = few CUDA graphs; a bucket reads at most 63 (255)
    entries more than needed."""
    width = 64 if length <= 1024 else 256
    return min(limit, int(math.ceil(length / width) * width))
