"""Packed forward passes: the sequences of a padded batch laid end to end in rows of a few hundred columns, each
attending to itself alone (and to the tokens it shares with others, below), so that a pass computes its real tokens
and little padding.

A step's batches are padded to their longest row: the self-teacher's shared pass pads every completion to the
longest one and every student prompt to the longest teacher prompt, which on SmolLM2's arithmetic step is about
half of the tokens it computes. A packed pass gives each token the same inputs as the padded pass (the same
tokens before it, the same position ids, counted from each sequence's first token), through a block-diagonal
causal mask, so its states differ from the padded pass's by the kernels' rounding only.

Rows that begin with the same tokens (the G rollouts of a prompt; the self-teacher's rows that share a reference)
are packed as a tree: the shared tokens once, then each row's own tokens, which attend to them. On SmolLM2's
arithmetic a prompt is as long as a completion, so this computes about half of a group's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

PACK_WIDTH = 256
"""Columns of a packed row, at least (more where one sequence is longer): attention in a packed row computes
``width`` columns for each token, so wider rows pack tighter and attend to more masked columns (measured on an H200,
SmolLM2's step: SC-GRPO 0.68 s at 256, 0.85 s at 512; GRPO 0.48 s and 0.51 s)."""
SHARED_PREFIXES = True
"""Whether rows that begin with the same tokens are packed as trees (the shared tokens once); False: each row whole.
A tree must fit one packed row, so only rows whose prompt and at least two completions fit :data:`PACK_WIDTH` (or the
batch's longest sequence) share."""
PACK_GAIN = 0.8
"""A batch is packed when its packed tokens are at most this share of its padded tokens (else the padded pass,
which attends to no masked column, is as fast)."""


@dataclasses.dataclass
class Packing:
    """Where each sequence of a padded batch ``[N, T]`` lies in the packed rows ``[R, width]``.

    A sequence lies in one or two runs of a packed row: its own tokens, and, where it shares its first tokens with
    other sequences of the batch (:func:`plan_packing`'s ``shared_columns``), one copy of those tokens that all of
    them attend to, placed before their own in the same row."""

    rows: int
    width: int
    origin: Tensor  # [N] flat packed position of column 0 of each sequence's own run (a column from ``split`` on lies at origin + column)
    first: Tensor  # [N] the padded column of each sequence's first token
    length: Tensor  # [N] its tokens
    owner: Tensor  # [K] the sequence of each real token
    source: Tensor  # [K] flat padded position of each real token
    target: Tensor  # [K] its flat packed position (a shared token's is the same for every sequence that shares it)
    positions: Tensor  # [K] its position id
    split: Optional[Tensor] = None  # [N] the padded column where each sequence's own run starts (None: at ``first``)
    prefix_origin: Optional[Tensor] = None  # [N] as ``origin``, for the columns before ``split`` (the shared run)
    segment: Optional[Tensor] = None  # [K] what each token attends within: its sequence, or its shared run (N + run)
    group: Optional[Tensor] = None  # [K] the shared run whose tokens each token also attends to (-1: none)

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    @property
    def shared_tokens(self) -> int:
        """Tokens that shared runs saved: the padded batch's real tokens less the packed rows' real tokens."""
        return int(self.target.numel()) - int(self.target.unique().numel()) if self.split is not None else 0


def _shared_groups(input_ids: Tensor, mask: Tensor, columns: int, firsts: list[int]) -> list[list[int]]:
    """Sequences that hold the same tokens in the first ``columns`` columns (same ids in the same columns, at least
    one token there), two or more to a group. The rows are compared on their device; only each row's group comes back."""
    head = torch.where(mask[:, :columns], input_ids[:, :columns], -1)
    _, inverse, counts = torch.unique(head, dim=0, return_inverse=True, return_counts=True)
    inverse, counts = inverse.tolist(), counts.tolist()  # (N and at most N values)
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(inverse):
        if firsts[i] < columns and counts[key] > 1:
            groups.setdefault(key, []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def _place(width: int, groups: list[list[int]], lengths: list[int], firsts: list[int], columns: int):
    """First-fit decreasing of the batch's units into rows of ``width`` columns: a tree (the tokens its members share,
    then as many members' own tokens as a row holds) or a sequence alone. Returns the rows' room left, each
    sequence's origin and shared run's origin (flat packed positions less its first column), its unit and its
    shared tokens."""
    n = len(lengths)
    shared = [0] * n
    units: list[tuple[int, list[int]]] = []  # (shared tokens, members)
    for group in groups:
        p = min(columns - firsts[group[0]], min(lengths[i] for i in group))
        unit: list[int] = []
        for i in sorted(group, key=lambda i: -lengths[i]):
            if unit and p + sum(lengths[j] - p for j in unit) + lengths[i] - p > width:
                units.append((p, unit))
                unit = []
            unit.append(i)
        units.append((p, unit))
    units = [(p, members) if len(members) > 1 else (0, members) for p, members in units]  # (one alone shares nothing)
    for p, members in units:
        for i in members:
            shared[i] = p
    placed = {i for _, members in units for i in members}
    units += [(0, [i]) for i in range(n) if i not in placed]
    size = [p + sum(lengths[i] - p for i in members) for p, members in units]
    room: list[int] = []  # columns left in each packed row
    origin, prefix_origin, unit_of = [0] * n, [0] * n, [0] * n
    for u in sorted(range(len(units)), key=lambda u: -size[u]):
        p, members = units[u]
        row = next((r for r, left in enumerate(room) if left >= size[u]), None)
        if row is None:
            room.append(width)
            row = len(room) - 1
        at = row * width + (width - room[row])  # flat packed position of the unit's first token
        for i in members:
            unit_of[i] = u
            prefix_origin[i] = at - firsts[i]
        at += p
        for i in members:
            origin[i] = at - firsts[i] - p  # column first + p (the first own token) lies at ``at``
            at += lengths[i] - p
        room[row] -= size[u]
    return room, origin, prefix_origin, unit_of, shared


def plan_packing(attention_mask: Tensor, min_width: Optional[int] = None, gain: Optional[float] = None,
                 input_ids: Optional[Tensor] = None, shared_columns: int = 0) -> Optional[Packing]:
    """The packing of a right- or left-padded batch ``attention_mask`` ``[N, T]`` (each row's tokens contiguous), or
    None when it would save too little (:data:`PACK_GAIN`) or a row's tokens have gaps. Sequences go longest
    first into the first row with room (rows of ``max(min_width, longest)`` columns, rounded up to 16).
    ``min_width`` and ``gain`` default to :data:`PACK_WIDTH` and :data:`PACK_GAIN`.

    With ``input_ids`` and ``shared_columns`` > 0, sequences whose first ``shared_columns`` columns hold the same
    tokens (a group's prompt, a teacher prompt that several rows share) are packed as a tree: those tokens once,
    then each sequence's own tokens, which attend to them and to themselves. Their states are the padded pass's
    (the same tokens before each token, the same position ids); a tree too wide for one row is cut into several,
    each with its own copy of the shared tokens."""
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
    columns = min(shared_columns, t)
    groups = _shared_groups(input_ids, mask, columns, firsts) if input_ids is not None and columns > 0 else []
    room, origin, prefix_origin, unit_of, shared = _place(width, groups, lengths, firsts, columns)
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
    if not any(shared):
        return Packing(rows=len(room), width=width, origin=origin_t, first=first, length=length, owner=owner,
                       source=owner * t + column, target=origin_t[owner] + column, positions=offset)
    split = first + torch.tensor(shared, device=device)
    prefix_origin_t = torch.tensor(prefix_origin, device=device)
    in_prefix = column < split[owner]  # [K]
    target = torch.where(in_prefix, prefix_origin_t[owner], origin_t[owner]) + column
    unit = torch.tensor(unit_of, device=device)[owner]  # [K]
    has_prefix = torch.tensor([bool(s) for s in shared], device=device)[owner]
    segment = torch.where(in_prefix, n + unit, owner)
    group = torch.where(has_prefix, unit, torch.full_like(unit, -1))
    return Packing(rows=len(room), width=width, origin=origin_t, first=first, length=length, owner=owner,
                   source=owner * t + column, target=target, positions=offset, split=split,
                   prefix_origin=prefix_origin_t, segment=segment, group=group)


def packed_inputs(packing: Packing, input_ids: Tensor, pad_id: int, mask_dtype: Optional[torch.dtype] = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids [R, W], position_ids [R, W], mask [R, 1, W, W])`` of the packed rows: the mask is causal inside each
    sequence (a tree's own tokens also see its shared run) and lets each padding column see the padding before it in
    its row (no row of the mask is empty).
    Boolean (True: attend) unless ``mask_dtype``, then additive (0 or the dtype's lowest value)."""
    r, w = packing.rows, packing.width
    device = input_ids.device
    ids = torch.full((r * w,), pad_id, dtype=input_ids.dtype, device=device)
    ids[packing.target] = input_ids.reshape(-1)[packing.source]
    positions = torch.zeros(r * w, dtype=torch.long, device=device)
    positions[packing.target] = packing.positions
    segment = -1 - torch.arange(r * w, device=device) // w  # padding: one segment per row
    segment[packing.target] = packing.owner if packing.segment is None else packing.segment
    segment = segment.view(r, w)
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    mask = segment.unsqueeze(2) == segment.unsqueeze(1)  # [R, W, W]
    if packing.group is not None:  # a tree's own tokens also see its shared run
        group = torch.full((r * w,), -1, dtype=torch.long, device=device)
        group[packing.target] = packing.group
        shared = torch.zeros(r * w, dtype=torch.bool, device=device)
        shared[packing.target] = packing.segment >= packing.length.numel()
        group, shared = group.view(r, w), shared.view(r, w)
        mask |= (group.unsqueeze(2) == group.unsqueeze(1)) & (group >= 0).unsqueeze(2) & shared.unsqueeze(1)
    mask &= causal
    mask = mask.unsqueeze(1)
    if mask_dtype is not None:
        mask = torch.zeros(mask.shape, dtype=mask_dtype, device=device).masked_fill(~mask, torch.finfo(mask_dtype).min)
    return ids.view(r, w), positions.view(r, w), mask


def unpack_columns(packing: Packing, hidden: Tensor, columns: Tensor) -> Tensor:
    """``[N, len(columns), H]`` the packed states ``hidden`` ``[R, W, H]`` at the padded ``columns`` of each
    sequence (zeros where a column holds none of its tokens; a shared token's state is read by every sequence that
    shares it)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    col = columns.unsqueeze(0)  # [1, C]
    inside = (col >= packing.first.unsqueeze(1)) & (col < (packing.first + packing.length).unsqueeze(1))  # [N, C]
    index = packing.origin.unsqueeze(1) + col
    if packing.split is not None:  # columns before a sequence's own run lie in its tree's shared run
        index = torch.where(col < packing.split.unsqueeze(1), packing.prefix_origin.unsqueeze(1) + col, index)
    index = index.clamp(0, flat.shape[0] - 1)
    return torch.where(inside.unsqueeze(-1), flat[index], flat.new_zeros(()))
