"""GRPO on the high-entropy minority of tokens (Beyond the 80/20 Rule, arXiv 2506.01939)."""

from __future__ import annotations

import dataclasses

from torch import Tensor

from scgrpo.distributed import gather_values
from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import Needs
from scgrpo.objectives.grpo import GRPO


class HighEntropyGRPO(GRPO):
    """The policy-gradient term restricted to the tokens whose entropy is in the batch's top ``rho`` share
    ("forking tokens"); the others get no policy gradient. The threshold is the (1 - rho) quantile of the
    entropies of all completion tokens of the rollout batch on all ranks, under pi_old. As in the paper
    (and TRL), the loss is still divided by all response tokens, not by the selected ones, and a KL term
    (beta > 0) covers every token.

    Args:
        rho: share of tokens kept (0.2 in the paper).
        (and GRPO's arguments; the paper pairs it with DAPO's clip-higher: eps_high=0.28)
    """

    def __init__(
        self,
        rho: float = 0.2,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        beta: float = 0.0,
        aggregation: Fn.Aggregation = "token-mean",
        num_iterations: int = 1,
    ) -> None:
        super().__init__(scale, eps_low, eps_high, beta, aggregation, num_iterations)
        if not 0.0 < rho <= 1.0:
            raise ValueError(f"rho must be in (0, 1], got {rho}")
        self.rho = rho

    @property
    def needs(self) -> Needs:  # the batch's entropies, for the token mask
        return dataclasses.replace(super().needs, batch_entropy=True)

    def token_mask(self, entropy: Tensor, mask: Tensor) -> Tensor:
        values = gather_values(entropy[mask.bool()].float())  # [M] every rank's response tokens
        if values.numel() == 0:
            return mask
        threshold = Fn.quantile(values, 1.0 - self.rho)
        return mask * (entropy >= threshold).to(mask.dtype)
