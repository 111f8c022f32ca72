"""A training step's metric names and values (one process: the means over ranks are the values themselves)."""

import math

import pytest
import torch

from scgrpo.objectives import Credit, CreditStats
from scgrpo.rollout.types import RolloutStats
from scgrpo.step_log import StepPhases, skipped_step_metrics, step_metrics
from scgrpo.update import StepSums
from tests.test_guard import _plan, _rollouts


def _sums(**values) -> StepSums:
    sums = StepSums()
    for name, value in values.items():
        sums.add(name, value)
    return sums


def test_step_metrics_by_hand():
    rollouts = _rollouts(entropy_sum=torch.tensor([1.5, 0.5]))
    rollouts.stats = RolloutStats(generation_s=2.0, verifier_errors=0.0)
    plan = _plan()
    plan.credit = Credit(advantages=torch.tensor([0.5, -0.5]), stats=CreditStats(c=0.25, f_mean=0.5))
    sums = _sums(loss=3.0, entropy=1.0, clip_fraction=0.2, nonfinite=0.0, grad_norm=4.0, distill_kl=0.6)
    m = step_metrics(rollouts, plan, sums, {"rollout/mismatch_kl": 0.01}, passes=2, success_threshold=1.0, log_kl=False,
                     train_time=1.0, nonfinite_skips=3, lr=1e-3)
    assert m["train/loss"] == 1.5 and m["train/entropy"] == 0.5 and m["train/clip_fraction"] == pytest.approx(0.1)
    assert m["train/grad_norm"] == 2.0 and m["train/distill_kl"] == pytest.approx(0.3) and "train/kl" not in m
    assert m["train/reward"] == 0.5 and m["train/accuracy"] == 0.5 and m["train/mixed_groups"] == 1.0
    assert m["train/completion_length"] == 1.5 and m["train/rows_in_loss"] == 1.0 and m["train/advantage_abs"] == 0.5
    assert m["policy/entropy"] == pytest.approx(2.0 / 3.0)  # summed entropies over the 3 response tokens
    assert m["credit/c"] == 0.25 and m["credit/f_mean"] == 0.5 and math.isnan(m["credit/kl_p50"])
    assert m["tokens/completion"] == 3.0 and m["tokens/train"] == 2 * 5  # 2 rows x (2 prompt + 3 completion)
    assert m["time/step_s"] == pytest.approx(3.0) and m["train/lr"] == 1e-3 and m["train/nonfinite_skips"] == 3.0
    assert m["rollout/mismatch_kl"] == 0.01 and m["verifier/errors"] == 0.0
    assert "train/nonfinite" not in m  # the skip counter is train/nonfinite_skips, not the loss's NaN count


def test_undefined_values_are_nan_and_a_custom_objectives_dict_stats_are_logged():
    rollouts = _rollouts()
    plan = _plan()
    plan.rows = torch.zeros(0, dtype=torch.long)  # no row in the loss
    plan.credit = Credit(advantages=torch.zeros(2), stats={"credit/mine": 7.0})
    m = step_metrics(rollouts, plan, _sums(loss=0.0, nonfinite=0.0), {}, passes=1, success_threshold=1.0, log_kl=True,
                     train_time=0.0, nonfinite_skips=0, lr=0.1)
    assert all(math.isnan(m[k]) for k in ("train/clip_fraction", "train/entropy", "train/grad_norm", "train/kl"))
    assert m["credit/mine"] == 7.0 and math.isnan(m["policy/entropy"])


def test_a_skipped_step_logs_every_earlier_key_as_nan_but_its_rewards():
    rollouts = _rollouts()
    rollouts.stats = RolloutStats(generation_s=1.0)
    m = skipped_step_metrics(rollouts, ["train/loss", "credit/c", "train/reward"], success_threshold=1.0,
                             train_time=0.5, nonfinite_skips=2, lr=0.1)
    assert math.isnan(m["train/loss"]) and math.isnan(m["credit/c"])
    assert m["train/reward"] == 0.5 and m["train/accuracy"] == 0.5 and m["train/nonfinite_skips"] == 2.0
    assert m["time/generation_s"] == 1.0 and m["time/train_s"] == 0.5 and m["train/lr"] == 0.1


def test_rollout_stats_name_what_was_measured_and_add_up_over_rounds():
    first = RolloutStats(sampled=8.0, generation_s=2.0, sampler={"rollout/slots": 8.0, "episode/env_errors": 1.0},
                         memory={"rollout": 3.0}, verification_s=0.5, verifier_errors=1.0, verifier_timeouts=0.0,
                         rewards={"reward/acc/mean": 0.5})
    assert first.metrics() == {"rollout/slots": 8.0, "episode/env_errors": 1.0, "rollout/sampled": 8.0,
                               "time/generation_s": 2.0, "memory/rollout_peak_gib": 3.0, "time/verification_s": 0.5,
                               "verifier/errors": 1.0, "verifier/timeouts": 0.0, "reward/acc/mean": 0.5}
    assert "dapo/extra_rounds" not in first.metrics()  # (not measured: not logged)
    extra = RolloutStats(sampled=4.0, generation_s=1.0, sampler={"episode/env_errors": 2.0})
    both = first.plus(extra)
    assert both.sampled == 12.0 and both.generation_s == 3.0 and both.sampler == {"rollout/slots": 8.0,
                                                                                   "episode/env_errors": 3.0}
    assert both.verification_s == 0.5 and both.verifier_errors == 1.0 and both.rewards == first.rewards


def test_the_phases_peaks_and_the_budgets_largest_peak():
    phases = StepPhases(torch.device("cpu"), scoring_s=0.25, peaks={"teacher": 2.0, "update": 5.0})
    rollout = RolloutStats(memory={"rollout": 6.0})
    assert phases.metrics(rollout) == {"time/scoring_s": 0.25, "memory/teacher_peak_gib": 2.0,
                                       "memory/update_peak_gib": 5.0}
    phases.budget = {"memory/budget_gib": 20.0}
    assert phases.metrics(rollout)["memory/peak_allocated_gib"] == 6.0  # the rollout's peak, the largest
    phases.peak("update")  # (off a GPU nothing is measured)
    assert phases.peaks == {"teacher": 2.0, "update": 5.0}
