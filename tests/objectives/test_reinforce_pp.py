"""REINFORCE++: its KL-shaped per-token reward, discounted return and batch whitening, by hand and against a
plain-Python reference written from the paper's equations (Hu et al., arXiv 2501.03262, section 3) with this
package's conventions where the paper leaves them open: the variance with Bessel's correction and 1e-8 inside
the square root (as verl's masked_whiten), and an episode's environment tokens passing the return through."""

import math

import pytest
import torch

from scgrpo.objectives import GRPO, REINFORCEPlusPlus
from scgrpo.objectives import functional as Fn
from scgrpo.objectives.base import CreditInputs, LossInputs
from scgrpo.objectives.reinforce_pp import reinforce_pp_advantages


def _reference(rewards, mask, group_size, kl, kl_coef, gamma, baseline):
    """The paper's steps one token at a time, on lists: r_t = -beta KL_t (+ R on the last model token),
    G_t = r_t + gamma G_{t+1} over model tokens, then (G - mean) / sqrt(var + 1e-8), var with Bessel's correction."""
    n, c = len(rewards), len(mask[0])
    seq = list(rewards)
    if baseline == "group":
        for g in range(0, n, group_size):
            mean = sum(rewards[g:g + group_size]) / group_size
            seq[g:g + group_size] = [r - mean for r in rewards[g:g + group_size]]
    returns = [[0.0] * c for _ in range(n)]
    for i in range(n):
        model = [t for t in range(c) if mask[i][t]]
        running = 0.0
        for t in reversed(model):
            r = -kl_coef * kl[i][t] + (seq[i] if t == model[-1] else 0.0)
            running = r + gamma * running
            returns[i][t] = running
    values = [returns[i][t] for i in range(n) for t in range(c) if mask[i][t]]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [[(returns[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0 for t in range(c)]
            for i in range(n)]


def test_two_rows_by_hand():
    """R = (1, 0); k1 KL = log pi_old - log pi_ref = [[0.5, 0], [0, 1]]; beta = 0.1; gamma = 1.
    Token rewards [[-0.05, 1], [0, -0.1]]; returns [[0.95, 1.0], [-0.1, -0.1]]; mean 0.4375;
    unbiased var (0.5125^2 + 0.5625^2 + 2 * 0.5375^2) / 3 = 0.385625."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]])
    ref = torch.tensor([[-1.5, -2.0], [-0.5, -2.0]])
    mask = torch.ones(2, 2)
    credit = REINFORCEPlusPlus(kl_coef=0.1).credit(CreditInputs(torch.tensor([1.0, 0.0]), mask, 2, old_logprobs=old,
                                                   ref_logprobs=ref))
    std = math.sqrt(0.385625 + 1e-8)
    expected = torch.tensor([[0.5125, 0.5625], [-0.5375, -0.5375]]) / std
    torch.testing.assert_close(credit.token_advantages, expected)
    torch.testing.assert_close(credit.advantages, expected.mean(1))  # the logged per-row view


def test_discount_counts_model_tokens_only():
    """gamma = 0.5, R = 1 on a row [model, environment, model]: G = [0.5, (1), 1] before whitening; the
    environment token passes the return through undiscounted and has no advantage."""
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    returns = Fn.discounted_returns(torch.tensor([[0.0, 0.0, 1.0]]), mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 1.0, 1.0]]))
    rows = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    two = Fn.discounted_returns(rows, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]), gamma=0.5)
    advantages = Fn.whiten(two, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    assert advantages[0, 1] == 0  # a masked position carries no advantage


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("baseline", ["none", "group"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_against_the_paper_written_out(gamma, baseline, estimator):
    g = torch.Generator().manual_seed(7)
    n, c, group = 8, 6, 4
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    mask = (torch.rand(n, c, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    old = -torch.rand(n, c, generator=g) * 3
    ref = -torch.rand(n, c, generator=g) * 3
    objective = REINFORCEPlusPlus(kl_coef=0.05, gamma=gamma, baseline=baseline, kl_estimator=estimator)
    credit = objective.credit(CreditInputs(rewards, mask, group, old_logprobs=old, ref_logprobs=ref))
    delta = old - ref
    kl = {"k1": delta, "k2": 0.5 * delta**2, "k3": torch.exp(-delta) + delta - 1}[estimator]
    expected = _reference(rewards.tolist(), mask.tolist(), group, kl.tolist(), 0.05, gamma, baseline)
    torch.testing.assert_close(credit.token_advantages, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_without_kl_every_token_of_a_row_shares_its_whitened_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]).float()
    objective = REINFORCEPlusPlus(kl_coef=0.0)
    assert not objective.needs.ref_logprobs and not objective.needs.old_logprobs  # no scoring pass
    credit = objective.credit(CreditInputs(rewards, mask, 2))
    tokens = torch.tensor([1.0] * 5 + [0.0] * 4)  # each row's tokens carry its R: 5 ones, 4 zeros
    expected = (rewards.unsqueeze(1) - tokens.mean()) / tokens.std()
    torch.testing.assert_close(credit.token_advantages, expected * mask, atol=1e-6, rtol=1e-6)


def test_equal_rewards_and_no_kl_give_no_gradient_rows():
    credit = REINFORCEPlusPlus(kl_coef=0.0).credit(CreditInputs(torch.ones(4), torch.ones(4, 3), 2))
    assert torch.count_nonzero(credit.token_advantages) == 0
    assert not REINFORCEPlusPlus().rows_in_loss(credit).any()


def test_nan_outside_the_mask_stays_out():
    old = torch.tensor([[-1.0, float("nan")], [-0.5, -1.0]])
    ref = torch.tensor([[-1.5, float("-inf")], [-0.5, -2.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    credit = REINFORCEPlusPlus(kl_coef=0.1).credit(CreditInputs(torch.tensor([1.0, 0.0]), mask, 2, old_logprobs=old,
                                                   ref_logprobs=ref))
    assert torch.isfinite(credit.token_advantages).all() and credit.token_advantages[0, 1] == 0


def test_kl_needs_the_scoring_pass():
    objective = REINFORCEPlusPlus(kl_coef=0.01)
    assert objective.needs.old_logprobs and objective.needs.ref_logprobs and objective.beta == 0
    with pytest.raises(RuntimeError, match="scoring pass"):
        objective.credit(CreditInputs(torch.ones(2), torch.ones(2, 2), 2))


def test_loss_is_the_token_mean_clipped_surrogate_of_the_token_advantages():
    g = torch.Generator().manual_seed(1)
    logprobs = (-torch.rand(3, 4, generator=g)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]).float()
    token_advantages = torch.randn(3, 4, generator=g) * mask
    inputs = LossInputs(completion_mask=mask, advantages=torch.zeros(3), old_logprobs=old,
                        token_advantages=token_advantages)
    out = REINFORCEPlusPlus().loss(logprobs, inputs)
    ratio = torch.exp(logprobs - old)
    hand = -(torch.minimum(ratio * token_advantages, ratio.clamp(0.8, 1.2) * token_advantages) * mask).sum() / mask.sum()
    torch.testing.assert_close(out.loss, hand)
    assert out.stats.kl is None  # the KL is in the reward, not the loss
    grpo = GRPO(aggregation="token-mean").loss(logprobs, inputs)  # a sequence objective given token advantages
    torch.testing.assert_close(grpo.loss, hand)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kl_coef=-0.1), "kl_coef"), (dict(gamma=0.0), "gamma"), (dict(gamma=1.5), "gamma"),
    (dict(baseline="rloo"), "baseline"), (dict(kl_estimator="k4"), "kl_estimator"),
])
def test_bad_settings_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        REINFORCEPlusPlus(**kwargs)


def test_whitening_uses_the_sums_over_ranks():
    """Two ranks' halves whitened with the summed statistics equal the whole batch whitened at once."""
    g = torch.Generator().manual_seed(3)
    values, mask = torch.randn(6, 5, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = Fn.whiten(values, mask)
    halves = [(values[:3], mask[:3]), (values[3:], mask[3:])]

    def totals(v, m):
        m64, v64 = m.double(), v.double() * m.double()
        return [float(v64.sum()), float((v64 * v64).sum()), float(m64.sum())]

    summed = [a + b for a, b in zip(*(totals(v, m) for v, m in halves))]
    parts = [Fn.whiten(v, m, sums=lambda _: summed) for v, m in halves]
    torch.testing.assert_close(torch.cat(parts), whole)
    direct = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 2), 2)
    assert float(direct.sum()) == pytest.approx(0.0, abs=1e-6)
