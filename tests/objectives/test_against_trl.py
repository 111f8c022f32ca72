"""Our GRPO, Dr. GRPO and DAPO losses against TRL's GRPOTrainer._compute_loss on random inputs.

Independent implementation: trl 1.16 (a test-only dependency). Its ``_compute_loss`` is called on a trainer
object created without ``__init__`` (no model, no training run), with the attributes the loss reads set by
hand and its log-prob function replaced by one that returns our random log-probs; the returned loss and the
gradient with respect to those log-probs are compared with ours.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from scgrpo.objectives import DAPO, GRPO, GSPO, DrGRPO, LossInputs

trl = pytest.importorskip("trl")


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(logprobs, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_len, level="token"):
    from trl import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=max_len, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        accelerator=_Accelerator(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None)
    n, c = logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, c, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
    }
    if beta:
        inputs["ref_per_token_logps"] = ref
    return trainer._compute_loss(None, inputs)


CASES = [
    ("grpo", lambda: GRPO(aggregation="seq-mean-token-mean"), 0.2, 0.2, 0.0),
    ("grpo", lambda: GRPO(aggregation="seq-mean-token-mean", beta=0.04), 0.2, 0.2, 0.04),
    ("bnpo", lambda: GRPO(aggregation="token-mean", eps_high=0.3), 0.2, 0.3, 0.0),
    ("dr_grpo", lambda: DrGRPO(), 0.2, 0.2, 0.0),
    ("dapo", lambda: DAPO(), 0.2, 0.28, 0.0),
]


@pytest.mark.parametrize("loss_type, make, eps_low, eps_high, beta", CASES, ids=[c[0] + str(c[4]) for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_match_trl(loss_type, make, eps_low, eps_high, beta, seed):
    torch.manual_seed(seed)
    n, c, max_len = 8, 11, 16
    old = -torch.rand(n, c, dtype=torch.float64) * 3
    logprobs = (old + 0.4 * torch.randn(n, c, dtype=torch.float64)).requires_grad_()  # ratios well past the clip range
    ref = old + 0.3 * torch.randn(n, c, dtype=torch.float64)
    advantages = torch.randn(n, dtype=torch.float64)
    lengths = torch.randint(1, c + 1, (n,))
    mask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).double()

    theirs = _trl_loss(logprobs, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_len)
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    objective = make()
    ours = objective.loss(
        logprobs, LossInputs(completion_mask=mask, advantages=advantages, old_logprobs=old, ref_logprobs=ref, max_len=max_len)
    ).loss
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-6, rtol=1e-6)


GSPO_CASES = [
    ("grpo", lambda: GSPO(eps_low=0.02, eps_high=0.03), 0.02, 0.03, 0.0),  # (clip ranges the random ratios cross)
    ("grpo", lambda: GSPO(), 3e-4, 4e-4, 0.0),
    ("grpo", lambda: GSPO(beta=0.04, eps_low=0.02, eps_high=0.03), 0.02, 0.03, 0.04),
    ("bnpo", lambda: GRPO(aggregation="token-mean", importance_sampling="sequence"), 0.2, 0.2, 0.0),
]


@pytest.mark.parametrize("loss_type, make, eps_low, eps_high, beta", GSPO_CASES,
                         ids=["gspo", "gspo-paper-clip", "gspo-kl", "grpo-sequence-token-mean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_level_ratios_match_trl(loss_type, make, eps_low, eps_high, beta, seed):
    """GSPO against TRL's ``importance_sampling_level="sequence"``: loss and gradient, with rows whose ratios fall
    inside, above and below the clip range."""
    torch.manual_seed(seed)
    n, c, max_len = 8, 11, 16
    old = -torch.rand(n, c, dtype=torch.float64) * 3
    shift = 0.04 * torch.randn(n, 1, dtype=torch.float64)  # (each row's own drift: its mean log-ratio)
    logprobs = (old + shift + 0.05 * torch.randn(n, c, dtype=torch.float64)).requires_grad_()
    ref = old + 0.3 * torch.randn(n, c, dtype=torch.float64)
    advantages = torch.randn(n, dtype=torch.float64)
    lengths = torch.randint(1, c + 1, (n,))
    mask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).double()
    theirs = _trl_loss(logprobs, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_len, "sequence")
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    objective = make()
    out = objective.loss(logprobs, LossInputs(completion_mask=mask, advantages=advantages, old_logprobs=old,
                                              ref_logprobs=ref, max_len=max_len))
    (grad_ours,) = torch.autograd.grad(out.loss, logprobs)
    assert out.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-6, rtol=1e-6)
    if eps_low == 0.02:  # the cases were chosen so that some rows clip and some do not
        assert 0 < out.stats.clip_fraction.item() < 1


def test_a_sequence_ratio_is_the_exponential_of_the_rows_mean_log_ratio_by_hand():
    # one row of 2 tokens, log-ratios 0.1 and 0.3: s = exp(0.2) = 1.2214 > 1 + 0.2, clipped for A = +1 (loss -1.2),
    # not for A = -1 (loss +1.2214); the padded token's log-ratio (5.0) counts nowhere
    logprobs = torch.tensor([[0.1, 0.3, 5.0], [0.1, 0.3, 5.0]], dtype=torch.float64)
    old = torch.zeros_like(logprobs)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    objective = GRPO(aggregation="seq-mean-token-mean", importance_sampling="sequence")
    for advantage, expected in ((1.0, -1.2), (-1.0, math.exp(0.2))):
        out = objective.loss(logprobs, LossInputs(completion_mask=mask[:1], advantages=torch.tensor([advantage],
                             dtype=torch.float64), old_logprobs=old[:1]))
        assert out.loss.item() == pytest.approx(expected, abs=1e-9)
    with pytest.raises(ValueError, match="importance_sampling='row'"):
        GRPO(importance_sampling="row")


def test_the_sequence_level_clip_fraction_is_the_share_of_rows_clipped():
    # rows of 4 and 1 tokens, the long one's ratio exp(0.5) past 1.2 (clipped for A = +1), the short one's 1
    logprobs = torch.tensor([[0.5] * 4, [0.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0] * 4, [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    out = GRPO(importance_sampling="sequence").loss(logprobs, LossInputs(
        completion_mask=mask, advantages=torch.tensor([1.0, 1.0], dtype=torch.float64),
        old_logprobs=torch.zeros_like(logprobs)))
    assert out.stats.clip_fraction.item() == 0.5  # (a token share would be 4 of 5)
