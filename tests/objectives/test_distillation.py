"""The distillation objectives (additive self-distillation, OPSD) on small tensors: the loss and its gradient
against a per-token divergence written out here, which rows count, and the options' checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from scgrpo.objectives import GRPO, OPSD, Credit, DistillInputs, LossInputs, SelfDistillation
from scgrpo.objectives import functional as Fn
from scgrpo.rollout.types import TeacherSignal

V, H = 13, 6


def _divergence(teacher_logits, student_logits, kind, mix=0.5):
    """Per-token divergence from the textbook formulas, with torch's kl_div for the KLs."""
    t, s = F.log_softmax(teacher_logits, -1), F.log_softmax(student_logits, -1)
    forward = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # KL(teacher || student)
    reverse = F.kl_div(t, s, log_target=True, reduction="none").sum(-1)  # KL(student || teacher)
    if kind == "forward_kl":
        return forward
    if kind == "reverse_kl":
        return reverse
    if kind == "bidirectional":
        return mix * forward + (1 - mix) * reverse
    m = torch.log(0.5 * (t.exp() + s.exp()))
    return 0.5 * F.kl_div(m, t, log_target=True, reduction="none").sum(-1) + 0.5 * F.kl_div(
        m, s, log_target=True, reduction="none").sum(-1)  # jsd


def _case(seed=0, temperature=0.7):
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V)
    student = torch.randn(3, 4, H, requires_grad=True)
    teacher = torch.randn(3, 4, H)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    inputs = LossInputs(completion_mask=mask, advantages=torch.tensor([0.5, -1.0, 0.0]),
                        old_logprobs=torch.zeros(3, 4), temperature=temperature, chunk_size=5,
                        num_tokens=float(mask.sum()), num_sequences=3.0,
                        distill=DistillInputs(hidden=student, lm_head=head, teacher_hidden=teacher,
                                              has_teacher=torch.tensor([True, False, True]), num_teacher_rows=4.0))
    return head, student, teacher, mask, inputs


def _expected(head, student, teacher, mask, kind, temperature, clip=None, mix=0.5, rows=(0, 2), denominator=4.0):
    per_token = _divergence(head(teacher).detach() / temperature, head(student) / temperature, kind, mix)  # [3, 4]
    if clip is not None:
        per_token = per_token.clamp(max=clip)
    means = [(per_token[i] * mask[i]).sum() / mask[i].sum() for i in rows]
    return sum(means) / denominator, per_token


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "bidirectional", "jsd"])
def test_distillation_loss_is_each_teacher_rows_token_mean_over_the_batchs_teacher_rows(kind):
    """Rows 0 and 2 have a teacher; the batch (all ranks) has 4 such rows: loss = (mean_0 + mean_2) / 4.
    The gradient reaches the student's states and the head, as autograd through the formula gives."""
    head, student, teacher, mask, inputs = _case()
    loss, logged = Fn.distillation_loss(inputs, kind, mix=0.3)
    loss.backward()
    got_states, got_head, got_bias = student.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    student.grad, head.weight.grad, head.bias.grad = None, None, None
    expected, per_token = _expected(head, student, teacher, mask, kind, 0.7, mix=0.3)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    rows = mask[[0, 2]]
    assert logged.item() == pytest.approx(float((per_token[[0, 2]] * rows).sum() / rows.sum()), rel=1e-5)
    torch.testing.assert_close(got_states, student.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got_head, head.weight.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got_bias, head.bias.grad, atol=1e-6, rtol=1e-4)
    assert got_states[1].abs().max() == 0  # no teacher: no distillation gradient


def test_distillation_loss_clips_each_token_and_defaults_to_the_local_teacher_rows():
    head, student, teacher, mask, inputs = _case()
    _, per_token = _expected(head, student, teacher, mask, "jsd", 0.7)
    clip = float(per_token[[0, 2]][mask[[0, 2]].bool()].median())  # some tokens above the clip, some below
    inputs.distill.num_teacher_rows = None  # unset: the rows with a teacher here (2)
    loss, _ = Fn.distillation_loss(inputs, "jsd", token_clip=clip)
    expected, _ = _expected(head, student, teacher, mask, "jsd", 0.7, clip=clip, denominator=2.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_without_teacher_rows_the_distillation_term_is_zero_and_connected():
    head, student, teacher, mask, inputs = _case()
    inputs.distill.has_teacher = torch.tensor([False, False, False])
    loss, logged = Fn.distillation_loss(inputs, "forward_kl")
    assert loss.item() == 0.0 and math.isnan(logged.item())
    loss.backward()  # connected to the graph: backward runs and gives zeros
    assert student.grad is not None and student.grad.abs().max() == 0


@pytest.mark.parametrize("step, beta", [(0, 0.03), (5, 0.065), (10, 0.1), (30, 0.1)])
def test_additive_self_distillation_is_grpo_plus_beta_times_the_term(step, beta):
    head, student, teacher, mask, inputs = _case()
    inputs.step = step
    logprobs = torch.log(torch.full((3, 4), 0.3)).requires_grad_(True)
    inputs.old_logprobs = torch.log(torch.full((3, 4), 0.25))  # ratio 1.2, at the clip edge
    objective = SelfDistillation(divergence="reverse_kl", distill_coef=0.1, distill_coef_start=0.03, warmup_steps=10)
    out = objective.loss(logprobs, inputs)
    grpo = GRPO(aggregation="seq-mean-token-mean").loss(logprobs, inputs).loss
    distill, _ = _expected(head, student, teacher, mask, "reverse_kl", 0.7)
    assert out.loss.item() == pytest.approx(grpo.item() + beta * distill.item(), rel=1e-5)
    assert out.stats.distill_coef.item() == pytest.approx(beta)
    assert out.stats.clip_fraction is not None and out.stats.distill_kl.item() > 0


def test_opsd_has_no_rl_term_and_counts_the_rows_with_a_teacher():
    head, student, teacher, mask, inputs = _case()
    logprobs = torch.zeros(3, 4, requires_grad=True)
    out = OPSD(divergence="forward_kl", token_clip=None).loss(logprobs, inputs)
    expected, _ = _expected(head, student, teacher, mask, "forward_kl", 0.7)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    inputs.advantages = torch.tensor([5.0, 5.0, 5.0])  # rewards are only logged
    assert OPSD(divergence="forward_kl", token_clip=None).loss(logprobs, inputs).loss.item() == pytest.approx(
        expected.item(), rel=1e-5)
    clipped = OPSD(token_clip=0.01).loss(logprobs, inputs)  # jsd, every token clipped at 0.01
    assert clipped.loss.item() == pytest.approx(0.01 * 2 / 4, rel=1e-5)


def _signal(has_teacher):
    n = len(has_teacher)
    return TeacherSignal(route=torch.zeros(n, dtype=torch.long), has_teacher=torch.tensor(has_teacher),
                         is_reference=torch.zeros(n, dtype=torch.bool), diversity_mask=torch.zeros(n, 2),
                         references=[None] * n)


def test_rows_in_loss_of_the_distillation_objectives():
    credit = Credit(advantages=torch.tensor([0.0, 1.0, 0.0, -1.0]))
    signal = _signal([True, False, False, True])
    assert SelfDistillation().rows_in_loss(credit, signal).tolist() == [True, True, False, True]
    assert SelfDistillation().rows_in_loss(credit, None).tolist() == [False, True, False, True]
    assert OPSD().rows_in_loss(credit, signal).tolist() == [True, False, False, True]
    assert OPSD().rows_in_loss(credit, None).tolist() == [False, True, False, True]
    assert GRPO().rows_in_loss(credit, signal).tolist() == [False, True, False, True]
    assert GRPO(beta=0.1).rows_in_loss(credit, signal).tolist() == [True] * 4  # a KL term covers every row


def test_the_distillation_objectives_ask_for_the_teacher_they_describe():
    additive = SelfDistillation(teacher="base", buffer_references=True, seed=3)
    spec = additive.teacher
    assert spec.routes == ("partial", "single", "all") and spec.output == "hidden" and spec.weights == "base"
    assert spec.buffer_references and spec.seed == 3 and not spec.privileged
    assert additive.beta == 0.0 and additive.aggregation == "seq-mean-token-mean"
    oracle = OPSD()
    assert oracle.teacher.privileged and oracle.teacher.routes == () and oracle.teacher.weights == "base"
    assert oracle.teacher.output == "hidden" and oracle.divergence == "jsd" and oracle.token_clip == 0.05
    assert "{reference}" in oracle.teacher.template and oracle.num_iterations == 1
    assert OPSD(num_iterations=3).num_iterations == 3 and SelfDistillation(num_iterations=2).num_iterations == 2


@pytest.mark.parametrize("make, match", [
    (lambda: SelfDistillation(divergence="jsd"), "divergence"),
    (lambda: SelfDistillation(distill_coef=-0.1), "distill_coef"),
    (lambda: SelfDistillation(distill_coef_start=-0.1), "distill_coef"),
    (lambda: SelfDistillation(warmup_steps=-1), "warmup_steps"),
    (lambda: SelfDistillation(bidirectional_mix=1.5), "bidirectional_mix"),
    (lambda: SelfDistillation(bidirectional_mix=-0.1), "bidirectional_mix"),
    (lambda: SelfDistillation(teacher_template="no slot"), "reference"),
    (lambda: OPSD(divergence="bidirectional"), "divergence"),
    (lambda: OPSD(token_clip=0.0), "token_clip"),
    (lambda: OPSD(teacher_template="{question}"), "reference"),
])
def test_distillation_options_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_edge_values_of_the_distillation_options_are_accepted():
    assert SelfDistillation(bidirectional_mix=0.0).bidirectional_mix == 0.0
    assert SelfDistillation(bidirectional_mix=1.0, distill_coef=0.0, warmup_steps=0).coefficient(7) == 0.0
    assert OPSD(token_clip=None).token_clip is None


def test_a_warm_up_may_start_from_zero():
    objective = SelfDistillation(distill_coef=0.1, distill_coef_start=0.0, warmup_steps=4)
    assert [objective.coefficient(s) for s in (0, 2, 4)] == pytest.approx([0.0, 0.05, 0.1])
