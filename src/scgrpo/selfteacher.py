"""The self-teacher view: which verified reference each rollout is shown, and the teacher's input."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import torch
from torch import Tensor

from scgrpo.data.buffer import VerifiedBuffer
from scgrpo.rollout.types import RolloutBatch


def choose_references(
    rollouts: RolloutBatch,
    rows: Sequence[int],
    threshold: float,
    buffer: Optional[VerifiedBuffer],
    num_references: int = 1,
    seed: int = 0,
    step: int = 0,
) -> list[list[str]]:
    """For each row in ``rows``, up to ``num_references`` verified completions of the same prompt to show the
    teacher. Candidates: the other successful rollouts of the row's group first, then the buffer's entries
    (earlier steps) that differ from the row; a rollout is never its own reference. The choice is random,
    seeded by (seed, step, prompt id, place in the group), so it is reproducible and does not depend on
    how the batch is split over ranks. An empty list means no reference (weight 1)."""
    assert rollouts.rewards is not None
    rewards = rollouts.rewards.tolist()
    g = rollouts.group_size
    chosen: list[list[str]] = []
    for i in rows:
        own_tokens = rollouts.completion_ids[i][rollouts.completion_mask[i].bool()].tolist()
        start = (i // g) * g
        group = [rollouts.completions[j] for j in range(start, start + g) if j != i and rewards[j] >= threshold]
        stored = buffer.get(rollouts.sample_ids[i]) if buffer is not None else []
        from_buffer = [e.text for e in stored if e.token_ids != own_tokens]
        rng = random.Random(f"{seed}-{step}-{rollouts.sample_ids[i]}-{i % g}")  # the same on any number of ranks
        picks = rng.sample(group, min(num_references, len(group)))
        if len(picks) < num_references and from_buffer:
            picks += rng.sample(from_buffer, min(num_references - len(picks), len(from_buffer)))
        chosen.append(picks)
    return chosen


def teacher_inputs(
    module, rollouts: RolloutBatch, rows: Tensor, references: list[str], template: str
) -> tuple[Tensor, Tensor]:
    """Input ids and attention mask ``[n, Tt + C]`` of the teacher view for ``rows``: a user turn showing the
    question and a reference (``template``), then the same completion tokens the rollout sampled."""
    questions = [template.format(question=rollouts.questions[i], reference=ref) for i, ref in zip(rows.tolist(), references)]
    encoded = module.tokenizer(module.format_prompts(questions), return_tensors="pt", padding=True, add_special_tokens=False)
    device = rollouts.completion_ids.device
    ids = torch.cat([encoded["input_ids"].to(device), rollouts.completion_ids[rows]], dim=1)  # [n, Tt + C]
    mask = torch.cat([encoded["attention_mask"].to(device), rollouts.completion_mask[rows].long()], dim=1)
    return ids, mask
