"""The tensors a :class:`~scgrpo.rollout.slots.SlotDecoder` keeps between its steps: the slots' state (fixed buffers
that recorded CUDA graphs reuse), the recorded prefills, the outputs, the staging buffer of kept states, and what a
call's decode loop did; and the sizes it runs at (slots within a budget, attention lengths)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


BUDGET_SHARE = 0.9
"""Share of what a memory budget leaves (beside the memory already allocated and the largest prefill's activations,
:meth:`CompactDecoder.prefill_bytes`) that the slots may take: the rest is the allocator's slack. (At 0.8 of what
was left, without the prefill counted, a 20 GiB card's 8B step gave 62 slots to 64 rows: the last two took a
second round of 1,023 decode steps, with 2.1 GiB of the budget unused.)"""


@dataclass
class PrefillGraph:
    """A prefill recorded for ``rows`` prompts of ``positions`` tokens (padded to them), with its fixed inputs."""

    graph: "torch.cuda.CUDAGraph"
    ids: Tensor  # [rows, positions]
    lengths: Tensor  # [rows]: 0 for padding rows (they write no cache entry)
    slots: Tensor  # [rows]
    logits: Tensor  # [rows, V] the recorded output
    hidden: Optional[Tensor] = None  # [rows, H] the recorded final states (keep_states)


@dataclass
class SlotState:
    """The per-slot tensors a step reads and writes (fixed buffers: a recorded graph keeps using them)."""

    tokens: Tensor  # [S] long: the token to feed next
    lens: Tensor  # [S] long: entries in the slot's cache = the next token's position
    live: Tensor  # [S] bool: the slot holds a row that has not ended
    row: Tensor  # [S] long: the output row of the slot (N = a scratch row for free slots)
    count: Tensor  # [S] long: tokens the row has produced so far
    cache: Tensor  # [layers, 2, S, kv_heads, Lmax, head_dim]
    graphs: dict[int, "torch.cuda.CUDAGraph"] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return self.tokens.shape[0]


@dataclass
class Outputs:
    tokens: Tensor  # [N + 1, C] long, pad after the end (row N is scratch)
    logprobs: Tensor  # [N + 1, C] fp32 log-probability of each sampled token under the sampler
    entropy: Tensor  # [N + 1] fp32 summed sampling entropy
    count: Tensor  # [N + 1] long tokens produced


@dataclass
class Stage:
    """The final states of the tokens emitted since the host last emptied it (``keep_states``): entry ``k`` of each
    emission, one column per slot."""

    hidden: Tensor  # [K, S, H] in the model dtype
    row: Tensor  # [K, S] long: the output row of each state (the scratch row N: none)
    at: Tensor  # [K, S] long: its completion column
    k: Tensor  # [1] long: emissions since the last emptying
    host: Tensor  # [K, S, H] the host's copy of ``hidden`` (pinned on a GPU: copied while the next steps run)
    host_row: Tensor  # [K, S] the host's copy of ``row``
    host_at: Tensor  # [K, S] the host's copy of ``at``


@dataclass
class LoopStats:
    """What one call's decode loop did, for :attr:`SlotDecoder.stats`."""

    slots: int  # the slots it started with
    steps: int = 0  # decode steps
    prefills: int = 0  # prefill rounds (each admits one or more rows)
    compactions: int = 0
    slot_steps: float = 0.0  # steps times the slots each ran over, live or free


def length_bucket(length: int, limit: int) -> int:
    """Attention length for a step whose longest live row needs ``length`` entries: rounded up to a multiple of
    64 (256 past 1,024), at most ``limit``. Few buckets = few CUDA graphs; a bucket reads at most 63 (255)
    entries more than needed."""
    width = 64 if length <= 1024 else 256
    return min(limit, int(math.ceil(length / width) * width))


def slots_within(budget: int, allocated: int, per_row: int, rows: int, workspace: int = 0) -> int:
    """Decode slots for ``rows`` rows whose KV cache and logits take ``per_row`` bytes each: as many as
    :data:`BUDGET_SHARE` of what a ``budget`` (bytes, the whole process) leaves beside ``allocated`` and the
    ``workspace`` (a prefill's activations) holds, at least one."""
    return max(1, min(rows, int(BUDGET_SHARE * max(budget - allocated - workspace, 0) // max(per_row, 1))))
