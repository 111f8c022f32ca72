"""The interface every objective implements, and the inputs the module hands it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass
class LossInputs:
    """What the module knows about the rows whose loss is being computed (``n`` rows of a batch of ``N``)."""

    completion_mask: Tensor  # [n, C] float
    advantages: Tensor  # [n] float
    old_logprobs: Tensor  # [n, C] fp32, log pi_old(y_t)
    ref_logprobs: Optional[Tensor] = None  # [n, C] fp32, log pi_ref(y_t), when the objective uses a KL term
    token_weights: Optional[Tensor] = None  # [n, C] fp32 per-token credit (SC-GRPO); None means all ones
    entropy: Optional[Tensor] = None  # [n, C] fp32, detached
    distill_kl: Optional[Tensor] = None  # [n, C] fp32 KL(teacher || student), differentiable (self-distillation)
    has_reference: Optional[Tensor] = None  # [n] bool, a verified reference was found for the row
    num_distill_tokens: Optional[float] = None  # tokens of rows with a reference in the whole batch
    num_tokens: Optional[float] = None  # completion tokens in the whole batch (loss denominator)
    num_sequences: Optional[float] = None  # rows in the whole batch
    max_len: Optional[int] = None  # max_new_tokens, for constant-length normalisation


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    stats: dict[str, Tensor]  # detached scalars to log, e.g. clip_fraction, kl


class Objective(ABC):
    """An RLVR objective: how rewards become advantages and how log-probs become a loss.

    Subclasses are chosen in YAML by ``class_path``. Attributes the training loop reads:
    ``num_iterations`` (mu, optimisation passes over one rollout batch), ``beta`` (weight of a KL term to the
    reference policy; > 0 makes the module compute reference log-probs).
    """

    num_iterations: int = 1
    beta: float = 0.0
    uses_teacher: bool = False  # the module runs the self-teacher view (SC-GRPO, self-distillation)
    dynamic_sampling: bool = False  # the rollout stage resamples groups with equal rewards (DAPO)
    needs_batch_entropy: bool = False  # the module scores the whole batch's token entropies first

    @abstractmethod
    def advantages(self, rewards: Tensor, group_size: int) -> Tensor:
        """``[N]`` rewards (groups adjacent) -> ``[N]`` advantages."""

    @abstractmethod
    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        """``[n, C]`` differentiable log-probs of the sampled tokens -> scalar loss."""

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_len: Optional[int]) -> Tensor:
        """Rewards after objective-specific shaping (DAPO's overlong penalty); ``lengths`` is ``[N]``."""
        return rewards

    def token_mask(self, entropy: Tensor, mask: Tensor) -> Tensor:
        """Which tokens enter the loss, given the whole batch's ``[N, C]`` entropies (needs_batch_entropy)."""
        return mask

    def skips_zero_advantage_rows(self) -> bool:
        """True when rows with zero advantage contribute exactly nothing to the gradient, so the module may
        leave them out of the forward pass (the loss denominators still count them)."""
        return self.beta == 0.0
