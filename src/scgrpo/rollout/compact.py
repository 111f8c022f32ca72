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
reach, dynamic RoPE, DoRA, sharded weights) are reported by :func:`~scgrpo.rollout.model_parts.unsupported_reason`
and decoded through the Hugging Face forward instead. A 4-bit (bitsandbytes) base is dequantized with bitsandbytes'
own kernel, once per rollout or inside each step (:mod:`scgrpo.rollout.four_bit`), or run through its layers' own
forwards.

The parts: :mod:`scgrpo.rollout.projection` (the concatenated weights and their refresh),
:mod:`scgrpo.rollout.layers` (the block's computation as functions of tensors), :mod:`scgrpo.rollout.model_parts`
(reading the model), :mod:`scgrpo.rollout.compiled` (compilation with an eager fallback).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from scgrpo.errors import one_line
from scgrpo.rollout import four_bit, kernels, lora_matmul, norms
from scgrpo.rollout.compiled import Compiled
from scgrpo.rollout.four_bit import four_bit_state
from scgrpo.rollout.layers import (
    Layer,
    ProjectionArgs,
    add_rms_norm,
    layer_functions,
    rms_norm,
    silu_gate,
    step_functions,
)
from scgrpo.rollout.memory import memory_free
from scgrpo.rollout.model_parts import base_layer, inner_model, lora_parts
from scgrpo.rollout.projection import Copies, Projection

log = logging.getLogger(__name__)

FOUR_BIT_MODES = four_bit.MODES
LORA_MATMUL_ROWS = 128
"""Default :attr:`CompactDecoder.lora_matmul_rows`: with the LoRA terms inside the matmuls, 64-row rollouts were
faster than with every term after them, 512-row ones no faster (benchmarks/results/session_h100/
bench_rollout_lora_call_{d,e,f,h}.json)"""
LORA_MATMUL_WIDTH = 1024
"""Default :attr:`CompactDecoder.lora_matmul_width`, the widest input taking its LoRA term inside the matmul: each
program reduces over the whole input, so a wide input with few output tiles (SmolLM2's down projection) is faster
as cuBLAS with the A rows and the B product added after (docs/benchmarks.md, "Projections with their LoRA term
inside")"""


class CompactDecoder:
    """The decode-time forward of a Llama-family model (see the module docstring); ``model`` may be a peft
    model. Call :meth:`refresh` before each rollout (after the optimiser changed the adapters)."""

    def __init__(self, model, compile_layers: bool = False, block_kernels: Optional[bool] = None,
                 lora_matmul_rows: Optional[int] = None, four_bit: str = "auto",
                 memory_budget: Optional[int] = None, keep_workspace: bool = False) -> None:
        causal_lm = inner_model(model)
        self.config = config = causal_lm.config
        self.attention_scratch: dict = {}  # the split attention kernel's partial results, per shape (kernels.py)
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
        # with adapters they beat the compiled step; without, neither step was faster in every call (block_step and
        # compiled_step in benchmarks/results/bench_rollout_h100.json, session_h100/bench_rollout_lora_call_{a,b})
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
        adapted = any(lora_parts(m) for m in linears)
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
        # the matmuls, or no adapters) is the compiler's kernel, as in the compiled step: faster at 64 rows
        # (docs/benchmarks.md, "Block kernels with LoRA terms"); the block kernels if it fails. It rounds as the
        # compiled step does (fused operations keep fp32 between them; the Triton kernels round after each
        # operation, as the model does); the sampler-vs-trainer log-prob gap measured about the same either way
        # (scripts/bench_rollout.py's logprob_mismatch_*, as in benchmarks/results/bench_rollout_h100.json)
        self._plain_norm = self._plain_silu = None
        if self.compiled and self.block_kernels and self.device.type == "cuda":
            self._plain_norm = Compiled(add_rms_norm, "add and norm",
                                        fallback=lambda x, y, w, eps: norms.add_norm(x, y, None, w, eps))
            self._plain_silu = Compiled(silu_gate, "gated activation", fallback=norms.silu_mul)
        self._rope: Optional[tuple[Tensor, Tensor]] = None
        self._copy_tables: dict = {}
        self.copy_kernel = True  # the adapters' copies as one launch (norms.scaled_copy) where Triton runs
        self.version = 0
        self.releases = 0  # calls of release (the copies then need a refresh before the next decode)

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
        self.releases += 1

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
        states = [four_bit_state(base_layer(m).weight) for m in linears]
        if not any(s is not None for s in states):
            return "resident"  # (nothing is 4-bit: the setting does not matter)
        copy = sum(int(s.shape[0]) * int(s.shape[1]) * torch.empty(0, dtype=s.dtype).element_size()
                   for s in states if s is not None)
        device = base_layer(linears[0]).weight.device
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

    def prefill_bytes(self, tokens: int) -> int:
        """Bytes a prefill of ``tokens`` prompt tokens holds at once, at most: a layer's residual stream, its norm,
        q/k/v, the eager attention's keys and values repeated per query head, attention's output, the MLP's gate, up
        and activation, in the model's dtype."""
        h = int(self.config.hidden_size)
        inner = int(getattr(self.config, "intermediate_size", 0) or 4 * h)
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return tokens * self.embed.element_size() * (3 * h + qkv + 3 * self.heads * self.head_dim + 3 * inner)

    def _head(self, x: Tensor, states: bool) -> Tensor | tuple[Tensor, Tensor]:
        h = rms_norm(x, self.norm, self.eps)
        logits = self.head(h).float()
        return (logits, h) if states else logits

    @property
    def compile_failed(self) -> bool:
        return self.block_failed or any(getattr(f, "failed", False) for f in (
            self._first, self._middle, self._last, self._plain_norm, self._plain_silu))

    @torch.no_grad()
    def decode(self, tokens: Tensor, lens: Tensor, cache: Tensor, length: int,
               states: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``[S, V]`` fp32 of the next token of every slot, after feeding ``tokens`` ``[S]`` at positions
        ``lens`` ``[S]`` (written into ``cache`` ``[layers, 2, S, kv, Lmax, D]`` there); attends to the first
        ``length`` cache entries. Reads nothing back to the host, so a CUDA graph can record it. ``states``: also
        the final norm's output ``[S, H]`` (in the model dtype) that the head read: the policy's final hidden states."""
        s, cache_len = tokens.shape[0], cache.shape[4]
        cos_table, sin_table = self.rope_tables(cache_len)
        x = F.embedding(tokens, self.embed)  # [S, H]
        if self.block_kernels:
            try:
                out = self._decode_blocks(x, lens, cache, cos_table, sin_table)
                return out if states else out[0]
            except Exception as err:  # noqa: BLE001 - a kernel that fails to build or launch: the eager step is exact
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # (a graph's warm-up step, uncaptured, meets the failure first)
                self.block_kernels, self.block_failed = False, True
                log.warning("the decode step's block kernels failed (%s: %s); decoding with the uncompiled step",
                            type(err).__name__, one_line(err))
        args = [layer.args() for layer in self.layers]
        if self.fused_attention:  # one kernel per layer: rotation, cache write, attention over each row's length
            cos, sin = cos_table[lens], sin_table[lens]  # read by the compiled code only for q/k norms (Qwen3)
            a = self._first(x, cos, sin, *args[0].attention_in)
            for i, layer in enumerate(self.layers):
                attn = kernels.decode_attention(a, lens, cache[i], cos_table, sin_table, self.heads, self.scaling,
                                                rotate=layer.q_norm is None, scratch=self.attention_scratch)
                if i + 1 < self.num_layers:
                    x, a = self._middle(x, attn, *args[i].attention_out, cos, sin, *args[i + 1].attention_in)
            out = self._last(x, attn, *args[-1].attention_out, self.norm, *ProjectionArgs.of(self.head))
            return out if states else out[0]
        cos, sin = cos_table[lens], sin_table[lens]  # [S, D]
        # additive mask, built once per step for every layer (a boolean one is converted inside each attention)
        visible = torch.arange(length, device=lens.device) <= lens.unsqueeze(1)  # [S, L]
        mask = torch.zeros(s, 1, 1, length, dtype=cache.dtype, device=lens.device).masked_fill(
            ~visible.view(s, 1, 1, length), float("-inf"))
        slots = torch.arange(s, device=lens.device)
        q, kv = self._first(x, cos, sin, *args[0].attention_in)
        for i in range(self.num_layers):
            cache[i, :, slots, :, lens] = kv.transpose(0, 1)  # [S, 2, kv, D] at each slot's position
            attn = F.scaled_dot_product_attention(q, cache[i, 0, :, :, :length], cache[i, 1, :, :, :length],
                                                  attn_mask=mask, scale=self.scaling)  # [S, kv, G, D]
            if i + 1 < self.num_layers:
                x, (q, kv) = self._middle(x, attn, *args[i].attention_out, cos, sin, *args[i + 1].attention_in)
        out = self._last(x, attn, *args[-1].attention_out, self.norm, *ProjectionArgs.of(self.head))
        return out if states else out[0]

    def _decode_blocks(self, x: Tensor, lens: Tensor, cache: Tensor, cos_table: Tensor,
                       sin_table: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`decode` as eight launches a block (:mod:`scgrpo.rollout.norms`); see :meth:`_block_layers`.
        Returns the logits and the final states."""
        x, y, up = self._block_layers(x, lambda i, qkv: kernels.decode_attention(
            qkv, lens, cache[i], cos_table, sin_table, self.heads, self.scaling, scratch=self.attention_scratch),
            decode=True)
        _, h = self._add_norm(x, y, up, self.norm, compiled=True)
        return F.linear(h, self.head.weight, self.head.bias).float(), h

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
                                type(err).__name__, one_line(err))
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
    def prefill(self, ids: Tensor, lengths: Tensor, slots: Tensor, cache: Tensor,
                states: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Runs right-padded prompts ``ids`` ``[n, T]`` (``lengths`` ``[n]`` real tokens each) from position 0,
        stores their keys/values in cache rows ``slots`` ``[n]`` and returns the fp32 logits ``[n, V]`` after
        each prompt's last token (a row of length 0 pads a batch: nothing stored, its logits meaningless). Where the block kernels can run (:attr:`prefill_kernels`), the work between
        the matmuls is theirs (fewer launches, the decode step's roundings), else the eager layer code's. ``states``:
        also the final states ``[n, H]`` there, as :meth:`decode`'s."""
        n, t = ids.shape
        cos_table, sin_table = self.rope_tables(cache.shape[4])
        x = F.embedding(ids, self.embed)  # [n, T, H]
        if self.prefill_kernels:
            try:
                out = self._prefill_blocks(x, lengths, slots, cache, cos_table, sin_table)
                return out if states else out[0]
            except Exception as err:  # noqa: BLE001 - as in decode: the eager layers are exact
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # (a recording's warm-up run, uncaptured, meets the failure first)
                self.prefill_kernels = False
                log.warning("the prefill's block kernels failed (%s: %s); prefilling with the eager layers",
                            type(err).__name__, one_line(err))
        empty = lengths == 0
        if bool(empty.any()):  # padding rows (a recorded prefill's shape): no cache write, zero logits
            logits = torch.zeros(n, self.embed.shape[0], dtype=torch.float32, device=ids.device)
            hidden = torch.zeros(n, self.embed.shape[1], dtype=self.dtype, device=ids.device)
            logits[~empty], hidden[~empty] = self.prefill(ids[~empty], lengths[~empty], slots[~empty], cache, True)
            return (logits, hidden) if states else logits
        cos, sin = cos_table[:t].unsqueeze(0), sin_table[:t].unsqueeze(0)  # [1, T, D]
        mask = self._prefill_mask(lengths, t)
        for i, layer in enumerate(self.layers):
            args = layer.args()
            q, k, v = self.attention_in(x, cos, sin, *args.attention_in)  # [n, T, kv, G, D], [n, T, kv, D] x 2
            x = self.attention_out(x, self._prefill_attention(i, q, k, v, slots, cache, mask), *args.attention_out)
        last = x[torch.arange(n, device=ids.device), lengths - 1]  # [n, H]
        return self._head(last, states)

    @staticmethod
    def _prefill_mask(lengths: Tensor, t: int) -> Tensor:
        """``[n, 1, T, T]``: causal, and no key past its row's ``lengths``."""
        n = lengths.shape[0]
        positions = torch.arange(t, device=lengths.device)
        causal = positions.view(1, t) <= positions.view(t, 1)  # [T, T]
        return (causal.unsqueeze(0) & (positions.view(1, 1, t) < lengths.view(n, 1, 1))).unsqueeze(1)

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

    def _prefill_blocks(self, x: Tensor, lengths: Tensor, slots: Tensor, cache: Tensor, cos_table: Tensor,
                        sin_table: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`prefill` with :meth:`_decode_blocks`' kernels between the matmuls (LoRA's B products added by
        the kernels that read each output), over the ``n T`` positions as rows; the attention, its rotation and
        the cache write are :func:`kernels.prefill_attention`'s one launch a layer (the prefill was host-bound:
        about 30 ms for any size on an H100 with PyTorch's attention and the eager rotation, docs/envs.md)."""
        n, t, width = x.shape

        def attend(i: int, qkv: Tensor) -> Tensor:
            return kernels.prefill_attention(qkv[:, : self.layers[i].qkv.out], lengths, slots, cache[i], cos_table,
                                             sin_table, self.heads, self.scaling)

        x, y, up = self._block_layers(x.reshape(n * t, width), attend, decode=False)
        last = torch.arange(n, device=x.device) * t + lengths - 1  # each prompt's last position
        _, h = norms.add_norm(x[last], y[last], up, self.norm, self.eps)
        return F.linear(h, self.head.weight, self.head.bias).float(), h
