"""Additive self-distillation, the baseline of SC-GRPO's RQ1 (§7.1, Table 2): L_GRPO + beta * L_distill."""

from __future__ import annotations

import dataclasses

from typing import Literal, Optional

import torch
from torch import Tensor

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import Credit, LossInputs, LossOutput
from scgrpo.objectives.grpo import GRPO
from scgrpo.objectives.scgrpo import check_teacher_template
from scgrpo.rollout.types import DEFAULT_TEACHER_TEMPLATE, TeacherSignal, TeacherSpec


class SelfDistillation(GRPO):
    """GRPO plus a distillation term towards the self-teacher: the same network, no gradient, shown one of
    its own verified rollouts (a correct rollout of the group with other tokens; never the row itself) in its
    system prompt, on the student's own rollouts. Every rollout whose group has such a reference gets the
    term; L_distill is each sequence's token mean of the divergence, averaged over those rollouts (Eq. 2),
    with the gradient through the student only.

    The paper's analysis (Appendix A) predicts that this pulls the student towards an average of the
    teachers conditioned on different solutions; SC-GRPO uses the same divergence as a weight instead.

    Args:
        divergence: "forward_kl" KL(teacher || student), "reverse_kl", or "bidirectional"
            (``bidirectional_mix`` x forward + (1 - ``bidirectional_mix``) x reverse).
        distill_coef: beta, the weight of L_distill (paper: 0.1).
        distill_coef_start: with ``warmup_steps``, beta rises linearly from this value (paper: 0.03 -> 0.1).
        warmup_steps: optimiser steps of the linear warm-up (0 = fixed beta).
        bidirectional_mix: share of the forward direction in "bidirectional".
        teacher, teacher_template, buffer_references, seed: as in SCGRPO.
        (and GRPO's clip, advantage and aggregation arguments; no KL-to-reference term)
    """

    def __init__(
        self,
        divergence: Literal["forward_kl", "reverse_kl", "bidirectional"] = "forward_kl",
        distill_coef: float = 0.1,
        distill_coef_start: Optional[float] = None,
        warmup_steps: int = 0,
        bidirectional_mix: float = 0.5,
        teacher: Literal["policy", "base"] = "policy",
        teacher_template: str = DEFAULT_TEACHER_TEMPLATE,
        buffer_references: bool = False,
        seed: int = 0,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        aggregation: Fn.Aggregation = "seq-mean-token-mean",
        num_iterations: int = 1,
    ) -> None:
        super().__init__(scale, eps_low, eps_high, 0.0, aggregation, num_iterations)
        if divergence not in ("forward_kl", "reverse_kl", "bidirectional"):
            raise ValueError(f"divergence={divergence!r}: expected 'forward_kl', 'reverse_kl' or 'bidirectional'")
        if distill_coef < 0 or (distill_coef_start is not None and distill_coef_start < 0):
            raise ValueError("distill_coef and distill_coef_start must be >= 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not 0.0 <= bidirectional_mix <= 1.0:
            raise ValueError(f"bidirectional_mix must be in [0, 1], got {bidirectional_mix}")
        self.divergence, self.distill_coef, self.distill_coef_start = divergence, distill_coef, distill_coef_start
        self.warmup_steps, self.bidirectional_mix = warmup_steps, bidirectional_mix
        self.teacher = TeacherSpec(routes=("partial", "single", "all"), template=check_teacher_template(teacher_template),
                                   weights=teacher, output="hidden", buffer_references=buffer_references, seed=seed)

    def coefficient(self, step: int) -> float:
        """beta at optimiser step ``step``: fixed, or linear from ``distill_coef_start`` over ``warmup_steps``."""
        if self.distill_coef_start is None or self.warmup_steps == 0:
            return self.distill_coef
        t = min(step / self.warmup_steps, 1.0)
        return self.distill_coef_start + t * (self.distill_coef - self.distill_coef_start)

    def rows_in_loss(self, credit: Credit, signal: Optional[TeacherSignal]) -> Tensor:
        keep = credit.advantages != 0
        return keep | signal.has_teacher if signal is not None else keep

    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        grpo = super().loss(logprobs, inputs)
        distill, divergence = Fn.distillation_loss(inputs, self.divergence, self.bidirectional_mix)
        beta = self.coefficient(inputs.step)
        stats = dataclasses.replace(grpo.stats, distill_kl=divergence, distill_coef=torch.tensor(beta))
        return LossOutput(loss=grpo.loss + beta * distill, stats=stats)
