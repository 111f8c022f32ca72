"""Per-turn rewards of multi-turn episodes: each step's reward kept with the model turn it follows, discounted turn
returns (``episodes.gamma``), and TurnGRPO's advantages normalised within the group at the same turn, by hand."""

from __future__ import annotations

import csv
import glob
import itertools
import math

import pytest
import torch

from scgrpo.envs import EpisodeSettings, StepResult
from scgrpo.objectives import CreditInputs, TurnGRPO
from scgrpo.objectives.functional import group_advantages, turn_returns
from scgrpo.objectives.turn_grpo import turn_advantages
from tests.envs.scripted import Scripted
from tests.envs.test_episodes import ROWS, module, play  # noqa: F401 (module: the fixture)
from scgrpo.rollout.engine import GenerationSettings
from tests.helpers import tiny_data, tiny_module, tiny_trainer


class Graded(Scripted):
    """Three turns; each step rewards the turn by its number for odd answers (0.1, 0.2, then 1 at the end), 0 for even
    ones; ``by_text``: for replies of odd length instead, and every ``fault_every``-th step raises."""

    def __init__(self, turns: int = 3, by_text: bool = False, fault_every: int = 0) -> None:
        super().__init__(turns=turns)
        self.by_text, self.fault_every, self.calls = by_text, fault_every, itertools.count(1)

    def step(self, action):
        self.t += 1
        if self.fault_every and next(self.calls) % self.fault_every == 0:
            raise ValueError("environment broke")
        odd = len(action.text) % 2 if self.by_text else self.row["answer"] % 2
        if self.t >= self.turns:
            return StepResult(reward=float(odd), done=True)
        return StepResult(observation=f"obs{self.t}", reward=0.1 * self.t * odd)

    def spawn(self):
        twin = super().spawn()
        twin.calls = self.calls  # (one count over the episodes)
        return twin


def test_turn_returns_are_discounted_sums_of_the_later_turns_rewards():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.5, 0.0]])
    got = turn_returns(rewards, gamma=0.5)
    assert torch.allclose(got, torch.tensor([[1.0 + 0.25 * 2.0, 0.5 * 2.0, 2.0], [0.25, 0.5, 0.0]]))
    assert torch.allclose(turn_returns(rewards), torch.tensor([[3.0, 2.0, 2.0], [0.5, 0.5, 0.0]]))  # gamma 1


def test_an_episode_keeps_each_steps_reward_with_the_model_turn_before_it(module):
    _, ep = play(module, Graded(turns=3), EpisodeSettings(max_turns=3, max_episode_tokens=200))
    odd = [row["answer"] % 2 for row in ROWS for _ in range(2)]
    assert torch.allclose(ep.turn_rewards, torch.tensor([[0.1 * o, 0.2 * o, 1.0 * o] for o in odd]))
    assert ep.rewards.tolist() == pytest.approx([1.3 * o for o in odd])  # the episode's reward: the sum
    model, index = ep.completion_mask.bool(), ep.turn_index
    assert torch.equal(index >= 0, model)  # a turn for every model token, -1 for the environment's and padding
    for row in range(4):
        turns = index[row][model[row]].tolist()
        assert turns == sorted(turns) and set(turns) == {0, 1, 2}  # in order, each turn's tokens together
        # each turn's tokens run up to an observation of the environment (or the end)
        for k in (0, 1):
            last = max(i for i, t in enumerate(index[row].tolist()) if t == k)
            assert ep.env_mask[row, last + 1] == 1


def test_turn_advantages_normalise_each_turns_return_within_the_group_at_that_turn():
    # one group of 3 episodes: 2 turns each but the third, which ended after its first turn
    returns = torch.tensor([[2.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    index = torch.tensor([[0, 0, -1, 1, 1], [0, -1, 1, 1, -1], [0, 0, -1, -1, -1]])
    mask = (index >= 0).float()
    got = turn_advantages(returns, index, mask, 3)
    turn0 = group_advantages(torch.tensor([2.0, 1.0, 0.0]), 3)  # every episode reached turn 0
    turn1 = group_advantages(torch.tensor([1.0, 0.0]), 2)  # two reached turn 1
    want = torch.tensor([[turn0[0], turn0[0], 0, turn1[0], turn1[0]], [turn0[1], 0, turn1[1], turn1[1], 0],
                         [turn0[2], turn0[2], 0, 0, 0]])
    assert torch.allclose(got, want, atol=1e-6)
    by_hand = (1.0 - 0.5) / (math.sqrt(0.5) + 1e-4)  # turn 1: mean 0.5, unbiased std sqrt(0.5)
    assert got[0, 3].item() == pytest.approx(by_hand)
    # a row without a reward (a fault) is out of every turn's statistics
    valid = torch.tensor([True, True, False])
    held = turn_advantages(returns, index, mask * valid.unsqueeze(1), 3, valid=valid)
    assert held[0, 0].item() == pytest.approx(group_advantages(torch.tensor([2.0, 1.0]), 2)[0].item())
    assert held[2].abs().sum() == 0


def test_turn_grpo_credits_tokens_by_their_turn_and_refuses_single_completions():
    returns = torch.tensor([[2.0, 1.0], [1.0, 0.0]])
    index = torch.tensor([[0, 1, 1], [0, 0, 1]])
    mask = torch.ones(2, 3)
    credit = TurnGRPO().credit(CreditInputs(rewards=returns[:, 0], mask=mask, group_size=2, turn_returns=returns,
                                            turn_index=index))
    a = group_advantages(torch.tensor([2.0, 1.0]), 2)[0].item()
    assert torch.allclose(credit.token_advantages, torch.tensor([[a, a, a], [-a, -a, -a]]))
    assert TurnGRPO().rows_in_loss(credit).tolist() == [True, True]
    with pytest.raises(ValueError, match="single completions; set model.environment, or use GRPO"):
        TurnGRPO().credit(CreditInputs(rewards=returns[:, 0], mask=mask, group_size=2))


def test_two_steps_with_turn_rewards_and_a_faulty_environment_train_on_the_valid_episodes(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, environment=Graded(turns=3, by_text=True, fault_every=7),
                         objective=TurnGRPO(), dtype="float32",
                         episodes=EpisodeSettings(max_turns=3, max_episode_tokens=96, gamma=0.9),
                         generation=GenerationSettings(num_generations=4, max_new_tokens=6))
    plans = []
    update = module.update

    def spy(update_, rollouts, plan, *args, **kwargs):
        plans.append((rollouts, plan))
        return update(update_, rollouts, plan, *args, **kwargs)

    module.update = spy
    data = tiny_data(source="arithmetic", batch_size=2)
    tiny_trainer(tmp_path, max_steps=2).fit(module, data)
    rows = [r for r in csv.DictReader(open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0]))
            if r.get("rollout/excluded")]
    assert len(rows) == 2 and len(plans) == 2
    assert sum(float(r["rollout/excluded"]) for r in rows) > 0  # (every 7th step call raised)
    for (rollouts, plan), row in zip(plans, rows):
        faults = sum(bool(info.get("fault")) for info in rollouts.infos)
        assert float(row["rollout/excluded"]) == faults
        assert float(row["rollout/skipped_groups"]) == float(rollouts.excluded.view(-1, 4).all(1).sum())
        assert math.isfinite(float(row["train/loss"]))
        assert not set(plan.rows.tolist()) & set(torch.nonzero(rollouts.excluded).view(-1).tolist())
        assert plan.credit.token_advantages[rollouts.excluded].abs().sum() == 0
        assert plan.credit.token_advantages.abs().sum() > 0  # (replies of odd length are rewarded)
        # the turns' returns discounted by 0.9: each token's advantage is its turn's, normalised at that turn
        returns = turn_returns(rollouts.turn_rewards, 0.9)
        mask = rollouts.completion_mask * (~rollouts.excluded).unsqueeze(1)
        want = turn_advantages(returns, rollouts.turn_index, mask, 4, valid=~rollouts.excluded)
        assert torch.allclose(plan.credit.token_advantages, want)


def test_reinforce_pp_with_turn_rewards_puts_each_turns_reward_on_its_last_model_token():
    from scgrpo.objectives import REINFORCEPlusPlus
    from scgrpo.objectives.reinforce_pp import turn_end_rewards

    # one episode: turn 0 (2 tokens), an observation, turn 1 (1 token); rewards 0.5 after turn 0, 1.0 after turn 1
    index = torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1]])
    mask = (index >= 0).float()
    rewards = torch.tensor([[0.5, 1.0], [0.0, 2.0]])
    placed = turn_end_rewards(rewards, index, mask)
    assert placed.tolist() == [[0.0, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 2.0]]
    # the group baseline: the mean episode reward (1.75) off each row's last model token, the same for every action
    based = REINFORCEPlusPlus(kl_coef=0.0, rewards="turn", baseline="group").credit(CreditInputs(
        rewards=rewards.sum(1), mask=mask, group_size=2, turn_rewards=rewards, turn_index=index))
    returns = torch.tensor([1.5 - 1.75, 1.5 - 1.75, 1.0 - 1.75, 2.0 - 1.75, 2.0 - 1.75, 2.0 - 1.75])
    want = (returns - returns.mean()) / (returns.var() + 1e-8).sqrt()
    assert torch.allclose(based.token_advantages[mask.bool()], want, atol=1e-5)
    credit = REINFORCEPlusPlus(kl_coef=0.0, rewards="turn").credit(CreditInputs(
        rewards=rewards.sum(1), mask=mask, group_size=2, turn_rewards=rewards, turn_index=index))
    # returns by hand (gamma 1, through the observation): row 0: 1.5, 1.5, -, 1.0; row 1: 2.0, -, 2.0, 2.0
    returns = torch.tensor([1.5, 1.5, 1.0, 2.0, 2.0, 2.0])
    want = (returns - returns.mean()) / (returns.var() + 1e-8).sqrt()
    assert torch.allclose(credit.token_advantages[mask.bool()], want, atol=1e-5)
    with pytest.raises(ValueError, match="single completions; set model.environment, or rewards: episode"):
        REINFORCEPlusPlus(kl_coef=0.0, rewards="turn").credit(CreditInputs(rewards=rewards[:, 0], mask=mask,
                                                                          group_size=2))
