"""High-entropy-token GRPO (80/20): which tokens count, what the loss is divided by, and the KL term."""

import pytest
import torch

from scgrpo.objectives import HighEntropyGRPO, LossInputs
from scgrpo.objectives import functional as Fn


def test_high_entropy_mask_keeps_the_top_share():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.8, 0.2, 0.7, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    kept = HighEntropyGRPO(rho=0.3).token_mask(entropy, mask)  # 7 tokens; the top 30%: 0.9, 0.8 (and 0.7 at the edge)
    assert kept[0].tolist() == [0.0, 1.0, 0.0, 0.0] and kept[1, 0] == 1.0 and kept[1, 1] == 0.0


def test_the_loss_is_divided_by_all_response_tokens_and_the_kl_covers_every_token():
    """Token-mean: sum over the *selected* tokens' surrogate / number of *all* response tokens (TRL, the 80/20
    paper), plus beta x k3 KL on every token. On-policy (rho = 1) the surrogate of a token is -A."""
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.25, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5 response tokens
    selection = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # 2 of them selected
    inputs = LossInputs(completion_mask=mask, advantages=torch.tensor([1.0, -2.0]), old_logprobs=logprobs,
                        ref_logprobs=ref, token_selection=selection, num_tokens=5.0)
    out = HighEntropyGRPO(beta=0.1).loss(logprobs, inputs)
    k3 = Fn.k3_kl(logprobs, ref)  # [2, 3]: k3(.25/.5) at (0,0) and (1,1), 0 where equal
    expected = (-1.0 + 2.0) / 5 + 0.1 * float((k3 * mask).sum()) / 5
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert float((k3 * mask).sum()) > float((k3 * mask * selection).sum()) - 1e-9  # KL counted beyond the selection
