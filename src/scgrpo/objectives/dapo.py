"""DAPO (arXiv 2503.14476): clip-higher, token-mean loss, dynamic sampling, overlong reward shaping."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from scgrpo.objectives.base import Needs
from scgrpo.objectives.grpo import GRPO


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int) -> Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_len - buffer_len`` tokens, then falling linearly to -1 at
    ``max_len``: R_len = min(-(len - (L_max - L_buf)) / L_buf, 0). ``lengths`` is ``[N]``."""
    if buffer_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = max_len - buffer_len
    return torch.clamp(-(lengths.float() - start) / buffer_len, max=0.0)


class DAPO(GRPO):
    """Decoupled clip and dynamic sampling policy optimisation.

    Clip-higher (eps_low 0.2, eps_high 0.28), token-mean aggregation, no KL. Dynamic sampling: groups whose
    rewards are all equal are dropped and more prompts are sampled until the batch is full again, for at most
    ``max_sampling_rounds`` extra rounds (the count is logged). Overlong reward shaping adds
    ``overlong_penalty`` to the reward of completions longer than ``max_new_tokens - overlong_buffer``.

    Args:
        dynamic_sampling: drop equal-reward groups and resample.
        max_sampling_rounds: cap on extra generation rounds per step (the batch may stay short after it).
        overlong_buffer: L_buf in tokens (0 = no shaping); L_max is the generation cap.
        eps_low, eps_high, num_iterations: as in GRPO.
    """

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        dynamic_sampling: bool = True,
        max_sampling_rounds: int = 3,
        overlong_buffer: int = 0,
        num_iterations: int = 1,
    ) -> None:
        super().__init__("group", eps_low, eps_high, 0.0, "token-mean", num_iterations)
        if max_sampling_rounds < 0:
            raise ValueError(f"max_sampling_rounds must be >= 0, got {max_sampling_rounds}")
        if overlong_buffer < 0:
            raise ValueError(f"overlong_buffer must be >= 0, got {overlong_buffer}")
        self.dynamic_sampling, self.max_sampling_rounds, self.overlong_buffer = (
            dynamic_sampling, max_sampling_rounds, overlong_buffer)

    @property
    def needs(self) -> Needs:  # the rollout stage's resampling of equal-reward groups
        return dataclasses.replace(super().needs,
                                   resample_rounds=self.max_sampling_rounds if self.dynamic_sampling else None)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_len: Optional[int]) -> Tensor:
        if not self.overlong_buffer or max_len is None:
            return rewards
        return rewards + overlong_penalty(lengths, max_len, self.overlong_buffer).to(rewards.device)
