"""Options reach the math they name, and gradients match an independent computation.

Each expected value is derived by hand (in the docstring) or by plain fp32 autograd written here, never taken
from the code under test: SC-GRPO's c for every c_quantile (also from the ablation YAMLs), the 80/20 KL term
on unselected tokens, and the fused head's weight and bias gradients.
"""

import copy
import math
import os
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
import yaml

from scgrpo.objectives import SCGRPO, CreditInputs, HighEntropyGRPO, LossInputs, Objective
from scgrpo.objectives import functional as Fn
from scgrpo.rollout.types import PARTIAL, TeacherSignal

ABLATIONS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "ablations")

# The padded batch of test_scgrpo.py: G=4 partial-solve, rows 0-2 with a teacher, row 3 without; 9.0 is
# padding. Active D sorted: [0, 0, .05, .1, .2, .3, .4] (7 values, positions 0..6).
D = torch.tensor([[0.0, 0.1, 0.2, 0.4], [0.3, 0.0, 9.0, 9.0], [0.05, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 9.0]])
MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
REWARDS = torch.tensor([1.0, 1.0, 0.0, 0.0])
# P50: position 3 -> .1; P75: position 4.5 -> .2 + .5 x .1 = .25; P90: position 5.4 -> .3 + .4 x .1 = .34
C_BY_QUANTILE = {0.5: 0.1, 0.75: 0.25, 0.9: 0.34}


def _signal() -> TeacherSignal:
    return TeacherSignal(route=torch.tensor([PARTIAL] * 4), has_teacher=torch.tensor([True, True, True, False]),
                         is_reference=torch.zeros(4, dtype=torch.bool), diversity_mask=torch.zeros(4, 4),
                         references=["ref", "ref", "ref", None], divergence=D)


def _expected_weights(c: float) -> torch.Tensor:
    """f = D / (D + c) on the active tokens of rows 0-2, 0 at their padding, 1 on row 3's tokens (no teacher)."""
    weights = torch.zeros(4, 4)
    for i in range(3):
        for t in range(4):
            if MASK[i, t]:
                weights[i, t] = D[i, t] / (D[i, t] + c)
    weights[3] = MASK[3]
    return weights


@pytest.mark.parametrize("scope", ["batch", "micro_batch"])
@pytest.mark.parametrize("q", sorted(C_BY_QUANTILE))
def test_c_is_the_chosen_quantile_of_the_active_divergences(q, scope):
    c = C_BY_QUANTILE[q]
    credit = SCGRPO(c_quantile=q, c_scope=scope).credit(CreditInputs(REWARDS, MASK, 4, _signal()))
    assert credit.stats.c == pytest.approx(c)
    torch.testing.assert_close(credit.token_weights, _expected_weights(c))
    active = torch.tensor([0.0, 0.1, 0.2, 0.4, 0.3, 0.0, 0.05])
    assert credit.stats.f_mean == pytest.approx(float((active / (active + c)).mean()))
    assert credit.stats.f_above_half == pytest.approx(float((active > c).float().mean()))


def _objective_from_yaml(path: str) -> Objective:
    """The objective block of a YAML, built as the CLI builds ``model.objective`` (jsonargparse, by type)."""
    from jsonargparse import ArgumentParser

    block = yaml.safe_load(open(path))["model"]["objective"]
    parser = ArgumentParser()
    parser.add_argument("--objective", type=Optional[Objective])
    return parser.instantiate_classes(parser.parse_object({"objective": block})).objective


@pytest.mark.parametrize("name, q", [("c_p50.yaml", 0.5), ("c_p75.yaml", 0.75), ("c_p90.yaml", 0.9)])
def test_the_threshold_ablations_build_an_objective_with_their_quantile(name, q):
    """Not only the saved config: the objective built from the ablation weighs tokens with its own c."""
    objective = _objective_from_yaml(os.path.join(ABLATIONS, name))
    credit = objective.credit(CreditInputs(REWARDS, MASK, 4, _signal()))
    assert credit.stats.c == pytest.approx(C_BY_QUANTILE[q])
    torch.testing.assert_close(credit.token_weights, _expected_weights(C_BY_QUANTILE[q]))


def test_the_80_20_kl_term_counts_unselected_tokens_in_value_and_gradient():
    """Every token has p = .5; the reference gives .25 to three *unselected* tokens and .5 elsewhere.
    k3 with r = log p_ref - log p = -ln 2: e^r - r - 1 = ln 2 - .5 on those three, 0 elsewhere.
    On-policy the surrogate of a selected token is -A: (0,0) gives -1, (1,1) gives +2.
    loss = (1 + 0.1 x 3 (ln 2 - .5)) / 5 (token-mean over the 5 response tokens).
    Gradient in log p: selected tokens -A / 5; the KL tokens beta (1 - e^r) / 5 = .1 x .5 / 5 = .01."""
    logprobs = torch.full((2, 3), math.log(0.5), requires_grad=True)
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    selection = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    inputs = LossInputs(completion_mask=mask, advantages=torch.tensor([1.0, -2.0]), old_logprobs=logprobs.detach(),
                        ref_logprobs=ref, token_selection=selection, num_tokens=5.0)
    out = HighEntropyGRPO(beta=0.1).loss(logprobs, inputs)
    k3 = math.log(2.0) - 0.5
    assert out.loss.item() == pytest.approx((1.0 + 0.1 * 3 * k3) / 5, abs=1e-6)
    assert out.stats.kl.item() == pytest.approx(3 * k3 / 5, abs=1e-6)  # mean over all response tokens
    out.loss.backward()
    expected = torch.tensor([[-1.0 / 5, 0.01, 0.01], [0.01, 2.0 / 5, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_heads_gradients_equal_plain_autograd_bias_included(temperature):
    """fp32 head with a bias, 15 tokens in chunks of 4: the hand-written backward gives the gradients of
    log_softmax(h W^T + b)[y] / T that autograd gives on a copy of the head; the bias gradient is also
    checked by hand: sum over tokens of w_t (onehot(y_t) - softmax_t) / T."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 41)
    with torch.no_grad():
        head.bias.normal_()
    reference_head = copy.deepcopy(head)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    targets = torch.randint(0, 41, (3, 5))
    weights = torch.randn(3, 5)

    logprobs, _ = Fn.chunked_token_logprobs(hidden, head, targets, temperature, chunk_size=4)
    (logprobs * weights).sum().backward()
    logits = F.linear(reference_hidden, reference_head.weight, reference_head.bias) / temperature  # [3, 5, 41]
    reference = F.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (reference * weights).sum().backward()

    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.bias.grad, reference_head.bias.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad, reference_head.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        by_hand = ((F.one_hot(targets, 41) - logits.softmax(-1)) * weights.unsqueeze(-1)).sum((0, 1)) / temperature
    torch.testing.assert_close(head.bias.grad, by_hand, atol=1e-5, rtol=1e-5)


def test_the_divergence_head_keeps_its_bias():
    """A head with a bias: D equals the KL of log_softmax(h W^T + b) written out here (the bias shifts each
    token's logits differently, so dropping it changes D)."""
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 17)
    with torch.no_grad():
        head.bias.mul_(5.0)
    teacher, student = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    got = Fn.chunked_divergence(teacher, student, head, "forward_kl", temperature=0.9, chunk_size=4)
    with torch.no_grad():
        t = F.log_softmax((teacher @ head.weight.t() + head.bias) / 0.9, -1)
        s = F.log_softmax((student @ head.weight.t() + head.bias) / 0.9, -1)
    torch.testing.assert_close(got, (t.exp() * (t - s)).sum(-1), atol=1e-6, rtol=1e-5)


def test_quantile_refuses_what_is_not_a_non_empty_vector():
    with pytest.raises(ValueError, match="1-D"):
        Fn.quantile(torch.ones(2, 2), 0.5)
    with pytest.raises(ValueError, match="1-D"):
        Fn.quantile(torch.ones(0), 0.5)
    with pytest.raises(ValueError, match="q must be"):
        Fn.quantile(torch.ones(3), 1.5)


@pytest.mark.parametrize("flags, routes", [
    ({}, ("partial", "solve_none")),
    ({"route_solve_none": False}, ("partial",)),
    ({"route_single": True}, ("partial", "solve_none", "single")),
    ({"route_all": True, "route_solve_none": False}, ("partial", "all")),
])
def test_scgrpo_asks_for_the_routes_its_flags_name(flags, routes):
    spec = SCGRPO(**flags, teacher="base", buffer_references=True, seed=5).teacher
    assert spec.routes == routes and spec.output == "divergence" and spec.weights == "base"
    assert spec.buffer_references and spec.seed == 5 and spec.divergence == "forward_kl"


def test_every_advantage_scale_named_in_the_docs_is_accepted():
    """rewards [1, 0 | 1, 1]: centred [.5, -.5, 0, 0]; group std [.7071, .7071, 0, 0]; batch std .5."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    from scgrpo.objectives import GRPO

    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    torch.testing.assert_close(GRPO(scale="none").advantages(rewards, 2), centred)
    torch.testing.assert_close(GRPO(scale="batch").advantages(rewards, 2), centred / (0.5 + 1e-4))
    torch.testing.assert_close(GRPO(scale="group").advantages(rewards, 2), centred / torch.tensor(
        [math.sqrt(0.5) + 1e-4, math.sqrt(0.5) + 1e-4, 1e-4, 1e-4]))
