"""The interface every objective implements, and the inputs the module hands it."""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Optional

from torch import Tensor

if TYPE_CHECKING:
    from scgrpo.rollout.types import TeacherSignal, TeacherSpec


log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Needs:
    """What an objective needs from a training step, declared as one value (:attr:`Objective.needs`): the step runs
    these passes, and only these, and hands their results to :meth:`Objective.credit` and :meth:`Objective.loss`."""

    old_logprobs: bool = False
    """The scoring pass: the sampled tokens' log-probs under the sampling weights, before the update (several
    optimiser steps per batch, a KL-shaped reward)"""
    ref_logprobs: bool = False
    """The scoring pass under the reference, the adapters off (a KL term or a KL-shaped reward)"""
    teacher: Optional["TeacherSpec"] = None
    """The self-teacher to run once a step; its signal goes to the credit and, with ``output="hidden"``, its states
    to the loss (:class:`DistillInputs`)"""
    batch_entropy: bool = False
    """The whole batch's token entropies before the credit (:meth:`Objective.token_mask`)"""
    scored_credit: bool = False
    """The credit reads the scoring pass's log-probs (:attr:`CreditInputs.old_logprobs`, ``ref_logprobs``)"""
    resample_rounds: Optional[int] = None
    """DAPO's dynamic sampling: groups whose rewards are all equal are resampled, for at most this many extra rounds
    (None: off)"""


@dataclass
class CreditInputs:
    """What :meth:`Objective.credit` reads of a step's ``N`` rollouts with ``C`` completion slots."""

    rewards: Tensor  # [N] float, after the objective's shaping
    mask: Tensor  # [N, C] float, the model's tokens
    group_size: int  # G, group members adjacent (groups never span ranks)
    signal: Optional["TeacherSignal"] = None  # the self-teacher's signal, when the objective needs one
    micro_batch_size: Optional[int] = None  # rows per forward pass (None: all), for credit computed per block
    old_logprobs: Optional[Tensor] = None  # [N, C] fp32 from the scoring pass, with ``needs.scored_credit``
    ref_logprobs: Optional[Tensor] = None  # [N, C] fp32 from the scoring pass, with ``needs.scored_credit``
    valid: Optional[Tensor] = None  # [N] bool: rows with a reward (None: all); the others (an environment's or every
    # reward function's fault, ``episodes.on_fault: exclude``) are left out of group statistics, ``mask`` is 0 there
    turn_rewards: Optional[Tensor] = None  # [N, T] fp32 an episode's reward after each model turn (0: none)
    turn_returns: Optional[Tensor] = None  # [N, T] fp32 an episode's discounted return from each model turn on
    turn_index: Optional[Tensor] = None  # [N, C] long, the model turn of each model token (-1 elsewhere)


@dataclass
class DistillInputs:
    """What a distillation term reads (objectives whose teacher gives ``output="hidden"``), for ``n`` rows."""

    hidden: Tensor  # [n, C, H] the student's final hidden states (differentiable)
    lm_head: Callable[[Tensor], Tensor]  # the output head
    teacher_hidden: Optional[Tensor]  # [n, C, H] the self-teacher's states; 0 where no teacher (None: no teacher row)
    has_teacher: Tensor  # [n] bool
    num_teacher_rows: Optional[float] = None  # rows with a teacher in the whole batch, all ranks (None: these)


@dataclass
class LossInputs:
    """What the step knows about the rows whose loss is being computed (``n`` rows of a batch of ``N``): the
    policy-gradient core, and the typed extras of the objectives that need them."""

    completion_mask: Tensor  # [n, C] float, the response tokens
    advantages: Tensor  # [n] float
    old_logprobs: Tensor  # [n, C] fp32, log pi_old(y_t)
    token_advantages: Optional[Tensor] = None  # [n, C] fp32, per-token advantages replacing ``advantages``
    ref_logprobs: Optional[Tensor] = None  # [n, C] fp32, log pi_ref(y_t), with ``needs.ref_logprobs``
    token_weights: Optional[Tensor] = None  # [n, C] fp32 per-token credit (SC-GRPO's f(D)); None means all ones
    token_selection: Optional[Tensor] = None  # [n, C] 0/1: tokens whose policy-gradient term counts (80/20)
    entropy: Optional[Tensor] = None  # [n, C] fp32, detached
    num_tokens: Optional[float] = None  # completion tokens in the whole batch (loss denominator)
    num_sequences: Optional[float] = None  # rows in the whole batch
    max_len: Optional[int] = None  # max_new_tokens, for constant-length normalisation
    temperature: float = 1.0  # the sampling temperature (distributions are compared at it)
    chunk_size: int = 1024  # tokens per chunk of full-vocabulary logits
    step: int = 0  # the optimiser step (warm-up schedules)
    distill: Optional[DistillInputs] = None  # with a teacher of hidden states (None: the objective has none)


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


def token_rows(credit: Credit) -> Tensor:
    """``[N]`` bool: the rows with a non-zero token advantage (a row's tokens may cancel out in its mean)."""
    return (credit.token_advantages != 0).any(1)


def row_advantages(objective: "Objective", inputs: CreditInputs) -> Tensor:
    """``objective.advantages`` of the step's rewards, given ``inputs.valid`` where there are excluded rows; an
    objective whose ``advantages`` takes no ``valid`` gets the rewards alone (its group statistics then count the
    excluded rows as their reward, 0; logged once)."""
    if inputs.valid is None or bool(inputs.valid.all()):
        return objective.advantages(inputs.rewards, inputs.group_size)
    parameters = inspect.signature(objective.advantages).parameters
    if "valid" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return objective.advantages(inputs.rewards, inputs.group_size, valid=inputs.valid)
    if not getattr(objective, "_said_no_valid", False):
        objective._said_no_valid = True
        log.warning("%s.advantages takes no `valid`: this step's excluded rows (faults) count in its group statistics "
                    "as reward 0 (they stay out of the loss); add `valid=None` to it (docs/objectives.md)",
                    type(objective).__name__)
    return objective.advantages(inputs.rewards, inputs.group_size)


class Objective(ABC):
    """An RLVR objective: how rewards become advantages and how log-probs become a loss.

    Subclasses are chosen in YAML by ``class_path``. The step reads :attr:`needs` (what to compute for the
    objective) and ``num_iterations`` (mu, optimiser steps over one rollout batch); ``beta`` is the weight of a KL
    term to the reference policy and ``teacher`` the self-teacher's spec (or None), both read through
    :attr:`needs`. ``docs/extending.md`` shows a new objective added in a file of its own.
    """

    num_iterations: int = 1
    beta: float = 0.0
    teacher: Optional["TeacherSpec"] = None

    @property
    def needs(self) -> Needs:
        """What the step computes for this objective: by default the scoring pass under the sampling weights with
        mu > 1, under the reference with beta > 0, and the objective's self-teacher."""
        return Needs(old_logprobs=self.num_iterations > 1, ref_logprobs=self.beta > 0, teacher=self.teacher)

    @abstractmethod
    def advantages(self, rewards: Tensor, group_size: int, valid: Optional[Tensor] = None) -> Tensor:
        """``[N]`` rewards (groups adjacent) -> ``[N]`` advantages; ``valid`` (``[N]`` bool, None: all) marks the rows
        with a reward, the others stay out of every group statistic (their advantage is set to 0 after the credit)."""

    @abstractmethod
    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        """``[n, C]`` differentiable log-probs of the sampled tokens -> scalar loss."""

    def credit(self, inputs: CreditInputs) -> Credit:
        """Per-row advantages and per-token weights for the step. By default the group advantages and no
        weights."""
        return Credit(advantages=row_advantages(self, inputs))

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_len: Optional[int]) -> Tensor:
        """Rewards after objective-specific shaping (DAPO's overlong penalty); ``lengths`` is ``[N]``."""
        return rewards

    def token_mask(self, entropy: Tensor, mask: Tensor) -> Tensor:
        """Which tokens' policy-gradient terms count, given the batch's ``[N, C]`` entropies (``needs.batch_entropy``)."""
        return mask

    def rows_in_loss(self, credit: Credit, signal: Optional["TeacherSignal"]) -> Tensor:
        """``[N]`` bool: rows that can change the loss. Rows with zero advantage add exactly nothing to a
        clipped surrogate without a KL term, so the module leaves them out of the forward pass (the loss
        denominators still count them)."""
        if self.beta > 0:
            return credit.advantages.new_ones(credit.advantages.shape, dtype=bool)
        return credit.advantages != 0
