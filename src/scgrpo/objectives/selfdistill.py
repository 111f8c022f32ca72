"""Self-distillation towards the self-teacher (OPSD-style; arXiv 2601.18734, SDPO 2601.20802)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import LossInputs, LossOutput
from scgrpo.objectives.grpo import GRPO
from scgrpo.objectives.scgrpo import DEFAULT_TEACHER_TEMPLATE


class SelfDistillation(GRPO):
    """On-policy self-distillation: the loss is the per-token KL between the self-teacher (the same network,
    no gradient, shown a verified solution of the prompt) and the policy, on the policy's own rollouts,
    with the gradient through the student. Optionally ``grpo_coef`` times the GRPO loss is added.

    The baseline that SC-GRPO's paper argues against: distilling towards a teacher conditioned on one of
    several verified solutions pulls the student towards their weighted average. Rollouts without a
    reference contribute no distillation loss. The KL is token-mean over the tokens of rollouts that have one.

    Args:
        divergence: "forward_kl" KL(p_T || p_S) or "reverse_kl" KL(p_S || p_T).
        teacher, num_references, teacher_template, seed: as in SC-GRPO (the first reference is used).
        grpo_coef: weight of the GRPO term (0 = pure distillation).
    """

    uses_teacher = True
    teacher_signal = "distill"  # the module computes the differentiable per-token KL

    def __init__(
        self,
        divergence: Literal["forward_kl", "reverse_kl"] = "forward_kl",
        teacher: Literal["policy", "base"] = "policy",
        teacher_template: str = DEFAULT_TEACHER_TEMPLATE,
        seed: int = 0,
        grpo_coef: float = 0.0,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        num_iterations: int = 1,
    ) -> None:
        super().__init__(scale, eps_low, eps_high, 0.0, "token-mean", num_iterations)
        if divergence not in ("forward_kl", "reverse_kl"):
            raise ValueError(f"divergence={divergence!r}: expected 'forward_kl' or 'reverse_kl'")
        if teacher not in ("policy", "base"):
            raise ValueError(f"teacher={teacher!r}: expected 'policy' or 'base'")
        if grpo_coef < 0:
            raise ValueError(f"grpo_coef must be >= 0, got {grpo_coef}")
        self.divergence, self.teacher, self.teacher_template = divergence, teacher, teacher_template
        self.seed, self.grpo_coef, self.num_references = seed, grpo_coef, 1

    def skips_zero_advantage_rows(self) -> bool:
        return False  # the distillation term does not depend on the advantage

    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        if inputs.distill_kl is None or inputs.has_reference is None:
            raise RuntimeError("SelfDistillation needs the module's teacher pass (distill_kl, has_reference)")
        mask = inputs.completion_mask * inputs.has_reference.unsqueeze(1).to(inputs.completion_mask.dtype)
        num_tokens = inputs.num_distill_tokens if inputs.num_distill_tokens is not None else mask.sum().clamp(min=1.0)
        loss = Fn.masked_sum(inputs.distill_kl, mask) / num_tokens
        stats = {"distill_kl": Fn.masked_mean(inputs.distill_kl.detach(), mask)}
        if self.grpo_coef > 0:
            grpo = super().loss(logprobs, inputs)
            loss = loss + self.grpo_coef * grpo.loss
            stats.update(grpo.stats)
        else:
            stats["clip_fraction"] = torch.zeros((), device=logprobs.device)
        return LossOutput(loss=loss, stats=stats)
