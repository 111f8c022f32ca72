import math

import pytest
import torch

from scgrpo.objectives import functional as Fn


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group 1: mean 0.25, unbiased std sqrt(0.25) = 0.5 ; group 2: mean 0.5, std sqrt(1/3)
    expected_group = torch.tensor(
        [0.75 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4)]
        + [0.5 / (math.sqrt(1 / 3) + 1e-4)] * 2
        + [-0.5 / (math.sqrt(1 / 3) + 1e-4)] * 2
    )
    torch.testing.assert_close(Fn.group_advantages(rewards, 4, "group"), expected_group)
    expected_none = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    torch.testing.assert_close(Fn.group_advantages(rewards, 4, "none"), expected_none)
    batch_std = math.sqrt(((rewards - 0.375) ** 2).sum().item() / 7)
    torch.testing.assert_close(Fn.group_advantages(rewards, 4, "batch"), expected_none / (batch_std + 1e-4))


def test_equal_rewards_give_zero_advantage():
    assert torch.equal(Fn.group_advantages(torch.ones(6), 3, "group"), torch.zeros(6))


def test_group_advantages_rejects_bad_shapes_and_scale():
    with pytest.raises(ValueError, match="groups of 4"):
        Fn.group_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="unknown advantage scale"):
        Fn.group_advantages(torch.ones(4), 2, "rank")  # type: ignore[arg-type]


def test_clipped_surrogate_by_hand():
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[0.5, 1.0, 1.1, 1.5]]))  # ratios 0.5, 1.0, 1.1, 1.5
    loss, clipped = Fn.clipped_surrogate(logprobs, old, torch.tensor([[2.0]]), eps_low=0.2, eps_high=0.28)
    # A > 0: min(r A, clip(r) A) -> 0.5*2, 1*2, 1.1*2, 1.28*2
    torch.testing.assert_close(loss, -torch.tensor([[1.0, 2.0, 2.2, 2.56]]))
    assert clipped.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    loss, clipped = Fn.clipped_surrogate(logprobs, old, torch.tensor([[-1.0]]), eps_low=0.2, eps_high=0.28)
    # A < 0: min(-r, -clip(r)) -> -0.8 (clipped up to 0.8), -1, -1.1, -1.5
    torch.testing.assert_close(loss, torch.tensor([[0.8, 1.0, 1.1, 1.5]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_k3_by_hand():
    logprobs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    r = math.log(0.25) - math.log(0.5)
    torch.testing.assert_close(Fn.k3_kl(logprobs, ref), torch.tensor([math.exp(r) - r - 1]))
    assert Fn.k3_kl(ref, ref).item() == 0.0


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert Fn.aggregate(per_token, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert Fn.aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert Fn.aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        Fn.aggregate(per_token, mask, "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_over_slices_adds_up_to_whole(mode):
    torch.manual_seed(0)
    per_token, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    whole = Fn.aggregate(per_token, mask, mode, max_len=5)
    n_tok, n_seq = float(mask.sum()), 6.0
    parts = sum(
        Fn.aggregate(per_token[rows], mask[rows], mode, max_len=5, num_tokens=n_tok, num_sequences=n_seq)
        for rows in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    torch.testing.assert_close(parts, whole)


def test_masked_mean_of_empty_mask_is_zero():
    assert Fn.masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_naive_values_and_gradients(bias, temperature):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 97, bias=bias).double()
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 97, (3, 7))
    weights = torch.randn(3, 7)
    chunked, entropy = Fn.chunked_token_logprobs(hidden, head, targets, temperature, chunk_size=5)
    (chunked * weights).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    logits = head(hidden)
    naive = Fn.naive_token_logprobs(logits, targets, temperature)
    (naive * weights).sum().backward()
    torch.testing.assert_close(chunked, naive.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], head.weight.grad, atol=1e-5, rtol=1e-5)
    probs = torch.softmax(logits.float() / temperature, -1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_generic_head_path_matches_naive():
    """A head that is not a plain nn.Linear (e.g. an adapter wrapper) takes the checkpointed path."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 33)
    head = torch.nn.Sequential(linear)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 33, (2, 5))
    chunked, _ = Fn.chunked_token_logprobs(hidden, head, targets, 1.0, chunk_size=3)
    chunked.sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    naive = Fn.naive_token_logprobs(linear(hidden), targets)
    naive.sum().backward()
    torch.testing.assert_close(chunked, naive)
    torch.testing.assert_close(grad, hidden.grad)


def test_chunked_logprobs_never_compute_more_than_one_chunk_of_logits(monkeypatch):
    """Forward and backward compute logits one [chunk, V] block at a time, never [rows, V]."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 500, bias=False)
    hidden = torch.randn(4, 100, 8, requires_grad=True)
    targets = torch.randint(0, 500, (4, 100))
    rows_seen = []
    original = torch.nn.functional.linear

    def spy(x, w, b=None):
        rows_seen.append(x.shape[0])
        return original(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    lp, _ = Fn.chunked_token_logprobs(hidden, head, targets, chunk_size=64)
    lp.sum().backward()
    assert len(rows_seen) == 2 * 7  # 400 rows in 7 chunks, forward and backward
    assert max(rows_seen) == 64
