"""A decoder layer's linear layers as the compact forward multiplies by them.

:class:`Projection` concatenates the layers that read one input (q/k/v, gate/up) into one weight with their LoRA
adapters' down-projections appended as rows, and keeps it up to date in place; :class:`Copies` does a model's
refresh copies in a few launches; :func:`low_rank` and :func:`linear` apply such a projection (the LoRA term as a
matmul, or unrolled into multiply-adds for the compiler to fuse).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from scgrpo.errors import one_line
from scgrpo.rollout import four_bit, kernels, norms
from scgrpo.rollout.four_bit import Dequantizer, chunk_plan, four_bit_state, state_dtype, streamed_matmul
from scgrpo.rollout.model_parts import base_layer, is_plain, lora_parts

log = logging.getLogger(__name__)


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
        self.bases = [base_layer(m) for m in modules]
        states = [four_bit_state(b.weight) for b in self.bases]
        self.sizes = [int(s.shape[0]) if s is not None else b.weight.shape[0] for b, s in zip(self.bases, states)]
        self.width = int(states[0].shape[1]) if states[0] is not None else self.bases[0].weight.shape[1]
        self.out = sum(self.sizes)
        # "plain" float weights; a 4-bit base dequantized "resident" (per rollout) or "streamed" (per step) by
        # bitsandbytes' kernel (:mod:`scgrpo.rollout.four_bit`), or run through the "layers"' own forwards
        if all(is_plain(b.weight) for b in self.bases):
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
        loras = [(i, a, b, s) for i, m in enumerate(self.modules) for a, b, s in lora_parts(m)]
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
                log.warning("the adapter copy kernel failed (%s: %s); copying with PyTorch",
                            type(err).__name__, one_line(err))
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
