"""SC-GRPO's math against values derived by hand and independent computations: divergences, f(D), c, the
solve-none diversity advantage, and the fp32 / clamping rules of the divergence."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scgrpo.objectives import SCGRPO, CreditInputs, functional as Fn
from scgrpo.selfteacher import ALL, PARTIAL, SINGLE, SOLVE_NONE, TeacherSignal

P_T = torch.tensor([0.5, 0.25, 0.25])
P_S = torch.tensor([0.25, 0.5, 0.25])
LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("forward_kl", 0.5 * LN2 + 0.25 * math.log(0.5)),  # sum p_T log(p_T / p_S)
        ("reverse_kl", 0.25 * math.log(0.5) + 0.5 * LN2),  # sum p_S log(p_S / p_T)
        ("jsd", 0.5 * math.log(0.5 / 0.375) + 0.25 * math.log(0.25 / 0.375)),  # symmetric pair, m = .375 .375 .25
        ("bidirectional", 0.5 * (0.5 * LN2 + 0.25 * math.log(0.5)) + 0.5 * (0.25 * math.log(0.5) + 0.5 * LN2)),
    ],
)
def test_divergence_on_a_toy_vocabulary(kind, expected):
    d = Fn.divergence_from_logprobs(P_T.log().unsqueeze(0), P_S.log().unsqueeze(0), kind)
    assert d.item() == pytest.approx(expected, abs=1e-6)


def test_forward_kl_puts_the_teacher_first_as_torch_kl_div_does():
    """D_i,t = KL(teacher || student): ``F.kl_div(input=log student, target=log teacher)`` is exactly that."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(5, 11), -1)
    student = torch.log_softmax(torch.randn(5, 11), -1)
    reference = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)  # KL(p_T || p_S)
    torch.testing.assert_close(Fn.divergence_from_logprobs(teacher, student, "forward_kl"), reference)
    swapped = F.kl_div(teacher, student, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(Fn.divergence_from_logprobs(teacher, student, "reverse_kl"), swapped)
    assert (reference - swapped).abs().max() > 1e-3  # the direction matters on this pair


@pytest.mark.parametrize("kind", Fn.DIVERGENCES)
def test_chunked_divergence_equals_the_full_tensor(kind):
    torch.manual_seed(0)
    head = torch.nn.Linear(12, 50, bias=False)
    teacher, student = torch.randn(3, 7, 12), torch.randn(3, 7, 12)
    chunked = Fn.chunked_divergence(teacher, student, head, kind, temperature=0.8, chunk_size=4)
    with torch.no_grad():
        naive = Fn.divergence_from_logprobs(
            torch.log_softmax(head(teacher) / 0.8, -1), torch.log_softmax(head(student) / 0.8, -1), kind)
    torch.testing.assert_close(chunked, naive, atol=1e-6, rtol=1e-5)


def test_divergence_logits_are_computed_in_fp32_from_bf16_states():
    """bf16 hidden states and head with logits of a language model's size (~10): the divergence equals the
    float64 computation on the same (bf16) values to fp32 rounding (2e-5 on KLs up to ~1); bf16 logits upcast afterwards would be off by far
    more (the old noise floor, about the paper's c_min of 1e-4)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False)
    with torch.no_grad():
        head.weight.mul_(40.0)
    head = head.to(torch.bfloat16)
    teacher = torch.randn(2, 16, 64).to(torch.bfloat16)
    student = (teacher.float() + 0.05 * torch.randn(2, 16, 64)).to(torch.bfloat16)
    exact = Fn.divergence_from_logprobs(
        torch.log_softmax(teacher.double() @ head.weight.double().t(), -1),
        torch.log_softmax(student.double() @ head.weight.double().t(), -1), "forward_kl")
    ours = Fn.chunked_divergence(teacher, student, head, "forward_kl", chunk_size=8)
    assert (ours.double() - exact).abs().max() < 2e-5
    with torch.no_grad():
        bf16_logits = Fn.divergence_from_logprobs(
            torch.log_softmax(head(teacher).float(), -1), torch.log_softmax(head(student).float(), -1), "forward_kl")
    assert (bf16_logits.double() - exact).abs().max() > 1e-2


def test_a_slightly_negative_kl_is_clamped_at_zero():
    """Two distributions equal up to fp32 rounding can give a KL of about -1e-8; D must be >= 0 (a negative
    D would give a negative weight)."""
    torch.manual_seed(3)
    head = torch.nn.Linear(16, 3000, bias=False)
    teacher = torch.randn(4, 64, 16)
    student = teacher + 1e-7 * torch.randn(4, 64, 16)
    with torch.no_grad():
        raw = Fn.divergence_from_logprobs(torch.log_softmax(head(teacher), -1), torch.log_softmax(head(student), -1))
    assert (raw < 0).any()  # the unclamped formula does go negative on this input
    clamped = Fn.chunked_divergence(teacher, student, head)
    assert (clamped >= 0).all() and torch.equal(clamped, raw.clamp(min=0.0))


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_quantile_by_sorting_equals_torch_quantile(q):
    values = torch.randn(1001)
    torch.testing.assert_close(Fn.quantile(values, q), torch.quantile(values, q))


def test_quantile_works_above_torch_quantile_limit():
    values = torch.arange(2**24 + 1, dtype=torch.float32)  # torch.quantile refuses more than 2^24 elements
    with pytest.raises(RuntimeError):
        torch.quantile(values, 0.5)
    assert float(Fn.quantile(values, 0.5)) == 2**23
    assert float(Fn.quantile(values, 0.75)) == 0.75 * 2**24


def _signal(route, has_teacher, divergence, diversity_length=None, is_reference=None):
    n, c = divergence.shape
    lengths = torch.tensor(diversity_length or [0] * n)
    return TeacherSignal(
        route=torch.tensor(route), has_teacher=torch.tensor(has_teacher),
        is_reference=torch.tensor(is_reference or [False] * n),
        diversity_mask=(torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).float(),
        references=["ref" if t else None for t in has_teacher], divergence=divergence)


def test_weights_and_c_by_hand_on_a_padded_batch():
    """Group of G=4, partial-solve (rewards 1, 1, 0, 0). Rows 0-2 have a teacher, row 3 none. Padding (9.0)
    and the teacher-less row's values must not enter the quantile.

    Active D: row 0 [0, .1, .2, .4], row 1 [.3, 0], row 2 [.05] -> sorted [0, 0, .05, .1, .2, .3, .4];
    P75 at position .75 x 6 = 4.5 -> .2 + .5 x (.3 - .2) = .25 = c. f = D / (D + .25)."""
    d = torch.tensor([[0.0, 0.1, 0.2, 0.4], [0.3, 0.0, 9.0, 9.0], [0.05, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    signal = _signal([PARTIAL] * 4, [True, True, True, False], d)
    credit = SCGRPO().credit(CreditInputs(torch.tensor([1.0, 1.0, 0.0, 0.0]), mask, 4, signal))
    assert credit.stats.c == pytest.approx(0.25)
    expected = torch.tensor([[0.0, 0.1 / 0.35, 0.2 / 0.45, 0.4 / 0.65], [0.3 / 0.55, 0.0, 0, 0],
                             [0.05 / 0.3, 0, 0, 0], [1.0, 1.0, 1.0, 0.0]])  # row 3: no teacher -> weight 1
    torch.testing.assert_close(credit.token_weights, expected)
    assert (credit.token_weights[:3][mask[:3].bool()] < 1).all()  # f only ever shrinks
    std = torch.tensor([1.0, 1, 0, 0]).std()
    torch.testing.assert_close(credit.advantages, torch.tensor([0.5, 0.5, -0.5, -0.5]) / (std + 1e-4))  # GRPO's
    assert credit.stats.f_above_half == pytest.approx(2 / 7)  # .4/.65 and .3/.55
    assert credit.stats.kl_p50 == pytest.approx(0.1)


def test_c_min_floor_and_c_fixed():
    d = torch.zeros(4, 3)
    mask = torch.ones(4, 3)
    signal = _signal([PARTIAL] * 4, [True] * 4, d)
    credit = SCGRPO().credit(CreditInputs(torch.tensor([1.0, 1.0, 0.0, 0.0]), mask, 4, signal))
    assert credit.stats.c == pytest.approx(1e-4)  # all-zero KL: c = c_min, every weight 0
    assert torch.equal(credit.token_weights, torch.zeros(4, 3))
    d = torch.full((4, 3), 0.5)
    credit = SCGRPO(c_fixed=1.5).credit(CreditInputs(torch.tensor([1.0, 1.0, 0.0, 0.0]), mask, 4, _signal([PARTIAL] * 4, [True] * 4, d)))
    torch.testing.assert_close(credit.token_weights, torch.full((4, 3), 0.25))


def test_micro_batch_scope_takes_c_per_block_of_rows():
    d = torch.tensor([[0.1, 0.1], [0.1, 0.1], [0.9, 0.9], [0.9, 0.9]])
    mask = torch.ones(4, 2)
    signal = _signal([PARTIAL] * 4, [True] * 4, d)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    batch = SCGRPO().credit(CreditInputs(rewards, mask, 4, signal, micro_batch_size=2))
    micro = SCGRPO(c_scope="micro_batch").credit(CreditInputs(rewards, mask, 4, signal, micro_batch_size=2))
    torch.testing.assert_close(batch.token_weights, d / (d + 0.9))  # one c = P75 of all = .9
    torch.testing.assert_close(micro.token_weights, torch.full((4, 2), 0.5))  # each block's c is its own D


def test_solve_none_diversity_advantage_by_hand():
    """G = 4, all wrong; row 2 is the reference. c fixed at 1, so f = D / (D + 1).
    Row 0: D [1, 1, 3], L = 2 -> f [.5, .5] -> s = .5. Row 1: D [0, 0], L = 2 -> s = 0.
    Row 3: D [3, 1], L = 1 (the reference is 1 token long) -> s = f(3) = .75; its second token is past L.
    mean = 1.25 / 3; unbiased std over the three; A_div = (s - mean) / (std + 1e-4); advantage alpha x A_div;
    the reference row gets 0."""
    d = torch.tensor([[1.0, 1.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    signal = _signal([SOLVE_NONE] * 4, [True, True, False, True], d, diversity_length=[2, 2, 0, 1],
                     is_reference=[False, False, True, False])
    s = torch.tensor([0.5, 0.0, 0.75])
    mean = s.mean()
    std = math.sqrt(float(((s - mean) ** 2).sum()) / 2)
    a_div = (s - mean) / (std + 1e-4)
    for alpha in (0.1, 0.2):
        credit = SCGRPO(c_fixed=1.0, alpha=alpha).credit(CreditInputs(torch.zeros(4), mask, 4, signal))
        expected = torch.tensor([a_div[0], a_div[1], 0.0, a_div[2]]) * alpha
        torch.testing.assert_close(credit.advantages, expected)
        torch.testing.assert_close(credit.token_weights[0], torch.tensor([0.5, 0.5, 0.75]))  # f applies in the loss
        assert credit.stats.div_adv_std == pytest.approx(float(expected[[0, 1, 3]].std()), rel=1e-5)
    # without the truncation at the reference's length row 3 would score (.75 + .5) / 2 instead
    untruncated = _signal([SOLVE_NONE] * 4, [True, True, False, True], d, diversity_length=[2, 2, 0, 2],
                          is_reference=[False, False, True, False])
    other = SCGRPO(c_fixed=1.0).credit(CreditInputs(torch.zeros(4), mask, 4, untruncated))
    assert not torch.allclose(other.advantages, SCGRPO(c_fixed=1.0).credit(CreditInputs(torch.zeros(4), mask, 4, signal)).advantages)


def test_unrouted_solve_none_groups_keep_grpo_advantages():
    """With route_solve_none off a group with no correct rollout is plain GRPO: with graded rewards below the
    threshold its advantages are GRPO's, not zeroed; with the route on they are alpha x A_div."""
    rewards = torch.tensor([0.5, 0.0, 0.25, 0.0])  # no rollout reaches the threshold 1.0
    mask = torch.ones(4, 2)
    unrouted = _signal([SOLVE_NONE] * 4, [False] * 4, torch.zeros(4, 2))
    credit = SCGRPO(route_solve_none=False).credit(CreditInputs(rewards, mask, 4, unrouted))
    assert torch.equal(credit.advantages, Fn.group_advantages(rewards, 4)) and credit.advantages.abs().sum() > 0
    routed = _signal([SOLVE_NONE] * 4, [True, True, True, False], torch.tensor([[0.1, 0.1], [0.2, 0.2], [0.4, 0.4],
                     [0.0, 0.0]]), diversity_length=[2, 2, 2, 0], is_reference=[False, False, False, True])
    credit = SCGRPO().credit(CreditInputs(rewards, mask, 4, routed))
    assert credit.advantages[3] == 0 and credit.advantages[:3].abs().max() <= 0.1 * 2  # alpha x standardised scores


def test_single_and_all_correct_groups_keep_grpo_advantages_and_weight_one():
    d = torch.rand(8, 3)
    mask = torch.ones(8, 3)
    signal = _signal([SINGLE] * 4 + [ALL] * 4, [False] * 8, d)
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])
    credit = SCGRPO().credit(CreditInputs(rewards, mask, 4, signal))
    assert torch.equal(credit.token_weights, mask)
    assert torch.equal(credit.advantages, Fn.group_advantages(rewards, 4))


def test_removed_options_name_their_replacement():
    with pytest.raises(ValueError, match="c_quantile"):
        SCGRPO(w_max=5.0)
    with pytest.raises(ValueError, match="c_quantile"):
        SCGRPO(lam=1.0)
    with pytest.raises(ValueError, match="question stays in the user turn"):
        SCGRPO(teacher_template="{question} {reference}")


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "bidirectional"])
def test_chunked_distillation_gradient_equals_autograd_in_states_and_head(kind):
    """The distillation term's gradient reaches the student's states and the head's weight (full fine-tuning
    trains the head), equal to plain autograd on the full tensors."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 40, bias=False).double()
    teacher = torch.randn(2, 5, 8, dtype=torch.float64)
    student = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 5)
    kl = Fn.chunked_distill_divergence(student, teacher, head, kind, temperature=0.9, chunk_size=3)
    (kl * weights).sum().backward()
    grad_states, grad_head = student.grad.clone(), head.weight.grad.clone()
    student.grad, head.weight.grad = None, None
    naive = Fn.divergence_from_logprobs(
        torch.log_softmax(head(teacher).detach() / 0.9, -1), torch.log_softmax(head(student) / 0.9, -1), kind)
    (naive * weights.double()).sum().backward()
    torch.testing.assert_close(kl, naive.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_states, student.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_head, head.weight.grad, atol=1e-6, rtol=1e-5)


PEAK_SCRIPT = """
import resource, torch
from scgrpo.objectives.functional import chunked_divergence
torch.manual_seed(0)
head = torch.nn.Linear(64, 32000, bias=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for T in (512, 4096):
    teacher, student = torch.randn(1, T, 64), torch.randn(1, T, 64)
    chunked_divergence(teacher, student, head, "forward_kl", chunk_size=256)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def test_peak_memory_of_the_chunked_divergence_does_not_grow_with_length():
    """Measured in a fresh process: at 4096 tokens the whole computation peaks below the 4096 x 32000 x 4 B =
    500 MiB that a single fp32 full-vocabulary tensor of that length would take (the naive computation holds
    several), and going from 512 to 4096 tokens adds far less than that."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True)
    short, long = (int(line) for line in out.stdout.strip().splitlines()[-2:])
    full_tensor_kib = 4096 * 32000 * 4 // 1024
    assert long < full_tensor_kib, (short, long)
    assert long - short < full_tensor_kib // 2, (short, long)


def test_a_solve_none_row_without_a_window_is_not_scored():
    """As the hand-worked case above, with row 3's window 0 (under ``diversity_min_tokens``): rows 0 and 1 are
    standardised between themselves, row 3 gets 0 rather than the lowest score's advantage."""
    d = torch.tensor([[1.0, 1.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    signal = _signal([SOLVE_NONE] * 4, [True, True, False, True], d, diversity_length=[2, 2, 0, 0],
                     is_reference=[False, False, True, False])
    s = torch.tensor([0.5, 0.0])
    a_div = (s - s.mean()) / (s.std() + 1e-4)
    credit = SCGRPO(c_fixed=1.0).credit(CreditInputs(torch.zeros(4), mask, 4, signal))
    torch.testing.assert_close(credit.advantages, torch.tensor([a_div[0], a_div[1], 0.0, 0.0]) * 0.1)
    assert credit.stats.div_adv_std == pytest.approx(float(credit.advantages[:2].std()), rel=1e-5)  # the scored rows
