"""GRPO over the turns of multi-turn episodes: each model turn is credited by its own return, normalised within the
group at the same turn."""

from __future__ import annotations

import torch
from torch import Tensor

from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import Credit, CreditInputs, token_rows
from scgrpo.objectives.grpo import GRPO


def turn_advantages(returns: Tensor, turn_index: Tensor, mask: Tensor, group_size: int,
                    scale: Fn.AdvantageScale = "group", valid: Tensor | None = None) -> Tensor:
    """``[N, C]`` the advantage of each model token: the return of its turn k (``returns`` ``[N, T]``), less the mean
    of the returns at turn k of the group's episodes that reached turn k, divided by their std (``scale`` as in
    :func:`~scgrpo.objectives.functional.group_advantages`). ``turn_index`` (``[N, C]``) is each token's model turn
    (-1: not the model's); ``valid`` (``[N]`` bool) leaves rows out of every statistic. A turn that fewer than 2
    episodes of a group reached gets advantage 0 there, as do tokens outside ``mask``."""
    n, t = returns.shape
    model = (turn_index >= 0) & mask.bool()  # [N, C]
    place = turn_index.clamp(min=0)
    reached = torch.zeros(n, t, device=returns.device).scatter_add_(1, place, model.float()) > 0  # [N, T]
    if valid is not None:
        reached = reached & valid.bool().unsqueeze(1)
    per_turn = torch.stack([Fn.group_advantages(returns[:, k].float(), group_size, scale, reached[:, k])
                            for k in range(t)], dim=1) if t else returns.float()  # [N, T]
    return torch.where(model, per_turn.gather(1, place), torch.zeros_like(place, dtype=per_turn.dtype))


class TurnGRPO(GRPO):
    """GRPO with turn-level credit for multi-turn episodes (``model.environment``): the tokens of model turn k are
    credited with the episode's discounted return from turn k on, R_k = sum_{j >= k} gamma^(j - k) r_j (r_j the reward
    of the environment's step after turn j, ``model.episodes.gamma``), normalised within the group over the episodes
    that reached turn k: A_{i,k} = (R_{i,k} - mean_j R_{j,k}) / (std_j R_{j,k} + 1e-4). The advantages are token
    advantages (the loss's ``token_advantages``, as REINFORCE++'s); the loss is GRPO's. With a reward only at the end
    and gamma 1, every turn of an episode has its episode's return, and turn 0 is GRPO's advantage.

    Args: GRPO's (``scale`` normalises each turn's returns: ``"group"``, ``"batch"`` over all episodes at that turn,
    ``"none"``).
    """

    def credit(self, inputs: CreditInputs) -> Credit:
        if inputs.turn_returns is None or inputs.turn_index is None:
            raise ValueError("TurnGRPO credits the turns of episodes, and this run's rollouts are single completions; "
                             "set model.environment, or use GRPO")
        token_advantages = turn_advantages(inputs.turn_returns, inputs.turn_index, inputs.mask, inputs.group_size,
                                           self.scale, inputs.valid)
        # per row: the mean token advantage (what a row-level reader of the credit sees; the loss uses the tokens')
        return Credit(advantages=Fn.masked_mean(token_advantages, inputs.mask, dim=1), token_advantages=token_advantages)

    def rows_in_loss(self, credit: Credit, signal=None) -> Tensor:
        """Rows with a non-zero advantage on any token (a row's turns may cancel out in its mean)."""
        return credit.advantages.new_ones(credit.advantages.shape, dtype=bool) if self.beta > 0 else token_rows(credit)
