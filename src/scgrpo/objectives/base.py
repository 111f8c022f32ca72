"""The interface every objective implements, and the inputs the module hands it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Optional

from torch import Tensor

if TYPE_CHECKING:
    from scgrpo.rollout.types import TeacherSignal, TeacherSpec


NAN = float("nan")


@dataclass
class CreditStats:
    """SC-GRPO's credit of a step, logged as ``credit/<name>`` every step (NaN where undefined)."""

    c: float = NAN
    """The constant of f(D) = D / (D + c) (mean over row blocks when c is taken per micro-batch)"""
    kl_p25: float = NAN
    """Percentiles of D over the active tokens"""
    kl_p50: float = NAN
    kl_p75: float = NAN
    kl_p95: float = NAN
    f_mean: float = NAN
    """Mean weight f(D) over the active tokens"""
    f_above_half: float = NAN
    """Share of active tokens with f(D) > 0.5"""
    div_adv_std: float = NAN
    """Std of the diversity advantages of solve-none rows"""

    def metrics(self) -> dict[str, float]:
        return {f"credit/{f.name}": getattr(self, f.name) for f in fields(self)}


@dataclass
class Credit:
    """How an objective turns a step's rewards (and self-teacher signal) into per-row and per-token credit."""

    advantages: Tensor  # [N] float
    token_weights: Optional[Tensor] = None  # [N, C] fp32 per-token weight on the surrogate; None = all ones
    token_advantages: Optional[Tensor] = None  # [N, C] fp32 per-token advantages (REINFORCE++); None = advantages
    stats: Optional[CreditStats] = None  # logged every step by objectives that weight tokens


@dataclass
class LossInputs:
    """What the module knows about the rows whose loss is being computed (``n`` rows of a batch of ``N``)."""

    completion_mask: Tensor  # [n, C] float, the response tokens
    advantages: Tensor  # [n] float
    old_logprobs: Tensor  # [n, C] fp32, log pi_old(y_t)
    token_advantages: Optional[Tensor] = None  # [n, C] fp32, per-token advantages replacing ``advantages``
    ref_logprobs: Optional[Tensor] = None  # [n, C] fp32, log pi_ref(y_t), when the objective uses a KL term
    token_weights: Optional[Tensor] = None  # [n, C] fp32 per-token credit (SC-GRPO's f(D)); None means all ones
    token_selection: Optional[Tensor] = None  # [n, C] 0/1: tokens whose policy-gradient term counts (80/20)
    entropy: Optional[Tensor] = None  # [n, C] fp32, detached
    hidden: Optional[Tensor] = None  # [n, C, H] the student's final hidden states (differentiable)
    lm_head: Optional[Callable[[Tensor], Tensor]] = None  # the output head, for distillation terms
    teacher_hidden: Optional[Tensor] = None  # [n, C, H] the self-teacher's states (teacher output "hidden")
    has_teacher: Optional[Tensor] = None  # [n] bool
    num_teacher_rows: Optional[float] = None  # rows with a teacher in the whole batch, all ranks
    num_tokens: Optional[float] = None  # completion tokens in the whole batch (loss denominator)
    num_sequences: Optional[float] = None  # rows in the whole batch
    max_len: Optional[int] = None  # max_new_tokens, for constant-length normalisation
    temperature: float = 1.0  # the sampling temperature (distributions are compared at it)
    chunk_size: int = 1024  # tokens per chunk of full-vocabulary logits
    step: int = 0  # the optimiser step (warm-up schedules)


@dataclass
class LossStats:
    """Detached scalars an objective's loss reports, logged as ``train/<name>`` (None: not this objective's)."""

    kl: Optional[Tensor] = None
    """k3 estimate of KL(policy || reference) over the response tokens (beta > 0)"""
    clip_fraction: Optional[Tensor] = None
    """Share of response tokens whose ratio was clipped"""
    distill_kl: Optional[Tensor] = None
    """The distillation term's divergence (self-distillation, OPSD)"""
    distill_coef: Optional[Tensor] = None
    """The distillation coefficient at this step"""
    extra: dict[str, Tensor] = field(default_factory=dict)
    """A custom objective's own statistics"""

    def items(self) -> list[tuple[str, Tensor]]:
        """(name, value) of every statistic reported, in a fixed order."""
        named = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "extra"]
        return [(name, value) for name, value in named if value is not None] + list(self.extra.items())


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    stats: LossStats = field(default_factory=LossStats)


class Objective(ABC):
    """An RLVR objective: how rewards become advantages and how log-probs become a loss.

    Subclasses are chosen in YAML by ``class_path``. Attributes the training loop reads:
    ``num_iterations`` (mu, optimisation passes over one rollout batch), ``beta`` (weight of a KL term to the
    reference policy; > 0 makes the module compute reference log-probs), ``teacher`` (the self-teacher the
    objective needs, or None).
    """

    num_iterations: int = 1
    beta: float = 0.0
    teacher: Optional["TeacherSpec"] = None  # the module runs the self-teacher with this spec once per step
    dynamic_sampling: bool = False  # the rollout stage resamples groups with equal rewards (DAPO)
    needs_batch_entropy: bool = False  # the module scores the whole batch's token entropies first
    scored_credit: bool = False  # credit() takes the scoring pass's log-probs (keywords old_logprobs, ref_logprobs)

    @property
    def needs_old_logprobs(self) -> bool:
        """The scoring pass computes the sampled tokens' log-probs under the sampling weights before the update."""
        return self.num_iterations > 1

    @property
    def needs_ref_logprobs(self) -> bool:
        """The scoring pass computes their log-probs under the reference (the base model, adapters off)."""
        return self.beta > 0

    @abstractmethod
    def advantages(self, rewards: Tensor, group_size: int) -> Tensor:
        """``[N]`` rewards (groups adjacent) -> ``[N]`` advantages."""

    @abstractmethod
    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        """``[n, C]`` differentiable log-probs of the sampled tokens -> scalar loss."""

    def credit(self, rewards: Tensor, mask: Tensor, group_size: int, signal: Optional["TeacherSignal"],
               micro_batch_size: Optional[int] = None) -> Credit:
        """Per-row advantages and per-token weights for the step; ``mask`` is ``[N, C]``, ``micro_batch_size``
        the rows per forward pass (None: all). By default the group advantages and no weights. An objective with
        ``scored_credit`` also receives ``old_logprobs`` and ``ref_logprobs`` (``[N, C]`` fp32 or None) as
        keyword arguments."""
        return Credit(advantages=self.advantages(rewards, group_size))

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_len: Optional[int]) -> Tensor:
        """Rewards after objective-specific shaping (DAPO's overlong penalty); ``lengths`` is ``[N]``."""
        return rewards

    def token_mask(self, entropy: Tensor, mask: Tensor) -> Tensor:
        """Which tokens' policy-gradient terms count, given the batch's ``[N, C]`` entropies (needs_batch_entropy)."""
        return mask

    def rows_in_loss(self, credit: Credit, signal: Optional["TeacherSignal"]) -> Tensor:
        """``[N]`` bool: rows that can change the loss. Rows with zero advantage add exactly nothing to a
        clipped surrogate without a KL term, so the module leaves them out of the forward pass (the loss
        denominators still count them)."""
        if self.beta > 0:
            return credit.advantages.new_ones(credit.advantages.shape, dtype=bool)
        return credit.advantages != 0
