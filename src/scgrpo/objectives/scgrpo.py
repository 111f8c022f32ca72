"""SC-GRPO: Self-Conditioned GRPO (arXiv 2606.18810, §5)."""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor

from scgrpo.distributed import gather_values
from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import NAN, Credit, CreditInputs, CreditStats, row_advantages
from scgrpo.objectives.grpo import GRPO
from scgrpo.rollout.types import DEFAULT_TEACHER_TEMPLATE, SOLVE_NONE, TeacherSignal, TeacherSpec

KL_PERCENTILES = (25, 50, 75, 95)


def check_teacher_template(template: str) -> str:
    if "{reference}" not in template:
        raise ValueError("teacher_template must contain {reference} (the verified solution shown to the teacher)")
    if "{question}" in template:
        raise ValueError("teacher_template takes {reference} only: it is the teacher's system-prompt block, and the "
                         "question stays in the user turn, as the student sees it")
    return template


class SCGRPO(GRPO):
    """GRPO whose per-token gradient is shrunk where the policy's own verified solution would not change its
    prediction (the paper's J_SC-GRPO, DESIGN §2):

    - self-teacher: the same network, no gradient, with a reference trajectory tau in its system prompt only;
      D_i,t = KL(teacher || policy) on the rollout's own tokens, full vocabulary, fp32 logits, clamped at 0;
    - weight f(D) = D / (D + c) in [0, 1) with c = max(P_q(D_act), c_min) over the active tokens (response
      tokens of rows that have a teacher); it multiplies both signs of the advantage and is never renormalised;
    - routing by the number of correct rollouts n_c: partial-solve groups (2 <= n_c < G) are weighted with a
      correct sibling (other tokens) as tau and keep GRPO's advantage; solve-none groups (n_c = 0) draw one
      rollout o_r as every other rollout's tau and replace the zero advantage by alpha * A_div (Eq. 5), with
      s_i the mean of f(D) over t <= min(|o_i|, |o_r|), standardised over the G - 1 non-reference rollouts
      (o_r gets 0); single-correct and all-correct groups are plain GRPO (weight 1) unless routed;
    - clipped surrogate (eps 0.2), no KL term, per-sequence token mean then mean over rows.

    Choices of this package where the paper is silent: c is taken over the whole optimiser step on all ranks
    (``c_scope="batch"``) so that it does not change with micro-batch size or GPU count (``"micro_batch"``
    is the paper's literal reading); the divergence is computed once per rollout batch under pi_old (with
    mu > 1 later passes reuse it); the teacher's guide instruction is ours (``teacher_template``).

    Args:
        c_quantile: q of c = max(P_q(D_act), c_min) (paper: 0.75; 0.5 degenerates to uniform, 0.9 over-suppresses).
        c_min: floor of c.
        c_fixed: a constant c instead of the quantile.
        c_scope: "batch" (all active tokens of the step, all ranks) or "micro_batch" (each block of
            ``micro_batch_size`` rollouts of a rank's batch, in batch order).
        alpha: weight of the solve-none diversity advantage (paper: 0.1; 0.2 hurts).
        route_solve_none: give solve-none groups the diversity advantage and weights.
        route_single: weight single-correct groups too (paper ablation: entropy collapse).
        route_all: weight all-correct groups too (paper ablation: no contrast).
        divergence: forward_kl (the paper's), reverse_kl or jsd (ablations).
        teacher: "policy" (current weights, no gradient) or "base" (adapters disabled).
        teacher_template: the guide instruction with {reference}, appended to the base system prompt.
        buffer_references: a correct rollout with no distinct correct sibling (and, with route_single, a
            single-correct group's correct rollout) takes a reference from the verified buffer (ours).
        seed: seeds the choice of references.
        diversity_window: the tokens a solve-none rollout's score s_i averages over: "pair", the first
            min(|o_i|, |o_r|) (the paper's); "group", the first min_k |o_k| of its whole group, the same positions for
            every rollout (ours). f is highest at a completion's first tokens, so under "pair" a rollout that stops
            at once is scored on them alone. On countdown, which the model cannot solve, "group" did not prevent the
            collapse to one-token answers (3 of 3 seeds, docs/solve_none.md); GRPO's KL penalty ``beta`` 0.04 kept
            about half the length (``configs/ablations/kl_anchor.yaml``).
        diversity_min_tokens: a solve-none rollout whose window is shorter than this has no score and advantage 0
            (ours; 1, every rollout with a token, is the paper's).
        permute_weights: a control, not the method (ours, DESIGN §4.2): each row's weights f are shuffled over its
            model tokens before the loss, so the row keeps its weights' values, its step size and its advantage
            (the solve-none scores are taken before the shuffle) and loses only *where* the weights sit. The
            shuffle draws from torch's CPU generator, which checkpoints restore.
        (and GRPO's arguments; the paper's aggregation "seq-mean-token-mean" is the default here)
    """

    def __init__(
        self,
        c_quantile: float = 0.75,
        c_min: float = 1e-4,
        c_fixed: Optional[float] = None,
        c_scope: Literal["batch", "micro_batch"] = "batch",
        alpha: float = 0.1,
        route_solve_none: bool = True,
        route_single: bool = False,
        route_all: bool = False,
        divergence: Fn.Divergence = "forward_kl",
        teacher: Literal["policy", "base"] = "policy",
        teacher_template: str = DEFAULT_TEACHER_TEMPLATE,
        buffer_references: bool = False,
        seed: int = 0,
        diversity_window: Literal["pair", "group"] = "pair",
        diversity_min_tokens: int = 1,
        permute_weights: bool = False,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        beta: float = 0.0,
        aggregation: Fn.Aggregation = "seq-mean-token-mean",
        num_iterations: int = 1,
        w_max: Optional[float] = None,
        lam: Optional[float] = None,
    ) -> None:
        super().__init__(scale, eps_low, eps_high, beta, aggregation, num_iterations)
        if w_max is not None or lam is not None:
            raise ValueError(
                "SCGRPO no longer takes w_max / lam: the paper's weight f(D) = D / (D + c) only shrinks and is not "
                "renormalised. Set c_quantile (default 0.75), c_min or c_fixed instead")
        if not 0.0 < c_quantile < 1.0:
            raise ValueError(f"c_quantile must be in (0, 1), got {c_quantile}")
        if c_min <= 0:
            raise ValueError(f"c_min must be > 0, got {c_min}")
        if c_fixed is not None and c_fixed <= 0:
            raise ValueError(f"c_fixed must be > 0 or null, got {c_fixed}")
        if c_scope not in ("batch", "micro_batch"):
            raise ValueError(f"c_scope={c_scope!r}: expected 'batch' or 'micro_batch'")
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if divergence not in Fn.DIVERGENCES:
            raise ValueError(f"divergence={divergence!r}: expected one of {Fn.DIVERGENCES}")
        if teacher not in ("policy", "base"):
            raise ValueError(f"teacher={teacher!r}: expected 'policy' or 'base'")
        self.c_quantile, self.c_min, self.c_fixed, self.c_scope = c_quantile, c_min, c_fixed, c_scope
        self.alpha, self.divergence, self.permute_weights = alpha, divergence, permute_weights
        routes = ("partial",) + ("solve_none",) * route_solve_none + ("single",) * route_single + ("all",) * route_all
        self.teacher = TeacherSpec(routes=routes, template=check_teacher_template(teacher_template), weights=teacher,
                                   output="divergence", divergence=divergence, buffer_references=buffer_references,
                                   seed=seed, diversity_window=diversity_window,
                                   diversity_min_tokens=diversity_min_tokens)

    # --------------------------------------------------------------------------------------------- credit
    def thresholds(self, divergence: Tensor, active: Tensor, micro_batch_size: Optional[int]) -> tuple[Tensor, Tensor]:
        """c for every row ``[N, 1]`` and the active divergences of the whole step (all ranks) for statistics."""
        values = gather_values(divergence[active])  # [M] every rank's active tokens
        n = divergence.shape[0]
        if self.c_scope == "batch" or self.c_fixed is not None:
            c = Fn.credit_threshold(values, self.c_quantile, self.c_min, self.c_fixed)
            return c.to(divergence.device).expand(n, 1), values
        block = micro_batch_size or max(n, 1)
        c_rows = torch.empty(n, 1, device=divergence.device)
        for start in range(0, n, block):
            rows = slice(start, start + block)
            c_rows[rows] = Fn.credit_threshold(divergence[rows][active[rows]], self.c_quantile, self.c_min).to(divergence.device)
        return c_rows, values

    def diversity_advantages(self, f: Tensor, signal: TeacherSignal, group_size: int) -> Tensor:
        """``[N]`` alpha * A_div for the non-reference rows of solve-none groups (Eq. 5), 0 elsewhere."""
        # (a row with no token in its window, ``diversity_min_tokens``, has no score)
        scored = signal.has_teacher & (signal.route == SOLVE_NONE) & signal.diversity_mask.bool().any(1)  # [N]
        scores = Fn.masked_mean(f, signal.diversity_mask, dim=1)  # [N] s_i
        mean, std = Fn.group_mean_std(scores, group_size, scored)  # over the scored rows, the std unbiased
        # (G - 1 scored rows in a routed solve-none group; fewer where rows have no window)
        held = (scored & (Fn.group_counts(scored, group_size) >= 2)).to(scores.dtype)
        return self.alpha * (scores - mean) / (std + Fn.ADVANTAGE_EPS) * held

    def credit(self, inputs: CreditInputs) -> Credit:
        mask, group_size, signal = inputs.mask, inputs.group_size, inputs.signal
        advantages = row_advantages(self, inputs)  # [N] GRPO's A_i
        if signal is None or signal.divergence is None:
            raise RuntimeError("SCGRPO needs the self-teacher's divergences; the module did not run it")
        divergence = signal.divergence  # [N, C]
        has_teacher = signal.has_teacher.unsqueeze(1)  # [N, 1]
        active = mask.bool() & has_teacher  # [N, C]
        c_rows, values = self.thresholds(divergence, active, inputs.micro_batch_size)
        f = Fn.kl_weights(divergence, c_rows) * mask  # [N, C] in [0, 1)
        weights = torch.where(has_teacher, f, mask.to(f.dtype))  # rows without a teacher: plain GRPO
        diversity = self.diversity_advantages(f, signal, group_size)  # [N]
        if "solve_none" in self.teacher.routes:  # alpha * A_div replaces A_i in routed solve-none groups (o_r: 0);
            advantages = torch.where(signal.route == SOLVE_NONE, diversity, advantages)  # unrouted: plain GRPO
        if self.permute_weights:
            weights = torch.where(has_teacher, Fn.permute_within_rows(f, mask), weights)
        return Credit(advantages=advantages, token_weights=weights, stats=self._stats(f, active, c_rows, values,
                                                                                       diversity, signal))

    def _stats(self, f: Tensor, active: Tensor, c_rows: Tensor, values: Tensor, diversity: Tensor,
               signal: TeacherSignal) -> CreditStats:
        stats = CreditStats(c=float(c_rows.mean()) if c_rows.numel() else NAN)
        if values.numel():
            for p in KL_PERCENTILES:
                setattr(stats, f"kl_p{p}", float(Fn.quantile(values, p / 100)))
        if self.c_scope == "batch" or self.c_fixed is not None:  # one c: f of every rank's active tokens
            weights = Fn.kl_weights(values, c_rows[0, 0].to(values.device)) if c_rows.numel() else values
        else:  # c per block of rows: this rank's tokens (the module averages over ranks)
            weights = f[active]
        if weights.numel():
            stats.f_mean, stats.f_above_half = float(weights.mean()), float((weights > 0.5).float().mean())
        scored = signal.has_teacher & (signal.route == SOLVE_NONE) & signal.diversity_mask.bool().any(1)
        if int(scored.sum()) > 1:
            stats.div_adv_std = float(diversity[scored].std())
        return stats
