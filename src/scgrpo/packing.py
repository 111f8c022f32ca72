"""Packed forward passes: the sequences of a padded batch laid end to end in rows of a few hundred columns, each
attending to itself alone, so that a pass computes its real tokens and little padding.

A step's batches are padded to their longest row: the self-teacher's shared pass pads every completion to the
longest one and every student prompt to the longest teacher prompt, which on SmolLM2's arithmetic step is about
half of the tokens it computes. A packed pass gives each token the same inputs as the padded pass (the same
tokens before it, the same position ids, counted from each sequence's first token), through a block-diagonal
causal mask, so its states differ from the padded pass's by the kernels' rounding only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

ENABLED = True
"""Whether the passes that may run packed do (the self-teacher's shared passes, and every pass over a budget's micro-batches);
False: every pass runs padded."""
TRAINING = True
"""Whether the update's passes (those with a gradient) pack too; False: only the passes without one."""
PACK_WIDTH = 256
"""Columns of a packed row, at least (more where one sequence is longer): attention in a packed row computes
``width`` columns for each token, so wider rows pack tighter and attend to more masked columns (measured on an H200,
SmolLM2's step: SC-GRPO 0.68 s at 256, 0.85 s at 512; GRPO 0.48 s and 0.51 s)."""
PACK_GAIN = 0.8
"""A batch is packed when its packed tokens are at most this share of its padded tokens (else the padded pass,
which attends to no masked column, is as fast)."""


@dataclasses.dataclass
class Packing:
    """Where each sequence of a padded batch ``[N, T]`` lies in the packed rows ``[R, width]``."""

    rows: int
    width: int
    origin: Tensor  # [N] flat packed position of column 0 of each sequence (its first token's position, less its first column)
    first: Tensor  # [N] the padded column of each sequence's first token
    length: Tensor  # [N] its tokens
    owner: Tensor  # [K] the sequence of each real token
    source: Tensor  # [K] flat padded position of each real token
    target: Tensor  # [K] its flat packed position
    positions: Tensor  # [K] its position id

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def plan_packing(attention_mask: Tensor, min_width: Optional[int] = None, gain: Optional[float] = None
                 ) -> Optional[Packing]:
    """The packing of a right- or left-padded batch ``attention_mask`` ``[N, T]`` (each row's tokens contiguous), or
    None when it would save too little (:data:`PACK_GAIN`) or a row's tokens have gaps. Sequences go longest
    first into the first row with room (rows of ``max(min_width, longest)`` columns, rounded up to 16).
    ``min_width`` and ``gain`` default to :data:`PACK_WIDTH` and :data:`PACK_GAIN`."""
    min_width = PACK_WIDTH if min_width is None else min_width
    gain = PACK_GAIN if gain is None else gain
    n, t = attention_mask.shape
    if n == 0:
        return None
    mask = attention_mask.bool()
    device = mask.device
    length_t = mask.sum(1)
    first_t = mask.int().argmax(1)
    last_t = t - 1 - mask.flip(1).int().argmax(1)
    stats = torch.stack([length_t, first_t, last_t]).tolist()  # (one transfer)
    lengths, firsts, lasts = stats
    if any(k == 0 or last - f + 1 != k for k, f, last in zip(lengths, firsts, lasts)):
        return None  # (a gap inside a row, or an empty row: the padded pass)
    width = -(-max(min_width, max(lengths)) // 16) * 16
    room: list[int] = []  # columns left in each packed row
    origin = [0] * n
    for s in sorted(range(n), key=lambda i: -lengths[i]):
        k = lengths[s]
        row = next((r for r, left in enumerate(room) if left >= k), None)
        if row is None:
            room.append(width)
            row = len(room) - 1
        origin[s] = row * width + (width - room[row]) - firsts[s]
        room[row] -= k
    if len(room) * width > gain * n * t:
        return None
    total = sum(lengths)
    length = torch.tensor(lengths, device=device)
    first = torch.tensor(firsts, device=device)
    origin_t = torch.tensor(origin, device=device)
    owner = torch.repeat_interleave(torch.arange(n, device=device), length, output_size=total)  # [K]
    starts = torch.cumsum(length, 0) - length
    offset = torch.arange(total, device=device) - starts[owner]  # [K] position within its sequence
    column = first[owner] + offset
    return Packing(rows=len(room), width=width, origin=origin_t, first=first, length=length, owner=owner,
                   source=owner * t + column, target=origin_t[owner] + column, positions=offset)


def packed_inputs(packing: Packing, input_ids: Tensor, pad_id: int, mask_dtype: Optional[torch.dtype] = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids [R, W], position_ids [R, W], mask [R, 1, W, W])`` of the packed rows: the mask is causal inside each
    sequence and lets each padding column see the padding before it in its row (no row of the mask is empty).
    Boolean (True: attend) unless ``mask_dtype``, then additive (0 or the dtype's lowest value)."""
    r, w = packing.rows, packing.width
    device = input_ids.device
    ids = torch.full((r * w,), pad_id, dtype=input_ids.dtype, device=device)
    ids[packing.target] = input_ids.reshape(-1)[packing.source]
    positions = torch.zeros(r * w, dtype=torch.long, device=device)
    positions[packing.target] = packing.positions
    segment = -1 - torch.arange(r * w, device=device) // w  # padding: one segment per row
    segment[packing.target] = packing.owner
    segment = segment.view(r, w)
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    mask = (segment.unsqueeze(2) == segment.unsqueeze(1)) & causal  # [R, W, W]
    mask = mask.unsqueeze(1)
    if mask_dtype is not None:
        mask = torch.zeros(mask.shape, dtype=mask_dtype, device=device).masked_fill(~mask, torch.finfo(mask_dtype).min)
    return ids.view(r, w), positions.view(r, w), mask


def unpack_columns(packing: Packing, hidden: Tensor, columns: Tensor) -> Tensor:
    """``[N, len(columns), H]`` the packed states ``hidden`` ``[R, W, H]`` at the padded ``columns`` of each
    sequence (zeros where a column holds none of its tokens)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    col = columns.unsqueeze(0)  # [1, C]
    inside = (col >= packing.first.unsqueeze(1)) & (col < (packing.first + packing.length).unsqueeze(1))  # [N, C]
    index = (packing.origin.unsqueeze(1) + col).clamp(0, flat.shape[0] - 1)
    return torch.where(inside.unsqueeze(-1), flat[index], flat.new_zeros(()))
