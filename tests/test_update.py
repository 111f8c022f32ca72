"""The update's planning and clipping on their own (a stand-in policy; the passes over a real model are in
tests/test_module.py and tests/test_update_behaviour.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

from scgrpo.objectives import GRPO, Credit, HighEntropyGRPO, LossOutput, Needs
from scgrpo.objectives.base import LossStats
from scgrpo.policy import PassOptions, Policy
from scgrpo.rollout.engine import GenerationSettings
from scgrpo.rollout.types import TeacherSpec, RolloutBatch, TeacherSignal
from scgrpo.update import NONFINITE, LossNorms, MismatchMeter, PolicyUpdate, StepPlan, StepSums, check_tis_cap, sampler_correction
from tests.test_guard import _plan, _rollouts


def _update(params=(), micro_batch_size=None, max_grad_norm=1.0, objective=None, entropy=None):
    policy = SimpleNamespace(generation=GenerationSettings(max_new_tokens=3), max_completion_tokens=3, device=torch.device("cpu"),
                             trainable_parameters=lambda: list(params), batch_entropy=lambda rollouts, micro: entropy)
    return PolicyUpdate(policy, objective or GRPO(), backward=lambda loss: None, micro_batch_size=micro_batch_size,
                        max_grad_norm=max_grad_norm)


def _four_rows():
    """Two groups of two: the first mixed (advantages +-), the second all correct (advantage 0)."""
    rollouts = _rollouts()
    doubled = rollouts.select(torch.tensor([0, 1, 0, 1]))
    doubled.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return doubled


@pytest.mark.parametrize("micro,chunks", [(None, [[0, 1]]), (1, [[0], [1]]), (5, [[0, 1]])])
def test_plan_keeps_rows_that_move_the_loss_in_micro_batches_and_counts_every_row(micro, chunks):
    rollouts = _four_rows()
    signal = TeacherSignal(route=torch.zeros(4, dtype=torch.long), has_teacher=torch.tensor([True, False, True, True]),
                           is_reference=torch.zeros(4, dtype=torch.bool), diversity_mask=torch.zeros(4, 3),
                           references=[None] * 4)
    plan = _update(micro_batch_size=micro).plan(rollouts, signal)
    assert plan.rows.tolist() == [0, 1] and [c.tolist() for c in plan.chunks] == chunks
    assert plan.num_chunks == len(chunks) and plan.global_rows == 2.0
    assert plan.norms.num_tokens == float(rollouts.completion_mask.sum()) == 6.0  # zero-advantage rows count too
    assert plan.norms.num_rows == 4.0 and plan.norms.num_teacher_rows == 3.0
    assert plan.selection is None and torch.equal(plan.rewards, rollouts.rewards)
    assert plan.credit.advantages[2:].abs().sum() == 0 and plan.credit.advantages[0] > 0 > plan.credit.advantages[1]


def test_a_batch_without_signal_plans_no_pass():
    rollouts = _four_rows()
    rollouts.rewards = torch.ones(4)
    plan = _update(micro_batch_size=1).plan(rollouts)
    assert plan.rows.numel() == 0 and plan.chunks == [] and plan.num_chunks == 0 and plan.global_rows == 0
    assert plan.norms.num_teacher_rows == 0.0


def test_plan_selects_tokens_from_the_batch_entropy_when_the_objective_asks():
    rollouts = _four_rows()
    entropy = torch.arange(12, dtype=torch.float32).view(4, 3)
    plan = _update(objective=HighEntropyGRPO(rho=0.5), entropy=entropy).plan(rollouts)
    assert plan.selection is not None and plan.selection.shape == (4, 3)
    assert torch.equal(plan.selection, HighEntropyGRPO(rho=0.5).token_mask(entropy, rollouts.completion_mask))


def test_clip_skips_on_a_nonfinite_loss_or_norm_and_clips_otherwise():
    w = torch.nn.Parameter(torch.zeros(2))
    plan = _plan()
    sums = StepSums()
    sums.add(NONFINITE, 1.0)
    assert _update([w]).clip(plan, sums) == "loss"
    w.grad = torch.tensor([3.0, 4.0])  # norm 5
    sums = StepSums()
    assert _update([w], max_grad_norm=1.0).clip(plan, sums) is None
    assert sums["grad_norm"] == pytest.approx(5.0) and torch.allclose(w.grad, torch.tensor([0.6, 0.8]), atol=1e-6)
    w.grad = torch.tensor([3.0, 4.0])
    assert _update([w], max_grad_norm=0.0).clip(plan, sums) is None  # 0: measured, not clipped
    assert sums["grad_norm"] == pytest.approx(10.0) and torch.equal(w.grad, torch.tensor([3.0, 4.0]))
    w.grad = torch.tensor([math.inf, 0.0])
    assert _update([w]).clip(plan, StepSums()) == "gradient norm"
    plan.global_rows = 0.0  # no row in the loss on any rank: nothing to clip or measure
    none = StepSums()
    assert _update([w]).clip(plan, none) is None and "grad_norm" not in none


def test_step_sums_name_the_objectives_own_statistics():
    sums = StepSums()
    for name, value in (("loss", 1.0), ("entropy", 0.5), ("clip_fraction", 0.1), ("kl", 0.2), (NONFINITE, 0.0),
                        ("distill_kl", 0.3), ("grad_norm", 2.0)):
        sums.add(name, value)
    sums.add("distill_kl", 0.3)
    assert sums.objective_stats() == {"distill_kl": pytest.approx(0.6)}
    assert sums.get("missing", 7.0) == 7.0 and "loss" in sums and sums["loss"] == 1.0


# --- plan, accumulation and the micro-batch loss with stand-ins for the objective and the policy ---------------


class _Recording:
    """A stand-in objective: records what the update hands it and answers with values set by the test."""

    needs = Needs()

    def __init__(self, advantages, in_loss=None, shaped=None):
        self.advantages, self.in_loss, self.shaped, self.calls = advantages, in_loss, shaped, {}

    def shape_rewards(self, rewards, lengths, max_len):
        self.calls["shape"] = (rewards.clone(), lengths.clone(), max_len)
        return rewards if self.shaped is None else self.shaped

    def credit(self, inputs):
        self.calls["credit"] = (inputs.rewards.clone(), inputs.mask.clone(), inputs.group_size, inputs.signal,
                                inputs.micro_batch_size, inputs.old_logprobs)
        return Credit(advantages=self.advantages)

    def rows_in_loss(self, credit, signal):
        self.calls["rows_in_loss"] = (credit, signal)
        return credit.advantages != 0 if self.in_loss is None else self.in_loss

    def loss(self, logprobs, inputs):
        self.calls["loss"] = (logprobs, inputs)
        return LossOutput(loss=(logprobs * inputs.completion_mask).sum())


def _three_rows(**fields):
    """Three rows (prompt ids 0, 1, 2 so a row's hidden states tell which row it is), 2 + 2 + 3 response tokens."""
    return RolloutBatch(prompt_ids=torch.tensor([[0, 0], [1, 1], [2, 2]]), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                        completion_ids=torch.tensor([[1, 4, 0], [3, 2, 0], [0, 1, 2]]),
                        completion_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
                        truncated=torch.zeros(3, dtype=torch.bool), group_size=3, sample_ids=["a"] * 3,
                        questions=["q"] * 3, answers=[1] * 3, completions=["x"] * 3,
                        rewards=torch.tensor([1.0, 0.0, 0.5]), **fields)


def test_plan_hands_the_objective_the_lengths_the_budget_and_the_shaped_rewards():
    rollouts = _three_rows()
    objective = _Recording(torch.tensor([0.0, -1.0, 2.0]), shaped=torch.tensor([0.9, 0.1, 0.4]))
    update = _update(micro_batch_size=1, objective=objective)
    signal = TeacherSignal(route=torch.zeros(3, dtype=torch.long), has_teacher=torch.tensor([False, True, False]),
                           is_reference=torch.zeros(3, dtype=torch.bool), diversity_mask=torch.zeros(3, 3),
                           references=[None] * 3)
    plan = update.plan(rollouts, signal)
    rewards, lengths, max_len = objective.calls["shape"]
    assert torch.equal(rewards, torch.tensor([1.0, 0.0, 0.5])) and lengths.tolist() == [2.0, 2.0, 3.0] and max_len == 3
    rewards, mask, group_size, seen, micro, scored = objective.calls["credit"]
    assert torch.equal(rewards, torch.tensor([0.9, 0.1, 0.4])) and torch.equal(mask, rollouts.completion_mask)
    assert group_size == 3 and seen is signal and micro == 1 and objective.calls["rows_in_loss"][1] is signal
    assert scored is None  # (no scored credit declared: the scoring pass's log-probs are not handed over)
    assert torch.equal(plan.rewards, torch.tensor([0.9, 0.1, 0.4])) and plan.signal is signal
    assert plan.rows.tolist() == [1, 2] and [c.tolist() for c in plan.chunks] == [[1], [2]] and plan.num_chunks == 2
    assert (plan.norms.num_tokens, plan.norms.num_rows, plan.norms.num_teacher_rows, plan.global_rows) == (7, 3, 1, 2)


def _policy(head, hidden_table, temperature=1.0, chunk=1024):
    """A stand-in policy: row i's hidden states are ``hidden_table[i]`` (found from the prompt id); records calls."""
    calls = {}

    def completion_hidden(input_ids, attention_mask, c, model=None, packed=False):
        calls["hidden"] = (input_ids.clone(), attention_mask.clone(), c)
        return hidden_table[input_ids[:, 0]]

    policy = SimpleNamespace(generation=GenerationSettings(max_new_tokens=3), max_completion_tokens=3, device=torch.device("cpu"),
                             completion_hidden=completion_hidden, lm_head=lambda: head, temperature=temperature,
                             logprob_chunk_size=chunk, runner=lambda fn: fn(), calls=calls, budget=None,
                             packs=False, passes=PassOptions())
    policy.head_logprobs = lambda hidden, targets, entropy=True, mask=None: Policy.head_logprobs(
        policy, hidden, targets, entropy, mask)
    policy.chunk_size = lambda models=1: chunk
    policy.span_hidden = lambda rollouts, span, model=None: Policy.span_hidden(policy, rollouts, span, model)
    return policy


def _by_hand(head, hidden, targets, temperature):
    logp = torch.log_softmax(head(hidden).double() / temperature, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_the_micro_batch_loss_hands_the_objective_the_chosen_rows_of_everything():
    torch.manual_seed(0)
    head, table = torch.nn.Linear(4, 5), torch.randn(3, 3, 4)
    rollouts = _three_rows(old_logprobs=-torch.rand(3, 3), ref_logprobs=-torch.rand(3, 3))
    credit = Credit(advantages=torch.tensor([0.5, -1.0, 2.0]), token_weights=torch.rand(3, 3))
    signal = TeacherSignal(route=torch.zeros(3, dtype=torch.long), has_teacher=torch.tensor([False, True, True]),
                           is_reference=torch.zeros(3, dtype=torch.bool), diversity_mask=torch.zeros(3, 3),
                           references=[None] * 3, teacher_hidden=torch.randn(3, 3, 4))
    plan = StepPlan(rewards=torch.zeros(3), credit=credit, signal=signal, selection=torch.rand(3, 3), rows=torch.arange(3),
                    chunks=[torch.arange(3)], num_chunks=1, global_rows=3.0,
                    norms=LossNorms(num_tokens=11.0, num_rows=6.0, num_teacher_rows=4.0))
    objective = _Recording(credit.advantages)
    objective.needs = Needs(teacher=TeacherSpec(routes=("partial",), output="hidden"))  # (a distillation term's)
    update = PolicyUpdate(_policy(head, table, temperature=0.7, chunk=2), objective, backward=lambda loss: None)
    rows = torch.tensor([2, 0])
    out, entropy = update.micro_batch_loss(rollouts, rows, plan, step=5)
    ids, attention, c = update.policy.calls["hidden"]
    assert torch.equal(ids, rollouts.input_ids[rows]) and torch.equal(attention, rollouts.attention_mask[rows]) and c == 3
    logprobs, inputs = objective.calls["loss"]
    mask = rollouts.completion_mask[rows]
    want_logprobs, want_entropy = _by_hand(head, table[rows], rollouts.completion_ids[rows], 0.7)
    want_logprobs, want_entropy = want_logprobs * mask, want_entropy * mask  # only the model's tokens; 0 elsewhere
    torch.testing.assert_close(logprobs.double(), want_logprobs)
    assert logprobs.requires_grad and float(out.loss) == pytest.approx(float(want_logprobs[0].sum() + want_logprobs[1, :2].sum()), rel=1e-5)
    torch.testing.assert_close(inputs.entropy.double(), want_entropy)
    assert float(entropy) == pytest.approx(float((want_entropy * mask).sum() / 5), rel=1e-5)  # 3 + 2 response tokens
    for name, want in [("completion_mask", mask), ("advantages", torch.tensor([2.0, 0.5])),
                       ("old_logprobs", rollouts.old_logprobs[rows]), ("ref_logprobs", rollouts.ref_logprobs[rows]),
                       ("token_weights", credit.token_weights[rows]), ("token_selection", plan.selection[rows])]:
        assert torch.equal(getattr(inputs, name), want), name
    for name, want in [("teacher_hidden", signal.teacher_hidden[rows]), ("has_teacher", torch.tensor([True, False])),
                       ("hidden", table[rows])]:  # the distillation term's, with a teacher of hidden states
        assert torch.equal(getattr(inputs.distill, name), want), name
    assert inputs.distill.lm_head is head and inputs.step == 5 and inputs.distill.num_teacher_rows == 4.0
    assert (inputs.num_tokens, inputs.num_sequences) == (11.0, 6.0)
    assert (inputs.max_len, inputs.temperature, inputs.chunk_size) == (3, 0.7, 2)
    assert update.mismatch.tokens == 0  # no sampler log-probs: nothing compared


def test_the_micro_batch_loss_without_stored_logprobs_or_signal_uses_its_own_and_corrects_for_the_sampler():
    torch.manual_seed(0)
    head, table = torch.nn.Linear(4, 5), torch.randn(3, 3, 4)
    rows = torch.tensor([1, 2])
    trainer, _ = _by_hand(head, table[rows], torch.tensor([[3, 2, 0], [0, 1, 2]]), 1.0)
    gap = torch.tensor([[0.5, -1.0, 0.0], [3.0, 0.25, -0.5]])  # log pi_trainer - log pi_sampler
    sampler = torch.zeros(3, 3)
    sampler[rows] = (trainer - gap).float()
    rollouts = _three_rows(sampler_logprobs=sampler)
    objective = _Recording(torch.tensor([0.5, -1.0, 2.0]))
    plan = _update(objective=objective).plan(rollouts)
    update = PolicyUpdate(_policy(head, table), objective, backward=lambda loss: None, tis_cap=2.0)
    update.micro_batch_loss(rollouts, rows, plan)
    logprobs, inputs = objective.calls["loss"]
    assert torch.equal(inputs.old_logprobs, logprobs.detach()) and not inputs.old_logprobs.requires_grad
    assert inputs.ref_logprobs is None and inputs.token_selection is None
    assert inputs.distill is None
    mask = rollouts.completion_mask[rows]
    want = torch.minimum(gap.exp(), torch.tensor(2.0)) * mask  # min(pi_trainer / pi_sampler, 2) on response tokens
    torch.testing.assert_close(inputs.token_weights.double(), want.double(), atol=1e-5, rtol=1e-5)
    assert update.mismatch.tokens == 5.0 and update.mismatch.max == pytest.approx(3.0, rel=1e-5)
    update.micro_batch_loss(rollouts, rows, plan, book=False)  # a rank's zero-weight pass is not booked
    assert update.mismatch.tokens == 5.0


def _scripted(outputs, world=1, **kwargs):
    """An update whose micro-batch losses are ``outputs`` in turn; records each call and each backward."""
    calls, backward = [], []
    update = PolicyUpdate(_policy(None, None), None, backward=lambda loss: backward.append(float(loss)), **kwargs)
    queue = iter(outputs)

    def micro_batch_loss(rollouts, rows, plan, book=True, step=0, span=None):
        calls.append((rows.tolist(), book, step))
        return next(queue)

    update.micro_batch_loss = micro_batch_loss
    return update, calls, backward


def _out(loss, entropy, **stats):
    return LossOutput(loss=torch.tensor(loss), stats=LossStats(**{k: torch.tensor(v) for k, v in stats.items()})), \
        torch.tensor(entropy)


def test_accumulate_weights_each_micro_batchs_statistics_by_its_rows_and_sums_the_loss():
    plan = _plan()
    plan.rows, plan.chunks, plan.num_chunks = torch.tensor([0, 1, 2]), [torch.tensor([0, 1]), torch.tensor([2])], 2
    update, calls, backward = _scripted([_out(0.25, 1.0, kl=0.25, clip_fraction=0.5, distill_kl=float("nan")),
                                         _out(0.5, 4.0, kl=1.0, clip_fraction=0.25)] * 2)
    sums = StepSums()
    update.accumulate(_rollouts(), plan, sums, step=7)
    assert calls == [([0, 1], True, 7), ([2], True, 7)] and backward == [0.25, 0.5]
    assert sums["loss"] == pytest.approx(0.75) and sums[NONFINITE] == 0
    assert sums["entropy"] == pytest.approx(2.0)  # 1 * 2/3 + 4 * 1/3
    assert sums["kl"] == pytest.approx(0.5) and sums["clip_fraction"] == pytest.approx(5 / 12)
    assert "distill_kl" not in sums  # a NaN statistic is left out, not summed
    update.accumulate(_rollouts(), plan, sums)  # a second pass adds to the sums
    assert sums["loss"] == pytest.approx(1.5) and sums["kl"] == pytest.approx(1.0)


def test_a_nonfinite_micro_batch_is_counted_and_neither_backpropagated_nor_booked():
    plan = _plan()
    plan.chunks, plan.num_chunks = [torch.tensor([0]), torch.tensor([1])], 2
    update, calls, backward = _scripted([_out(float("nan"), 1.0, kl=3.0), _out(0.5, 2.0, kl=1.0)])
    sums = StepSums()
    update.accumulate(_rollouts(), plan, sums)
    assert backward == [0.5] and sums[NONFINITE] == 1 and sums["loss"] == pytest.approx(0.5)
    assert sums["kl"] == pytest.approx(0.5) and sums["entropy"] == pytest.approx(1.0)  # the finite half's share


@pytest.fixture
def two_ranks(monkeypatch):
    """Two ranks where the other rank reports what this one does: sums double, maxima and means stay."""
    import scgrpo.update

    def all_reduce(values, op="sum", device=None):  # as scgrpo.distributed.all_reduce: "sum", else the maximum
        return [2 * v if op == "sum" else v for v in values]

    monkeypatch.setattr(scgrpo.update, "world_size", lambda: 2)
    monkeypatch.setattr(scgrpo.update, "all_reduce", all_reduce)
    monkeypatch.setattr(scgrpo.update, "mean_over_ranks", lambda metrics: dict(metrics))


def test_on_two_ranks_the_plan_sums_the_denominators_and_takes_the_most_passes(two_ranks):
    plan = _update(micro_batch_size=1).plan(_four_rows())
    assert plan.num_chunks == 2 and plan.global_rows == 4.0  # passes: the most of any rank, not their sum
    assert (plan.norms.num_tokens, plan.norms.num_rows) == (12.0, 8.0)


def test_on_two_ranks_every_pass_runs_backward_and_a_missing_chunk_is_a_zero_weight_pass(two_ranks):
    plan = _plan()
    plan.chunks, plan.num_chunks = [torch.tensor([1])], 3  # another rank has three chunks
    update, calls, backward = _scripted([_out(0.5, 1.0, kl=0.5), _out(1.0, 1.0, kl=9.0), _out(float("nan"), 1.0)])
    sums = StepSums()
    update.accumulate(_rollouts(), plan, sums)
    assert calls == [([1], True, 0), ([0], False, 0), ([0], False, 0)]  # row 0, not booked
    assert backward[:2] == [1.0, 0.0] and math.isnan(backward[2])  # loss x world; zero weight; NaN still paired
    assert sums[NONFINITE] == 1 and sums["loss"] == pytest.approx(1.0)  # max of the counts, sum of the losses
    assert sums["kl"] == pytest.approx(0.25) and sums["entropy"] == pytest.approx(0.5)  # real rows only


def test_on_two_ranks_the_mismatch_is_summed_and_its_maximum_taken(two_ranks):
    meter = MismatchMeter(abs=3.0, k3=1.0, tokens=4.0, max=2.0)
    assert meter.metrics() == {"rollout/logprob_mismatch_mean": 0.75, "rollout/logprob_mismatch_max": 2.0,
                               "rollout/mismatch_kl": 0.25}


def test_the_mismatch_meter_adds_up_its_bookings():
    meter = MismatchMeter()
    meter.book(torch.tensor([[0.5, -1.0]]), torch.tensor([[1.0, 1.0]]))
    meter.book(torch.tensor([[-2.0, 0.0]]), torch.tensor([[1.0, 0.0]]))  # the second token is padding
    assert (meter.abs, meter.tokens, meter.max) == (3.5, 3.0, 2.0)
    k3 = (math.exp(0.5) - 1.5) + (math.exp(-1.0) - 0.0) + (math.exp(-2.0) + 1.0)  # e^x - 1 - x per token
    assert meter.k3 == pytest.approx(k3)
    assert meter.metrics() == pytest.approx({"rollout/logprob_mismatch_mean": 3.5 / 3,
                                             "rollout/logprob_mismatch_max": 2.0, "rollout/mismatch_kl": k3 / 3})
    meter.book(torch.tensor([[0.25]]), torch.tensor([[1.0]]))
    assert meter.max == 2.0  # the largest so far stays


def test_the_batch_entropy_is_scored_in_micro_batches_of_the_updates_size():
    asked = []

    def batch_entropy(rollouts, micro):
        asked.append(micro)
        return torch.ones(4, 3)

    update = _update(micro_batch_size=2, objective=HighEntropyGRPO(rho=0.5))
    update.policy.batch_entropy = batch_entropy
    update.plan(_four_rows())
    assert asked == [2]


def test_a_tis_cap_of_one_caps_every_ratio_at_one():
    """1 is the smallest cap allowed, not "off": ratios above 1 are cut to 1, those below kept."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = torch.tensor([[-2.0, -1.0, -0.5]])  # log ratios 1, -1, 0 (the last token is padding)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = sampler_correction(trainer, sampler, mask, None, 1.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, math.exp(-1.0), 0.0]]))


def test_tis_cap_accepts_zero_and_one_and_refuses_what_lies_between_or_below():
    check_tis_cap(0.0)
    check_tis_cap(1.0)
    for bad in (0.5, -1.0):
        with pytest.raises(ValueError, match="tis_cap"):
            check_tis_cap(bad)


def test_an_update_clips_at_norm_one_by_default():
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])  # norm 5
    update = PolicyUpdate(SimpleNamespace(trainable_parameters=lambda: [w]), GRPO(), backward=lambda loss: None)
    assert update.clip(_plan(), StepSums()) is None
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]))


