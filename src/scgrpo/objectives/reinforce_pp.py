"""REINFORCE++ (Hu et al., arXiv 2501.03262): critic-free, a KL-shaped per-token reward, discounted returns and
one advantage normalisation over the whole batch."""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor

from scgrpo.distributed import all_reduce
from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import Credit, CreditInputs, LossInputs, LossOutput, Needs, token_rows
from scgrpo.objectives.grpo import GRPO

Baseline = Literal["none", "group"]


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, group_size: int, kl: Optional[Tensor] = None,
                            kl_coef: float = 0.0, gamma: float = 1.0, baseline: Baseline = "none",
                            sums=None, valid: Optional[Tensor] = None, turns: Optional[Tensor] = None) -> Tensor:
    """``[N, C]`` REINFORCE++ advantages of each model token (0 elsewhere).

    The reward of token t is r_t = -kl_coef * kl_t, plus the sequence reward R on the row's last model token
    (R minus its group's mean with ``baseline="group"``, REINFORCE++-baseline). The return is
    G_t = r_t + gamma * G_{t+1} over model tokens (:func:`~scgrpo.objectives.functional.discounted_returns`), and
    the advantage is G whitened over every model token of the batch (``sums`` reduces over ranks). ``valid`` (``[N]``
    bool, None: all) leaves the other rows out of the group means (their ``mask`` is 0: out of the whitening).
    ``turns`` (``[N, C]``, :func:`turn_end_rewards`) places an episode's rewards turn by turn in place of R (R, their
    sum, still sets the group baseline, subtracted on the last model token: the same for every action of the group).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    mask = mask.to(torch.float32)
    sequence = rewards.float()
    if baseline == "group" and rewards.numel():
        if valid is None:
            valid = torch.ones_like(sequence, dtype=torch.bool)
        sequence = sequence - Fn.group_mean_std(sequence, group_size, valid)[0]
    token_rewards = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * kl.float()
    if turns is not None:  # the turns' own rewards; on the last token only the group baseline (-mean R), if any
        token_rewards = token_rewards + turns * mask
        sequence = sequence - rewards.float()
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * (columns + 1)).argmax(1)  # [N] the row's last model token (0 for a row without one)
    has_tokens = mask.sum(1) > 0
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] += sequence * has_tokens
    returns = Fn.discounted_returns(token_rewards, mask, gamma)
    return Fn.whiten(returns, mask, sums)


def turn_end_rewards(turn_rewards: Tensor, turn_index: Tensor, mask: Tensor) -> Tensor:
    """``[N, C]`` each model turn's reward r_k (``turn_rewards`` ``[N, T]``) on the turn's last model token, 0 elsewhere
    (``turn_index`` ``[N, C]``: each model token's turn, -1 elsewhere)."""
    model = (turn_index >= 0) & mask.bool()  # [N, C]
    place = turn_index.clamp(min=0)
    same_turn_next = torch.zeros_like(model)
    same_turn_next[:, :-1] = model[:, 1:] & (turn_index[:, 1:] == turn_index[:, :-1])
    last = model & ~same_turn_next  # [N, C] the last model token of each turn
    placed = turn_rewards.float().gather(1, place)
    return torch.where(last, placed, torch.zeros_like(placed))


class REINFORCEPlusPlus(GRPO):
    """REINFORCE++: each token's advantage is its discounted return of a KL-shaped reward, normalised over the
    whole batch (all ranks) instead of per group; the loss is PPO's clipped surrogate, token-mean, no KL term
    (the KL is in the reward).

    The KL of a token is estimated from the sampling policy's and the reference's log-probs of the sampled token
    (``kl_estimator``, k1 by default as in the paper's reference implementation); with ``kl_coef > 0`` the module
    runs a scoring pass for both before the update. The paper's defaults: gamma 1, clip 0.2.
    ``baseline="group"`` subtracts each group's mean reward first (the paper's REINFORCE++-baseline, meant for
    several samples per prompt).

    Args:
        kl_coef: weight of the per-token KL penalty in the reward (0: no reference model, no scoring pass).
        gamma: discount of the return over model tokens.
        baseline: ``"none"`` (REINFORCE++) or ``"group"`` (REINFORCE++-baseline).
        rewards: ``"episode"``, the episode's (or completion's) reward on its last model token, or ``"turn"``, for
            multi-turn episodes, each model turn's reward on that turn's last model token (``gamma`` discounts over
            model tokens; with ``baseline="group"`` the group's mean episode reward is subtracted on the last one).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        eps_low, eps_high, num_iterations: as in GRPO.
    """

    def __init__(
        self,
        kl_coef: float = 0.01,
        gamma: float = 1.0,
        baseline: Baseline = "none",
        rewards: str = "episode",
        kl_estimator: Fn.KLEstimator = "k1",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        num_iterations: int = 1,
    ) -> None:
        super().__init__("none", eps_low, eps_high, 0.0, "token-mean", num_iterations)
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if baseline not in ("none", "group"):
            raise ValueError(f"baseline={baseline!r}: expected 'none' or 'group'")
        if rewards not in ("episode", "turn"):
            raise ValueError(f"rewards={rewards!r}: expected 'episode' or 'turn'")
        self.rewards = rewards
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator={kl_estimator!r}: expected 'k1', 'k2' or 'k3'")
        self.kl_coef, self.gamma, self.baseline, self.kl_estimator = kl_coef, gamma, baseline, kl_estimator

    @property
    def needs(self) -> Needs:  # the KL-shaped reward's log-probs, read by the credit
        return Needs(old_logprobs=self.num_iterations > 1 or self.kl_coef > 0, ref_logprobs=self.kl_coef > 0,
                     scored_credit=True)

    def credit(self, inputs: CreditInputs) -> Credit:
        rewards, mask, group_size = inputs.rewards, inputs.mask, inputs.group_size
        kl = None
        if self.kl_coef > 0:
            if inputs.old_logprobs is None or inputs.ref_logprobs is None:
                raise RuntimeError("REINFORCE++ with kl_coef > 0 needs the scoring pass's sampling and reference "
                                   "log-probs; the module did not provide them")
            kl = self.token_kl(inputs.old_logprobs, inputs.ref_logprobs, mask)

        def over_ranks(values: list[float]) -> list[float]:
            return all_reduce(values, device=mask.device)

        turns = None
        if self.rewards == "turn":
            if inputs.turn_rewards is None or inputs.turn_index is None:
                raise ValueError("REINFORCEPlusPlus(rewards='turn') credits the turns of episodes, and this run's "
                                 "rollouts are single completions; set model.environment, or rewards: episode")
            turns = turn_end_rewards(inputs.turn_rewards, inputs.turn_index, mask)
        token_advantages = reinforce_pp_advantages(rewards, mask, group_size, kl, self.kl_coef, self.gamma,
                                                   self.baseline, sums=over_ranks, valid=inputs.valid, turns=turns)
        # per row: the mean token advantage (what a row-level reader of the credit sees; the loss uses the tokens')
        advantages = Fn.masked_mean(token_advantages, mask, dim=1)
        return Credit(advantages=advantages, token_advantages=token_advantages)

    def loss(self, logprobs: Tensor, inputs: LossInputs) -> LossOutput:
        out = super().loss(logprobs, inputs)
        if self.kl_coef > 0 and inputs.ref_logprobs is not None:  # the reward's KL, logged as train/kl
            mask = inputs.completion_mask
            out.stats.kl = Fn.masked_mean(self.token_kl(inputs.old_logprobs, inputs.ref_logprobs, mask), mask)
        return out

    def token_kl(self, old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
        """``[N, C]`` the estimated KL of each model token, 0 elsewhere (whatever the padding holds)."""
        kl = Fn.kl_estimate(old_logprobs, ref_logprobs, self.kl_estimator)
        return torch.where(mask.bool(), kl, torch.zeros_like(kl))

    def rows_in_loss(self, credit: Credit, signal=None) -> Tensor:
        """Rows with a non-zero advantage on any token (a row can have mean 0 and still move the loss)."""
        return token_rows(credit)
