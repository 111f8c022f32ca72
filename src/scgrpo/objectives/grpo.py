"""GRPO (DeepSeekMath, arXiv 2402.03300)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import LossInputs, LossOutput, LossStats, Objective


class GRPO(Objective):
    """Group Relative Policy Optimisation with the PPO clipped surrogate.

    A_i = (r_i - mean_group r) / (std_group r + 1e-4); loss = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)
    aggregated over completion tokens, plus ``beta`` times the k3 estimate of KL(pi || pi_ref) when beta > 0.

    Departures from the paper: the default aggregation is token-mean (DAPO's; the paper's is
    ``seq-mean-token-mean``) and the default beta is 0 (no reference model), as in most recent recipes.

    Args:
        scale: advantage normalisation, ``"group"`` (paper), ``"batch"`` or ``"none"`` (Dr. GRPO).
        eps_low: lower clip range of the ratio.
        eps_high: upper clip range (DAPO's clip-higher raises it to 0.28).
        beta: weight of the k3 KL penalty to the reference (the base model, adapters disabled).
        aggregation: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``.
        num_iterations: mu, optimisation passes over each rollout batch (1 = strictly on-policy).
        importance_sampling: ``"token"``, each token's ratio pi / pi_old (GRPO's), or ``"sequence"``, one ratio a
            row, the exponential of the mean of its tokens' log-ratios, clipped as a whole (GSPO, arXiv 2507.18071;
            TRL's ``importance_sampling_level="sequence"``).
    """

    def __init__(
        self,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        beta: float = 0.0,
        aggregation: Fn.Aggregation = "token-mean",
        num_iterations: int = 1,
        importance_sampling: str = "token",
    ) -> None:
        if importance_sampling not in ("token", "sequence"):
            raise ValueError(f"importance_sampling={importance_sampling!r}: expected 'token' or 'sequence'")
        if scale not in ("group", "batch", "none"):
            raise ValueError(f"scale={scale!r}: expected 'group', 'batch' or 'none'")
        if aggregation not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            raise ValueError(
                f"aggregation={aggregation!r}: expected 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"
            )
        if eps_low < 0 or eps_high < 0:
            raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
        self.scale = scale
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.beta = beta
        self.aggregation = aggregation
        self.num_iterations = num_iterations
        self.importance_sampling = importance_sampling

    def advantages(self, rewards: Tensor, group_size: int, valid: Optional[Tensor] = None) -> Tensor:
        return Fn.group_advantages(rewards, group_size, self.scale, valid)

    def per_token_advantages(self, inputs: LossInputs) -> Tensor:
        """``[n, C]`` (or broadcastable ``[n, 1]``) advantage of each token: the row's, or the objective's own
        per-token advantages (REINFORCE++); SC-GRPO multiplies in its token weights."""
        advantages = inputs.token_advantages if inputs.token_advantages is not None else inputs.advantages.unsqueeze(1)
        return advantages if inputs.token_weights is None else advantages * inputs.token_weights

    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        mask = inputs.completion_mask
        if self.importance_sampling == "sequence":  # one ratio a row: exp(mean of its tokens' log-ratios) [n, 1]
            log_ratio = Fn.masked_mean(logprobs - inputs.old_logprobs, mask, dim=1).unsqueeze(1)
            per_token, is_clipped = Fn.clipped_surrogate(
                log_ratio, torch.zeros_like(log_ratio), self.per_token_advantages(inputs), self.eps_low, self.eps_high
            )  # [n, C] (or [n, 1]: a row's advantage), the row's ratio in each of its tokens
            row_clipped = is_clipped[:, 0] if is_clipped.shape[1] == 1 else None  # (one flag a row)
            per_token, is_clipped = (t.expand_as(logprobs) for t in (per_token, is_clipped))
        else:
            row_clipped = None
            per_token, is_clipped = Fn.clipped_surrogate(
                logprobs, inputs.old_logprobs, self.per_token_advantages(inputs), self.eps_low, self.eps_high
            )  # [n, C]
        if inputs.token_selection is not None:  # only the selected tokens' policy-gradient terms count
            per_token = per_token * inputs.token_selection
            is_clipped = is_clipped * inputs.token_selection
        stats = LossStats()
        if self.beta > 0:
            if inputs.ref_logprobs is None:
                raise RuntimeError("beta > 0 needs reference log-probs; the module did not provide them")
            kl = Fn.k3_kl(logprobs, inputs.ref_logprobs)  # [n, C]
            per_token = per_token + self.beta * kl
            stats.kl = Fn.masked_mean(kl.detach(), mask)
        loss = self._aggregate(per_token, inputs)
        if row_clipped is not None and inputs.token_selection is None:  # the share of rows clipped, as TRL's
            stats.clip_fraction = Fn.masked_mean(row_clipped, (mask.sum(1) > 0).to(row_clipped.dtype))
        else:
            stats.clip_fraction = Fn.masked_mean(is_clipped, mask)
        return LossOutput(loss=loss, stats=stats)

    def _aggregate(self, per_token: Tensor, inputs: LossInputs) -> Tensor:
        return Fn.aggregate(
            per_token,
            inputs.completion_mask,
            self.aggregation,
            max_len=inputs.max_len,
            num_tokens=inputs.num_tokens,
            num_sequences=inputs.num_sequences,
        )




class GSPO(GRPO):
    """Group Sequence Policy Optimisation (Zheng et al., arXiv 2507.18071): GRPO with one importance ratio a row,
    s_i = exp(mean_t log(pi(y_t) / pi_old(y_t))), clipped as a whole: loss_i = -min(s_i A_i, clip(s_i, 1-eps_low,
    1+eps_high) A_i), averaged over rows (``seq-mean-token-mean``). The paper's clip ranges are far narrower than
    GRPO's (3e-4 and 4e-4): a sequence's ratio moves less than a token's. With ``num_iterations`` 1 every ratio is 1
    and the loss is GRPO's sequence-level policy gradient; the ratios and their clip act from the second pass on.

    Args: GRPO's; defaults ``eps_low`` 3e-4, ``eps_high`` 4e-4, ``aggregation`` seq-mean-token-mean.
    """

    def __init__(
        self,
        scale: Fn.AdvantageScale = "group",
        eps_low: float = 3e-4,
        eps_high: float = 4e-4,
        beta: float = 0.0,
        aggregation: Fn.Aggregation = "seq-mean-token-mean",
        num_iterations: int = 1,
    ) -> None:
        super().__init__(scale=scale, eps_low=eps_low, eps_high=eps_high, beta=beta, aggregation=aggregation,
                         num_iterations=num_iterations, importance_sampling="sequence")
