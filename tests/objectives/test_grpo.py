"""GRPO loss against values derived by hand, for each aggregation."""

import math

import pytest
import torch

from scgrpo.objectives import GRPO, LossInputs


def _inputs(**kw):
    base = dict(
        completion_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        advantages=torch.tensor([1.0, -1.0]),
        old_logprobs=torch.zeros(2, 3),
    )
    base.update(kw)
    return LossInputs(**base)


# ratios: row 0 -> [1.5, 1.0, (masked)], row 1 -> [0.5, 1.0, 1.1]
LOGPROBS = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 1.1]]))


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        # per-token losses: row 0 (A=+1, clip 1.2): [-1.2, -1.0]; row 1 (A=-1, clip at 0.8): [0.8, 1.0, 1.1]
        ("token-mean", (-1.2 - 1.0 + 0.8 + 1.0 + 1.1) / 5),
        ("seq-mean-token-mean", ((-1.2 - 1.0) / 2 + (0.8 + 1.0 + 1.1) / 3) / 2),
        ("seq-mean-token-sum-norm", ((-1.2 - 1.0) / 4 + (0.8 + 1.0 + 1.1) / 4) / 2),
    ],
)
def test_grpo_loss_by_hand(aggregation, expected):
    objective = GRPO(aggregation=aggregation)
    out = objective.loss(LOGPROBS, _inputs(max_len=4))
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.stats.clip_fraction.item() == pytest.approx(2 / 5)


def test_grpo_kl_term_by_hand():
    objective = GRPO(beta=0.1)
    ref = torch.zeros(2, 3)
    out = objective.loss(LOGPROBS, _inputs(ref_logprobs=ref))
    kl = [math.exp(-math.log(r)) + math.log(r) - 1 for r in (1.5, 1.0, 0.5, 1.0, 1.1)]
    surrogate = [-1.2, -1.0, 0.8, 1.0, 1.1]
    expected = sum(s + 0.1 * k for s, k in zip(surrogate, kl)) / 5
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.stats.kl.item() == pytest.approx(sum(kl) / 5, abs=1e-6)


def test_on_policy_gradient_is_minus_advantage_times_score():
    """With old = current (mu = 1) the ratio is 1 and d loss / d logp_t = -A_i / num_tokens."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -0.2]], requires_grad=True)
    inputs = _inputs(old_logprobs=logprobs.detach())
    GRPO().loss(logprobs, inputs).loss.backward()
    expected = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)


def test_token_weights_multiply_advantages():
    weights = torch.tensor([[2.0, 0.5, 1.0], [1.0, 3.0, 1.0]])
    logprobs = torch.zeros(2, 3, requires_grad=True)
    GRPO().loss(logprobs, _inputs(token_weights=weights)).loss.backward()
    expected = -torch.tensor([[2.0, 0.5, 0.0], [-1.0, -3.0, -1.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": "rank"}, "scale"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"eps_low": -0.1}, "clip"),
        ({"beta": -1.0}, "beta"),
        ({"num_iterations": 0}, "num_iterations"),
    ],
)
def test_grpo_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPO(**kwargs)


def test_kl_without_reference_is_a_clear_error():
    with pytest.raises(RuntimeError, match="reference log-probs"):
        GRPO(beta=0.1).loss(LOGPROBS, _inputs())


def test_loss_stats_list_what_was_reported_in_a_fixed_order_with_a_custom_objectives_own_last():
    from scgrpo.objectives.base import LossStats

    one, two, three = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)
    stats = LossStats(distill_coef=two, kl=one, extra={"my_stat": three})
    assert stats.items() == [("kl", one), ("distill_coef", two), ("my_stat", three)]
    assert LossStats().items() == []
