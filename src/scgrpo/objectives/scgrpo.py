"""SC-GRPO: Self-Conditioned GRPO (arXiv 2606.18810), as defined in this package's design reference."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.grpo import GRPO

DEFAULT_TEACHER_TEMPLATE = "{question}\n\nA verified solution:\n{reference}\n\nSolve the problem again."


class SCGRPO(GRPO):
    """GRPO whose advantage is weighted token by token by how much a self-teacher disagrees with the policy.

    For each rollout y_i with a verified reference y* (another successful rollout of its group, else one
    from the verified-trajectory buffer; never y_i itself), the same network with no gradient reads a
    context that shows y* (``teacher_template``) and then y_i. The per-token divergence d_t between that
    self-teacher's and the sampling policy's next-token distributions (full vocabulary, fp32) becomes the
    weight w_t = min(d_t / mean_{t'} d_t', w_max), mixed as (1 - lam) + lam * w_t, on the GRPO surrogate:
    each token's advantage is w_t * A_i. The mean weight of a sequence is 1 before clipping, so the update
    moves as much gradient mass as GRPO's but towards the tokens the self-teacher disagrees with. A rollout
    with no reference keeps weight 1 (plain GRPO).

    Departures from a literal reading of the abstract: the divergence is computed once per rollout batch
    under pi_old (with mu > 1 the later passes reuse it), and only for rollouts whose advantage is non-zero,
    since the others contribute nothing to the loss.

    Args:
        w_max: cap on a token's weight.
        lam: mix between uniform credit (0) and divergence-proportional credit (1).
        divergence: "forward_kl" KL(p_T || p_S), "reverse_kl", "jsd", or "sampled" |log p_T(y) - log p_S(y)|.
        teacher: "policy" (current weights, no gradient) or "base" (adapters disabled).
        num_references: references per rollout; their divergences are averaged.
        teacher_template: the teacher's user turn, with {question} and {reference}.
        seed: seeds the choice of references (with the step and the row).
        (and GRPO's arguments)
    """

    uses_teacher = True
    teacher_signal = "weights"  # the module computes divergences and calls token_weights

    def __init__(
        self,
        w_max: float = 5.0,
        lam: float = 1.0,
        divergence: Fn.Divergence = "forward_kl",
        teacher: Literal["policy", "base"] = "policy",
        num_references: int = 1,
        teacher_template: str = DEFAULT_TEACHER_TEMPLATE,
        seed: int = 0,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        beta: float = 0.0,
        aggregation: Fn.Aggregation = "token-mean",
        num_iterations: int = 1,
    ) -> None:
        super().__init__(scale, eps_low, eps_high, beta, aggregation, num_iterations)
        if w_max <= 0:
            raise ValueError(f"w_max must be > 0, got {w_max}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        if divergence not in Fn.DIVERGENCES:
            raise ValueError(f"divergence={divergence!r}: expected one of {Fn.DIVERGENCES}")
        if teacher not in ("policy", "base"):
            raise ValueError(f"teacher={teacher!r}: expected 'policy' or 'base'")
        if num_references < 1:
            raise ValueError(f"num_references must be >= 1, got {num_references}")
        if "{question}" not in teacher_template or "{reference}" not in teacher_template:
            raise ValueError("teacher_template must contain {question} and {reference}")
        self.w_max, self.lam, self.divergence, self.teacher = w_max, lam, divergence, teacher
        self.num_references, self.teacher_template, self.seed = num_references, teacher_template, seed

    def token_weights(self, divergence: Tensor, mask: Tensor, has_reference: Tensor) -> Tensor:
        """``[n, C]`` weights from ``[n, C]`` divergences; rows without a reference get weight 1."""
        weights = Fn.credit_weights(divergence, mask, self.w_max, self.lam)
        return weights.where(has_reference.unsqueeze(1), mask.to(weights.dtype))
