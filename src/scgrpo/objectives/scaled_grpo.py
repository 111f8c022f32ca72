"""GRPO shrunk as SC-GRPO shrinks it, without targeting: a control for SC-GRPO's weights (ours, DESIGN §4.2)."""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import NAN, Credit, CreditInputs, row_advantages
from scgrpo.objectives.scgrpo import SCGRPO
from scgrpo.rollout.types import DEFAULT_TEACHER_TEMPLATE


class ScaledGRPO(SCGRPO):
    """GRPO whose advantage on each row that had a teacher is scaled by the step's mean weight f(D) over the
    active tokens (SC-GRPO's f, its routing and its c, solve-none rows' tokens included): SC-GRPO's shrinkage of
    the step on average, spread evenly over every row's tokens, so none of it says *where* a row's credit lies.
    (Under seq-mean-token-mean SC-GRPO shrinks each row by its own mean f; this control gives every row the step's
    token mean, so rows of other lengths or routes are shrunk by slightly more or less than SC-GRPO shrinks them.)

    Beside SC-GRPO with ``permute_weights`` (each row's own weights shuffled) it separates targeting from
    shrinkage: SC-GRPO's claim is that it beats both. Unlike SC-GRPO, solve-none groups keep GRPO's advantage 0
    (it is GRPO; the self-teacher still scores them so that c and the mean f are the ones SC-GRPO's step has).
    With ``c_scope="micro_batch"`` the mean is this rank's.

    Args: SC-GRPO's that set f (``c_quantile``, ``c_min``, ``c_fixed``, ``c_scope``, the routes, ``divergence``,
        ``teacher``, ``teacher_template``, ``seed``) and GRPO's.
    """

    def __init__(
        self,
        c_quantile: float = 0.75,
        c_min: float = 1e-4,
        c_fixed: Optional[float] = None,
        c_scope: Literal["batch", "micro_batch"] = "batch",
        route_solve_none: bool = True,
        route_single: bool = False,
        route_all: bool = False,
        divergence: Fn.Divergence = "forward_kl",
        teacher: Literal["policy", "base"] = "policy",
        teacher_template: str = DEFAULT_TEACHER_TEMPLATE,
        seed: int = 0,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        beta: float = 0.0,
        aggregation: Fn.Aggregation = "seq-mean-token-mean",
        num_iterations: int = 1,
    ) -> None:
        super().__init__(c_quantile=c_quantile, c_min=c_min, c_fixed=c_fixed, c_scope=c_scope,
                         route_solve_none=route_solve_none, route_single=route_single, route_all=route_all,
                         divergence=divergence, teacher=teacher, teacher_template=teacher_template, seed=seed,
                         scale=scale, eps_low=eps_low, eps_high=eps_high, beta=beta, aggregation=aggregation,
                         num_iterations=num_iterations)

    def credit(self, inputs: CreditInputs) -> Credit:
        weighted = super().credit(inputs)  # f, c and its statistics
        mask, signal = inputs.mask, inputs.signal
        mean_f = weighted.stats.f_mean
        scale = 1.0 if math.isnan(mean_f) else mean_f  # (NaN: no row had a teacher)
        has_teacher = signal.has_teacher.unsqueeze(1)  # [N, 1]
        weights = torch.where(has_teacher, mask.float() * scale, mask.float())  # [N, C] one value per teacher row
        weighted.stats.div_adv_std = NAN  # (no diversity advantage here)
        return Credit(advantages=row_advantages(self, inputs), token_weights=weights,
                      stats=weighted.stats)
