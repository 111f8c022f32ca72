"""SC-GRPO's divergences and weights against values derived by hand, and its reduction to GRPO."""

import math
import subprocess
import sys

import pytest
import torch

from scgrpo.objectives import SCGRPO, functional as Fn

P_T = torch.tensor([0.5, 0.25, 0.25])
P_S = torch.tensor([0.25, 0.5, 0.25])
LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("forward_kl", 0.5 * LN2 + 0.25 * math.log(0.5)),  # sum p_T log(p_T / p_S)
        ("reverse_kl", 0.25 * math.log(0.5) + 0.5 * LN2),  # sum p_S log(p_S / p_T)
        ("jsd", 0.5 * math.log(0.5 / 0.375) + 0.25 * math.log(0.25 / 0.375)),  # symmetric pair, m = .375 .375 .25
        ("sampled", LN2),  # |log .5 - log .25| at token 0
    ],
)
def test_divergence_on_a_toy_vocabulary(kind, expected):
    d = Fn.divergence_from_logprobs(P_T.log().unsqueeze(0), P_S.log().unsqueeze(0), torch.tensor([0]), kind)
    assert d.item() == pytest.approx(expected, abs=1e-6)


def test_forward_kl_of_asymmetric_pair_by_hand():
    p_t, p_s = torch.tensor([0.9, 0.1]), torch.tensor([0.5, 0.5])
    forward = Fn.divergence_from_logprobs(p_t.log(), p_s.log(), torch.tensor(0), "forward_kl").item()
    reverse = Fn.divergence_from_logprobs(p_t.log(), p_s.log(), torch.tensor(0), "reverse_kl").item()
    assert forward == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), abs=1e-6)
    assert reverse == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0), abs=1e-6)


def test_credit_weights_by_hand():
    d = torch.tensor([[1.0, 2.0, 3.0, 10.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # mean over the sequence = 16 / 4 = 4
    w = Fn.credit_weights(d, mask, w_max=5.0, lam=1.0)
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.5, 0.75, 2.5, 0.0]]))
    w = Fn.credit_weights(d, mask, w_max=2.0, lam=1.0)
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.5, 0.75, 2.0, 0.0]]))
    w = Fn.credit_weights(d, mask, w_max=2.0, lam=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.625, 0.75, 0.875, 1.5, 0.0]]))
    w = Fn.credit_weights(d, mask, w_max=2.0, lam=0.0)
    torch.testing.assert_close(w, mask)
    # before clipping, the mean weight of a sequence is 1
    unclipped = Fn.credit_weights(torch.rand(3, 6), torch.ones(3, 6), w_max=1e9)
    torch.testing.assert_close(unclipped.mean(1), torch.ones(3), atol=1e-5, rtol=0)


def test_scgrpo_weights_are_one_without_reference():
    objective = SCGRPO()
    d, mask = torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.ones(2, 2)
    w = objective.token_weights(d, mask, torch.tensor([True, False]))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5], [1.0, 1.0]]))


@pytest.mark.parametrize("kind", Fn.DIVERGENCES)
def test_chunked_divergence_equals_the_full_tensor(kind):
    torch.manual_seed(0)
    head = torch.nn.Linear(12, 50, bias=False)
    teacher, student = torch.randn(3, 7, 12), torch.randn(3, 7, 12)
    targets = torch.randint(0, 50, (3, 7))
    chunked = Fn.chunked_divergence(teacher, student, head, targets, kind, temperature=0.8, chunk_size=4)
    with torch.no_grad():
        naive = Fn.divergence_from_logprobs(
            torch.log_softmax(head(teacher) / 0.8, -1), torch.log_softmax(head(student) / 0.8, -1), targets, kind
        )
    torch.testing.assert_close(chunked, naive, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_chunked_distillation_gradient_equals_autograd(kind):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 40, bias=False).double()
    teacher = torch.randn(2, 5, 8, dtype=torch.float64)
    student = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 5)
    kl = Fn.chunked_distill_kl(student, teacher, head, kind, temperature=0.9, chunk_size=3)
    (kl * weights).sum().backward()
    grad = student.grad.clone()
    student.grad = None
    naive = Fn.divergence_from_logprobs(
        torch.log_softmax(head(teacher) / 0.9, -1), torch.log_softmax(head(student) / 0.9, -1), None, kind
    )
    (naive * weights.double()).sum().backward()
    torch.testing.assert_close(kl, naive.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, student.grad, atol=1e-6, rtol=1e-5)


PEAK_SCRIPT = """
import resource, sys, torch
from scgrpo.objectives.functional import chunked_divergence
torch.manual_seed(0)
T = int(sys.argv[1])
head = torch.nn.Linear(64, 32000, bias=False)
teacher, student = torch.randn(1, T, 64), torch.randn(1, T, 64)
targets = torch.randint(0, 32000, (1, T))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
chunked_divergence(teacher, student, head, targets, "forward_kl", chunk_size=256)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_peak_memory_of_the_chunked_divergence_does_not_grow_with_length():
    """Measured in a fresh process: at 4096 tokens the whole computation peaks below the 4096 x 32000 x 4 B =
    500 MiB that a single fp32 full-vocabulary tensor of that length would take (the naive computation holds
    several), and going from 512 to 4096 tokens adds far less than that."""

    def peak_kib(tokens: int) -> int:
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tokens)], capture_output=True, text=True, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    short, long = peak_kib(512), peak_kib(4096)
    full_tensor_kib = 4096 * 32000 * 4 // 1024
    assert long < full_tensor_kib, (short, long)
    assert long - short < full_tensor_kib // 2, (short, long)
