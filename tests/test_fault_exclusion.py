"""Rollouts without a reward (an environment's fault, every reward function's failure) under ``episodes.on_fault:
exclude``: out of their group's mean and std, the loss and its denominators, counted; a group left with fewer than 2
rollouts is skipped. ``zero`` keeps them as reward 0."""

from __future__ import annotations

import pytest
import torch

from scgrpo.envs import EpisodeSettings
from scgrpo.objectives import CreditInputs
from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import LossOutput, Objective, row_advantages
from scgrpo.objectives.reinforce_pp import reinforce_pp_advantages
from scgrpo.rollout.types import ALL, PARTIAL, SINGLE, RolloutBatch, TeacherSpec
from scgrpo.selfteacher import group_routes, route_rollouts
from scgrpo.stage import excluded_rows, exclusion_stats, mixed_groups
from tests.test_update import _update


def test_group_advantages_leave_invalid_rows_out_of_the_mean_and_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    valid = torch.tensor([True, True, False, True, True, False, False, False])
    got = Fn.group_advantages(rewards, 4, "group", valid)
    # by hand, group 1 over rewards 1, 0, 1: mean 2/3, unbiased std sqrt(1/3); group 2 has one valid row: skipped
    std = (1 / 3) ** 0.5
    want = [(1 - 2 / 3) / (std + 1e-4), (0 - 2 / 3) / (std + 1e-4), 0.0, (1 - 2 / 3) / (std + 1e-4), 0, 0, 0, 0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    # the same as GRPO's advantages of the group without its faulted row
    assert got[[0, 1, 3]].tolist() == pytest.approx(Fn.group_advantages(torch.tensor([1.0, 0.0, 1.0]), 3).tolist())
    assert Fn.group_advantages(rewards, 4, "none", valid)[:4].tolist() == pytest.approx([1 / 3, -2 / 3, 0, 1 / 3])
    batch = Fn.group_advantages(rewards, 4, "batch", valid)  # the batch's std over the valid rows of kept groups
    assert batch[0].item() == pytest.approx((1 / 3) / (torch.tensor([1.0, 0.0, 1.0]).std().item() + 1e-4))
    # every row valid: GRPO's advantages as before
    assert torch.allclose(Fn.group_advantages(rewards, 4, "group", torch.ones(8, dtype=torch.bool)),
                          Fn.group_advantages(rewards, 4, "group"))


def test_rows_without_a_reward_and_groups_left_with_one_are_excluded_and_counted():
    infos = [{}, {"fault": "error"}, {}, {}, {"error": "NoReward: every reward function gave None", "no_reward": True},
             {}, {"error": "a verifier's own word: a scored 0"}, {}]
    excluded = excluded_rows(infos, 4, torch.device("cpu"))
    assert excluded.tolist() == [False, True, False, False, True, False, False, False]
    lone = excluded_rows([{}, {"fault": "timeout"}, {}, {}], 2, torch.device("cpu"))
    assert lone.tolist() == [True, True, False, False]  # the first group is left with one episode: skipped
    batch = RolloutBatch(prompt_ids=torch.ones(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.long),
                         completion_ids=torch.ones(4, 2, dtype=torch.long), completion_mask=torch.ones(4, 2),
                         truncated=torch.zeros(4, dtype=torch.bool), group_size=2, sample_ids=list("aabb"),
                         questions=["q"] * 4, answers=[1] * 4, completions=["c"] * 4, rewards=torch.zeros(4),
                         infos=[{}, {"fault": "timeout"}, {}, {}], excluded=lone)
    assert exclusion_stats(batch) == {"excluded": 1.0, "skipped_groups": 1.0}
    batch.excluded = None  # on_fault: zero
    assert exclusion_stats(batch) == {}


def test_the_plan_trains_on_the_valid_rows_only_and_counts_only_them_in_the_denominators():
    from tests.test_guard import _rollouts

    rollouts = _rollouts().select(torch.tensor([0, 1, 0, 1]))
    rollouts.group_size = 4
    rollouts.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # row 2 faulted (its 0 is no reward)
    rollouts.excluded = torch.tensor([False, False, True, False])
    plan = _update().plan(rollouts)
    want = Fn.group_advantages(torch.tensor([1.0, 0.0, 1.0]), 3)
    assert plan.credit.advantages[[0, 1, 3]].tolist() == pytest.approx(want.tolist())
    assert plan.credit.advantages[2] == 0 and 2 not in plan.rows.tolist() and plan.rows.tolist() == [0, 1, 3]
    mask = rollouts.completion_mask
    assert plan.norms.num_rows == 3.0 and plan.norms.num_tokens == float(mask.sum() - mask[2].sum())
    rollouts.excluded = None  # on_fault: zero: the fault is a failure of the group
    assert plan.credit.advantages[0] != _update().plan(rollouts).credit.advantages[0]


def test_an_objective_whose_advantages_take_no_valid_still_trains_without_the_excluded_rows(caplog):
    class Own(Objective):  # a user's objective, written before ``valid``
        def advantages(self, rewards, group_size):
            return rewards - rewards.mean()

        def loss(self, logprobs, inputs):
            return LossOutput(loss=logprobs.sum() * 0)

    inputs = CreditInputs(rewards=torch.tensor([1.0, 0.0, 0.0]), mask=torch.ones(3, 2), group_size=3,
                          valid=torch.tensor([True, True, False]))
    with caplog.at_level("WARNING"):
        assert row_advantages(Own(), inputs).tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert "takes no `valid`" in caplog.text
    from tests.test_guard import _rollouts

    rollouts = _rollouts().select(torch.tensor([0, 1, 0]))
    rollouts.group_size, rollouts.rewards = 3, inputs.rewards
    rollouts.excluded = ~inputs.valid
    plan = _update(objective=Own()).plan(rollouts)
    assert plan.credit.advantages[2] == 0 and plan.rows.tolist() == [0, 1]


def test_reinforce_pp_group_baseline_reads_the_valid_rows_only():
    rewards, mask = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(4, 2)
    valid = torch.tensor([True, True, False, True])
    mask[2] = 0  # (the plan hands the credit a mask without the excluded rows)
    got = reinforce_pp_advantages(rewards, mask, 4, baseline="group", valid=valid)
    want = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2), 3, baseline="group")
    assert torch.allclose(got[[0, 1, 3]], want, atol=1e-6) and got[2].abs().sum() == 0


def test_routes_and_references_read_the_valid_rows_only():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    valid = torch.tensor([True, True, False, True, True, True])
    assert group_routes(rewards, 3, 1.0).tolist() == [PARTIAL, SINGLE]
    assert group_routes(rewards, 3, 1.0, valid).tolist() == [ALL, SINGLE]  # both valid rows of the first are correct
    from tests.test_selfteacher import _rollouts as teacher_rollouts

    rollouts = teacher_rollouts([1.0, 0.0, 0.0, 1.0], [[5, 6], [5, 7], [5, 8], [5, 9]])
    rollouts.excluded = torch.tensor([False, False, True, False])
    plan = route_rollouts(rollouts, TeacherSpec(routes=("partial", "solve_none")), 1.0)
    assert plan.references[2] is None and plan.reference_rows[1] in (0, 3)  # the faulted row has no teacher


def test_dynamic_sampling_reads_a_group_by_its_valid_rows():
    from tests.test_guard import _rollouts

    rollouts = _rollouts().select(torch.tensor([0, 1, 0, 1]))
    rollouts.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # two groups of 2, both mixed
    assert mixed_groups(rollouts).tolist() == [0, 1, 2, 3]
    rollouts.group_size = 4
    rollouts.rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    rollouts.excluded = torch.tensor([False, False, True, False])  # its only 0 is a fault: all equal
    assert mixed_groups(rollouts).tolist() == []


def test_on_fault_takes_exclude_or_zero():
    assert EpisodeSettings().on_fault == "exclude"
    with pytest.raises(ValueError, match="on_fault='drop'.*'exclude'.*'zero'"):
        EpisodeSettings(on_fault="drop")


class _SometimesNone:
    """Reward functions' result: None (no reward) for completions of one character."""

    @staticmethod
    def reward(completions, **kwargs):
        return [None if len(c) == 1 else 1.0 for c in completions]


@pytest.mark.parametrize("on_fault", ["exclude", "zero"])
def test_the_stage_marks_rows_every_reward_function_failed_on_and_logs_the_counts(on_fault):
    from scgrpo.stage import RolloutStage
    from scgrpo.verifiers import RewardFunctions, VerifierRunner
    from tests.test_stage import Scripted as ScriptedPolicy, _batch

    policy = ScriptedPolicy({"a": ["xx", "x", "xxx"], "b": ["x", "x", "xx"]})
    stage = RolloutStage(policy, 3, VerifierRunner(RewardFunctions([_SometimesNone.reward])), on_fault=on_fault)
    rollouts = stage.collect(_batch("a", "b"))
    assert rollouts.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    metrics = rollouts.stats.metrics()
    if on_fault == "zero":
        assert rollouts.excluded is None and "rollout/excluded" not in metrics
        return
    # a's second row has no reward; b is left with one row and is skipped
    assert rollouts.excluded.tolist() == [False, True, False, True, True, True]
    assert metrics["rollout/excluded"] == 3.0 and metrics["rollout/skipped_groups"] == 1.0


def test_the_logged_reward_and_accuracy_are_those_of_the_rows_the_step_trains_on():
    from scgrpo.step_log import skipped_step_metrics, step_metrics
    from tests.test_guard import _rollouts
    from tests.test_step_log import _sums

    rollouts = _rollouts().select(torch.tensor([0, 1, 0, 1]))
    rollouts.group_size = 4
    rollouts.rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    rollouts.excluded = torch.tensor([False, False, True, False])  # its only 0 is a fault
    rollouts.infos = [{}, {}, {"fault": "timeout"}, {}]
    plan = _update().plan(rollouts)
    m = step_metrics(rollouts, plan, _sums(loss=0.0, nonfinite=0.0), {}, passes=1, success_threshold=1.0,
                     log_kl=False, train_time=0.0, nonfinite_skips=0, lr=0.1)
    assert m["train/reward"] == 1.0 and m["train/accuracy"] == 1.0 and m["train/reward_std"] == 0.0
    assert m["train/mixed_groups"] == 0.0  # (all equal but for the fault)
    skipped = skipped_step_metrics(rollouts, [], success_threshold=1.0, train_time=0.0, nonfinite_skips=0, lr=0.1)
    assert skipped["train/reward"] == 1.0
    rollouts.excluded = None  # on_fault: zero
    m = step_metrics(rollouts, _update().plan(rollouts), _sums(loss=0.0, nonfinite=0.0), {}, passes=1,
                     success_threshold=1.0, log_kl=False, train_time=0.0, nonfinite_skips=0, lr=0.1)
    assert m["train/reward"] == 0.75 and m["train/mixed_groups"] == 1.0


def test_a_weighted_verifier_sums_the_parts_that_scored_and_has_no_reward_when_none_did():
    from scgrpo.verifiers import VerifierRunner, WeightedVerifier
    from scgrpo.verifiers.base import VerificationResult, Verifier

    class One(Verifier):
        def verify(self, completion, answer, question=""):
            return VerificationResult(1.0)

    class Broken(Verifier):
        def verify(self, completion, answer, question=""):
            raise KeyError("no field")

    weighted = WeightedVerifier([One(), Broken()], [0.5, 2.0])
    part = weighted.verify("c", 1)
    assert part.score == 0.5 and part.info["rewards"] == {"One": 1.0, "Broken": None} and "Broken" in part.info["errors"]
    assert weighted.failed_rows == {"One": 0, "Broken": 1}  # (reward/Broken/errors)

    class Slow(Verifier):
        def verify(self, completion, answer, question=""):
            import time

            time.sleep(2)
            return VerificationResult(1.0)

    (late,) = VerifierRunner(WeightedVerifier([Slow(), One()], timeout_s=0.2))(["c"], [1], ["q"], ["p"])
    assert late.info["error"] == "timeout" and late.info["no_reward"]  # the sum's time limit, not a part's failure
    (none,) = VerifierRunner(WeightedVerifier([Broken(), Broken()]))(["c"], [1], ["q"], ["p"])
    assert none.score == 0.0 and none.info["no_reward"] and "no part scored" in none.info["error"]


def test_episodes_that_all_fault_stop_the_run_and_a_faulted_row_is_not_stored_as_verified():
    from types import SimpleNamespace

    from scgrpo.stage import RewardsFailed, RolloutStage
    from scgrpo.verifiers import VerifierRunner
    from tests.test_guard import _rollouts
    from tests.verifiers.helpers import ParityVerifier

    runner = SimpleNamespace(environment=object(), settings=None)
    stage = RolloutStage(None, 2, VerifierRunner(ParityVerifier()), episode_runner=runner, max_reward_failure_steps=2)
    rollouts = _rollouts(infos=[{"fault": "error", "env": [{"env_error": "Env: boom"}]}, {"fault": "timeout"}])
    for step in range(2):
        stats, failed = stage.verify(rollouts)
        assert failed
        if step == 0:
            stage.count_reward_failures(failed, rollouts.infos)
    with pytest.raises(RewardsFailed, match=r"first of this step: Env: boom.*Fix the object \(model.environment\)"):
        stage.count_reward_failures(failed, rollouts.infos)
    rollouts.rewards = torch.tensor([1.0, 1.0])
    assert stage.verified_rows(rollouts, 0.0) == []  # (a fault's reward is none, whatever the threshold)
