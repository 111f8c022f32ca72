"""The two controls that separate where SC-GRPO's weight sits from how much it shrinks the step (DESIGN §4.2):
SC-GRPO with each row's f permuted, and GRPO scaled by the step's mean f. Values worked out by hand."""

import pytest
import torch

from scgrpo.objectives import GRPO, SCGRPO, CreditInputs, LossInputs, ScaledGRPO, functional as Fn
from scgrpo.selfteacher import PARTIAL, SOLVE_NONE
from tests.objectives.test_scgrpo import _signal

# the padded batch of test_weights_and_c_by_hand_on_a_padded_batch: c = .25, rows 0-2 have a teacher
D = torch.tensor([[0.0, 0.1, 0.2, 0.4], [0.3, 0.0, 9.0, 9.0], [0.05, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 9.0]])
MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
REWARDS = torch.tensor([1.0, 1.0, 0.0, 0.0])
F_ROWS = [[0.0, 0.1 / 0.35, 0.2 / 0.45, 0.4 / 0.65], [0.3 / 0.55, 0.0], [0.05 / 0.3]]
MEAN_F = sum(sum(r) for r in F_ROWS) / 7  # the step's mean f over its 7 active tokens


def _partial():
    return _signal([PARTIAL] * 4, [True, True, True, False], D)


def test_permuted_weights_keep_each_rows_values_and_advantage_and_lose_their_places():
    plain = SCGRPO().credit(CreditInputs(REWARDS, MASK, 4, _partial()))
    torch.manual_seed(0)
    permuted = SCGRPO(permute_weights=True).credit(CreditInputs(REWARDS, MASK, 4, _partial()))
    torch.testing.assert_close(permuted.advantages, plain.advantages)
    assert permuted.stats.c == plain.stats.c and permuted.stats.f_mean == plain.stats.f_mean
    for row, values in enumerate(F_ROWS):  # the same multiset of values at the row's model tokens
        kept = permuted.token_weights[row][MASK[row].bool()]
        assert sorted(kept.tolist()) == pytest.approx(sorted(values))
        assert (permuted.token_weights[row][~MASK[row].bool()] == 0).all()
    torch.testing.assert_close(permuted.token_weights[3], MASK[3])  # no teacher: plain GRPO, weight 1
    # the per-row step size under seq-mean-token-mean (the row's mean weight) is SC-GRPO's
    torch.testing.assert_close((permuted.token_weights * MASK).sum(1), (plain.token_weights * MASK).sum(1))
    # the draw comes from torch's CPU generator (restored from checkpoints): the same state, the same weights
    torch.manual_seed(0)
    again = SCGRPO(permute_weights=True).credit(CreditInputs(REWARDS, MASK, 4, _partial()))
    assert torch.equal(again.token_weights, permuted.token_weights)


def test_permutation_is_uniform_over_a_rows_model_tokens():
    """Row 0 holds 4 distinct values: over 4,000 draws each lands at each place about 1/4 of the time."""
    torch.manual_seed(1)
    counts = torch.zeros(4, 4)
    values = torch.tensor(F_ROWS[0])
    for _ in range(4000):
        w = SCGRPO(permute_weights=True).credit(CreditInputs(REWARDS, MASK, 4, _partial())).token_weights[0]
        nearest = (w.unsqueeze(1) - values.unsqueeze(0)).abs().argmin(1)  # [place] the value found there
        counts[torch.arange(4), nearest] += 1  # [place, value]
    shares = counts / 4000
    assert (shares - 0.25).abs().max() < 0.035  # 5 standard errors of a share of 1/4 over 4,000 draws


def test_permuted_solve_none_rows_keep_the_diversity_advantage_of_the_unpermuted_weights():
    d = torch.tensor([[1.0, 1.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    signal = _signal([SOLVE_NONE] * 4, [True, True, False, True], d, diversity_length=[2, 2, 0, 1],
                     is_reference=[False, False, True, False])
    plain = SCGRPO(c_fixed=1.0).credit(CreditInputs(torch.zeros(4), mask, 4, signal))
    for seed in range(5):  # row 0's window (f .5 .5 of .5 .5 .75) would score otherwise after some shuffles
        torch.manual_seed(seed)
        permuted = SCGRPO(c_fixed=1.0, permute_weights=True).credit(CreditInputs(torch.zeros(4), mask, 4, signal))
        torch.testing.assert_close(permuted.advantages, plain.advantages)
        assert sorted(permuted.token_weights[0].tolist()) == [0.5, 0.5, 0.75]


def test_scaled_grpo_weights_every_teacher_row_by_the_steps_mean_f():
    credit = ScaledGRPO().credit(CreditInputs(REWARDS, MASK, 4, _partial()))
    expected = torch.where(torch.tensor([True, True, True, False]).unsqueeze(1), MASK * MEAN_F, MASK)
    torch.testing.assert_close(credit.token_weights, expected)
    torch.testing.assert_close(credit.advantages, Fn.group_advantages(REWARDS, 4))  # GRPO's A_i
    assert credit.stats.c == pytest.approx(0.25) and credit.stats.f_mean == pytest.approx(MEAN_F)
    # solve-none groups are GRPO's: advantage 0, whatever the teacher's scores (which still set c and the mean)
    d = torch.tensor([[1.0, 1.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    signal = _signal([SOLVE_NONE] * 4, [True, True, False, True], d, diversity_length=[2, 2, 0, 1],
                     is_reference=[False, False, True, False])
    none = ScaledGRPO(c_fixed=1.0).credit(CreditInputs(torch.zeros(4), mask, 4, signal))
    assert torch.equal(none.advantages, torch.zeros(4))
    f_mean = (0.5 + 0.5 + 0.75 + 0 + 0 + 0.75 + 0.5) / 7  # f = D / (D + 1) over the 7 active tokens
    torch.testing.assert_close(none.token_weights[0], torch.full((3,), f_mean))


def test_scaled_grpo_loss_is_grpo_with_its_teacher_rows_advantages_scaled():
    """Under seq-mean-token-mean a constant weight per row is the same as scaling the row's advantage."""
    objective = ScaledGRPO()
    credit = objective.credit(CreditInputs(REWARDS, MASK, 4, _partial()))
    torch.manual_seed(0)
    logprobs = (torch.randn(4, 4) * 0.1 - 1.0).requires_grad_()
    old = logprobs.detach() + torch.randn(4, 4) * 0.05
    scaled = credit.advantages * torch.tensor([MEAN_F, MEAN_F, MEAN_F, 1.0])
    ours = objective.loss(logprobs, LossInputs(MASK, credit.advantages, old, token_weights=credit.token_weights))
    grpo = GRPO(aggregation="seq-mean-token-mean").loss(logprobs, LossInputs(MASK, scaled, old))
    torch.testing.assert_close(ours.loss, grpo.loss)
    (g_ours,) = torch.autograd.grad(ours.loss, logprobs)
    (g_grpo,) = torch.autograd.grad(grpo.loss, logprobs)
    torch.testing.assert_close(g_ours, g_grpo)
