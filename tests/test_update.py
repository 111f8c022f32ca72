"""The update's planning and clipping on their own (a stand-in policy; the passes over a real model are in
tests/test_module.py and tests/test_update_behaviour.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

from scgrpo.objectives import GRPO, HighEntropyGRPO
from scgrpo.rollout.engine import GenerationSettings
from scgrpo.update import NONFINITE, PolicyUpdate, StepSums
from scgrpo.rollout.types import TeacherSignal
from tests.test_guard import _plan, _rollouts


def _update(params=(), micro_batch_size=None, max_grad_norm=1.0, objective=None, entropy=None):
    policy = SimpleNamespace(generation=GenerationSettings(max_new_tokens=3), device=torch.device("cpu"),
                             trainable_parameters=lambda: list(params), batch_entropy=lambda rollouts, micro: entropy)
    return PolicyUpdate(policy, objective or GRPO(), backward=lambda loss: None, micro_batch_size=micro_batch_size,
                        max_grad_norm=max_grad_norm)


def _four_rows():
    """Two groups of two: the first mixed (advantages +-), the second all correct (advantage 0)."""
    rollouts = _rollouts()
    doubled = rollouts.select(torch.tensor([0, 1, 0, 1]))
    doubled.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return doubled


@pytest.mark.parametrize("micro,chunks", [(None, [[0, 1]]), (1, [[0], [1]]), (5, [[0, 1]])])
def test_plan_keeps_rows_that_move_the_loss_in_micro_batches_and_counts_every_row(micro, chunks):
    rollouts = _four_rows()
    signal = TeacherSignal(route=torch.zeros(4, dtype=torch.long), has_teacher=torch.tensor([True, False, True, True]),
                           is_reference=torch.zeros(4, dtype=torch.bool), diversity_mask=torch.zeros(4, 3),
                           references=[None] * 4)
    plan = _update(micro_batch_size=micro).plan(rollouts, signal)
    assert plan.rows.tolist() == [0, 1] and [c.tolist() for c in plan.chunks] == chunks
    assert plan.num_chunks == len(chunks) and plan.global_rows == 2.0
    assert plan.norms.num_tokens == float(rollouts.completion_mask.sum()) == 6.0  # zero-advantage rows count too
    assert plan.norms.num_rows == 4.0 and plan.norms.num_teacher_rows == 3.0
    assert plan.selection is None and torch.equal(plan.rewards, rollouts.rewards)
    assert plan.credit.advantages[2:].abs().sum() == 0 and plan.credit.advantages[0] > 0 > plan.credit.advantages[1]


def test_a_batch_without_signal_plans_no_pass():
    rollouts = _four_rows()
    rollouts.rewards = torch.ones(4)
    plan = _update(micro_batch_size=1).plan(rollouts)
    assert plan.rows.numel() == 0 and plan.chunks == [] and plan.num_chunks == 0 and plan.global_rows == 0
    assert plan.norms.num_teacher_rows == 0.0


def test_plan_selects_tokens_from_the_batch_entropy_when_the_objective_asks():
    rollouts = _four_rows()
    entropy = torch.arange(12, dtype=torch.float32).view(4, 3)
    plan = _update(objective=HighEntropyGRPO(rho=0.5), entropy=entropy).plan(rollouts)
    assert plan.selection is not None and plan.selection.shape == (4, 3)
    assert torch.equal(plan.selection, HighEntropyGRPO(rho=0.5).token_mask(entropy, rollouts.completion_mask))


def test_clip_skips_on_a_nonfinite_loss_or_norm_and_clips_otherwise():
    w = torch.nn.Parameter(torch.zeros(2))
    plan = _plan()
    sums = StepSums()
    sums.add(NONFINITE, 1.0)
    assert _update([w]).clip(plan, sums) == "loss"
    w.grad = torch.tensor([3.0, 4.0])  # norm 5
    sums = StepSums()
    assert _update([w], max_grad_norm=1.0).clip(plan, sums) is None
    assert sums["grad_norm"] == pytest.approx(5.0) and torch.allclose(w.grad, torch.tensor([0.6, 0.8]), atol=1e-6)
    w.grad = torch.tensor([3.0, 4.0])
    assert _update([w], max_grad_norm=0.0).clip(plan, sums) is None  # 0: measured, not clipped
    assert sums["grad_norm"] == pytest.approx(10.0) and torch.equal(w.grad, torch.tensor([3.0, 4.0]))
    w.grad = torch.tensor([math.inf, 0.0])
    assert _update([w]).clip(plan, StepSums()) == "gradient norm"
    plan.global_rows = 0.0  # no row in the loss on any rank: nothing to clip or measure
    none = StepSums()
    assert _update([w]).clip(plan, none) is None and "grad_norm" not in none


def test_step_sums_name_the_objectives_own_statistics():
    sums = StepSums()
    for name, value in (("loss", 1.0), ("entropy", 0.5), ("clip_fraction", 0.1), ("kl", 0.2), (NONFINITE, 0.0),
                        ("distill_kl", 0.3), ("grad_norm", 2.0)):
        sums.add(name, value)
    sums.add("distill_kl", 0.3)
    assert sums.objective_stats() == {"distill_kl": pytest.approx(0.6)}
    assert sums.get("missing", 7.0) == 7.0 and "loss" in sums and sums["loss"] == 1.0


def test_the_policys_device_follows_its_weights():
    """A module configured on the CPU and then moved (``module.to("cuda")``) samples and scores where its weights
    are now, not where they were loaded."""
    from scgrpo.distributed import PolicyRunner
    from scgrpo.policy import Policy

    policy = Policy(PolicyRunner(torch.nn.Linear(2, 2)), None, GenerationSettings(), torch.device("cpu"))
    assert policy.device == torch.device("cpu")
    policy.model.to("meta")
    assert policy.device.type == "meta"
