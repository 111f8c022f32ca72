"""OPSD-oracle: on-policy self-distillation from a teacher shown the ground-truth answer (arXiv 2601.18734;
the baseline of SC-GRPO's Table 1 and Appendix B.2)."""

from __future__ import annotations

from typing import Literal, Optional

from torch import Tensor

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import Credit, LossInputs, LossOutput, LossStats
from scgrpo.objectives.grpo import GRPO
from scgrpo.objectives.scgrpo import check_teacher_template
from scgrpo.rollout.types import TeacherSignal, TeacherSpec

ORACLE_TEMPLATE = ("The correct final answer to the problem you will be given is: {reference}\n"
                   "Work towards it in your own words.")


class OPSD(GRPO):
    """The loss is the per-token divergence between a privileged self-teacher (the same network shown the
    row's ground-truth answer in its system prompt) and the student, on the student's own rollouts, each
    token's divergence clipped at ``token_clip``, each sequence's token mean averaged over the batch. There
    is no RL term: rewards are only logged.

    Following the paper's Appendix B.2 the teacher is fixed (``teacher="base"``: the initial policy, adapters
    disabled) and the per-token JSD is clipped at 0.05; the paper also uses LoRA r 64, alpha 128 (set them in
    the config). Rows whose answer is missing get the literal text "None" as their reference.

    Args:
        divergence: "jsd" (default), "forward_kl" KL(teacher || student) or "reverse_kl".
        token_clip: cap on each token's divergence (its gradient is 0 above it); null = no cap.
        teacher: "base" (fixed, the paper's) or "policy" (current weights, no gradient).
        teacher_template: the privileged block with {reference} (the answer), appended to the system prompt.
        num_iterations: optimisation passes over each rollout batch.
    """

    def __init__(
        self,
        divergence: Literal["jsd", "forward_kl", "reverse_kl"] = "jsd",
        token_clip: Optional[float] = 0.05,
        teacher: Literal["policy", "base"] = "base",
        teacher_template: str = ORACLE_TEMPLATE,
        num_iterations: int = 1,
    ) -> None:
        super().__init__("group", 0.2, 0.2, 0.0, "seq-mean-token-mean", num_iterations)
        if divergence not in Fn.DIVERGENCES:
            raise ValueError(f"divergence={divergence!r}: expected one of {Fn.DIVERGENCES}")
        if token_clip is not None and token_clip <= 0:
            raise ValueError(f"token_clip must be > 0 or null, got {token_clip}")
        self.divergence, self.token_clip = divergence, token_clip
        self.teacher = TeacherSpec(routes=(), template=check_teacher_template(teacher_template), weights=teacher,
                                   output="hidden", privileged=True)

    def rows_in_loss(self, credit: Credit, signal: Optional[TeacherSignal]) -> Tensor:
        return signal.has_teacher if signal is not None else credit.advantages != 0

    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        loss, divergence = Fn.distillation_loss(inputs, self.divergence, token_clip=self.token_clip)
        return LossOutput(loss=loss, stats=LossStats(distill_kl=divergence))
