"""The divergence guard on its own: which inputs it calls non-finite, how it counts, keeps and restores weights,
and when it stops (the module-level behaviour is in tests/test_module.py)."""

import logging

import pytest
import torch

from scgrpo.guard import DivergenceGuard, nonfinite_inputs, on_any_rank
from scgrpo.objectives import Credit
from scgrpo.rollout.types import RolloutBatch, TeacherSignal
from scgrpo.update import LossNorms, StepPlan


def _rollouts(**fields) -> RolloutBatch:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [2, 3]: padding at the end
    return RolloutBatch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                        completion_ids=torch.ones(2, 3, dtype=torch.long), completion_mask=mask,
                        truncated=torch.zeros(2, dtype=torch.bool), group_size=2, sample_ids=["a", "a"],
                        questions=["q", "q"], answers=[1, 1], completions=["x", "y"], rewards=torch.tensor([1.0, 0.0]),
                        **fields)


def _plan(advantages=None, token_weights=None, signal=None) -> StepPlan:
    credit = Credit(advantages=torch.tensor([0.5, -0.5]) if advantages is None else advantages,
                    token_weights=token_weights)
    return StepPlan(rewards=torch.tensor([1.0, 0.0]), credit=credit, signal=signal, selection=None,
                    rows=torch.arange(2), chunks=[torch.arange(2)], num_chunks=1, global_rows=2.0,
                    norms=LossNorms(num_tokens=3.0, num_rows=2.0, num_teacher_rows=0.0))


def _signal(divergence=None, teacher_hidden=None) -> TeacherSignal:
    return TeacherSignal(route=torch.zeros(2, dtype=torch.long), has_teacher=torch.ones(2, dtype=torch.bool),
                         is_reference=torch.zeros(2, dtype=torch.bool), diversity_mask=torch.zeros(2, 3),
                         references=["r", "r"], divergence=divergence, teacher_hidden=teacher_hidden)


def _with(value, at):
    x = torch.zeros(2, 3)
    x[at] = value
    return x


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_values_on_response_tokens_are_named_and_padding_is_ignored(bad):
    assert nonfinite_inputs(_rollouts()) is None and nonfinite_inputs(_rollouts(), _plan()) is None
    assert nonfinite_inputs(_rollouts(sampler_logprobs=_with(bad, (0, 1)))) == "sampling log-probs"
    assert nonfinite_inputs(_rollouts(sampler_logprobs=_with(bad, (0, 2)))) is None  # padding: never looked at
    assert nonfinite_inputs(_rollouts(entropy_sum=torch.tensor([0.0, bad]))) == "sampling entropy"
    assert nonfinite_inputs(_rollouts(old_logprobs=_with(bad, (1, 0))), _plan()) == "scoring log-probs"
    assert nonfinite_inputs(_rollouts(ref_logprobs=_with(bad, (1, 0))), _plan()) == "scoring log-probs"
    assert nonfinite_inputs(_rollouts(ref_logprobs=_with(bad, (1, 1))), _plan()) is None  # padding
    assert nonfinite_inputs(_rollouts(), _plan(signal=_signal(divergence=_with(bad, (0, 0))))) == "teacher pass"
    assert nonfinite_inputs(_rollouts(), _plan(signal=_signal(divergence=_with(bad, (0, 2))))) is None
    hidden = torch.zeros(2, 3, 4)
    hidden[1, 2, 3] = bad  # teacher states are checked everywhere, padding included
    assert nonfinite_inputs(_rollouts(), _plan(signal=_signal(teacher_hidden=hidden))) == "teacher pass"
    assert nonfinite_inputs(_rollouts(), _plan(advantages=torch.tensor([0.0, bad]))) == "advantages"
    assert nonfinite_inputs(_rollouts(), _plan(token_weights=_with(bad, (1, 0)))) == "advantages"
    assert nonfinite_inputs(_rollouts(), _plan(token_weights=_with(bad, (1, 1)))) is None
    # the plan's checks only with a plan; the sampler's only without
    assert nonfinite_inputs(_rollouts(old_logprobs=_with(bad, (1, 0)))) is None
    assert nonfinite_inputs(_rollouts(sampler_logprobs=_with(bad, (0, 0))), _plan()) is None


def test_the_first_failing_phase_is_named():
    both = _rollouts(old_logprobs=_with(float("nan"), (0, 0)))
    assert nonfinite_inputs(both, _plan(advantages=torch.tensor([float("nan"), 0.0]))) == "scoring log-probs"


def test_one_rank_agrees_with_itself():
    assert on_any_rank(None) is None and on_any_rank("loss") == "loss"


def test_counting_stopping_and_restoring_the_last_good_weights(caplog):
    weights = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([3.0]))]
    guard = DivergenceGuard(max_nonfinite_skips=2)
    assert guard.good_weights is None and not guard.finish_step(None, weights, step=1, lr=0.1, max_grad_norm=1.0)
    guard.keep(weights, step=1)
    kept = [w.detach().clone() for w in weights]
    with torch.no_grad():
        for w in weights:
            w.mul_(-7.0)  # the step's update
    guard.keep(weights, step=2)  # the next good step copies into the same tensors
    assert guard.good_step == 2 and all(torch.equal(k, -7 * w0) for k, w0 in zip(guard.good_weights, kept))
    with torch.no_grad():
        for w in weights:
            w.fill_(float("nan"))
    with caplog.at_level(logging.WARNING, logger="scgrpo.guard"):
        assert not guard.finish_step("loss", weights, step=3, lr=0.1, max_grad_norm=1.0)
        assert guard.last_step_skipped and not guard.diverged and (guard.nonfinite_skips, guard.consecutive_skips) == (1, 1)
        assert all(torch.isnan(w).all() for w in weights)  # skipped, not yet restored
        assert "non-finite loss at step 3" in caplog.text and "(1 so far, 1 in a row)" in caplog.text
        assert guard.finish_step("gradient norm", weights, step=4, lr=0.1, max_grad_norm=1.0)  # the second in a row
    assert guard.diverged and (guard.nonfinite_skips, guard.consecutive_skips) == (2, 2)
    assert all(torch.equal(w, -7 * w0) for w, w0 in zip(weights, kept))  # the weights after step 2 are back
    assert caplog.text.count("training diverged") == 1 and "as they were after step 2" in caplog.text
    assert "the last: gradient norm at step 4" in caplog.text and "lr (now 0.1)" in caplog.text
    assert guard.state_dict() == {"nonfinite_skips": 2, "consecutive_skips": 2}


def test_a_finite_step_resets_the_run_of_skips_but_not_the_total():
    guard = DivergenceGuard(max_nonfinite_skips=2)
    params = [torch.zeros(1)]
    assert not guard.finish_step("loss", params, 1, 0.1, 1.0, report=False)
    assert not guard.finish_step(None, params, 2, 0.1, 1.0, report=False)
    assert not guard.last_step_skipped and (guard.nonfinite_skips, guard.consecutive_skips) == (1, 0)
    assert not guard.finish_step("loss", params, 3, 0.1, 1.0, report=False) and not guard.diverged


def test_zero_never_stops_and_keeps_no_copy(caplog):
    guard = DivergenceGuard(max_nonfinite_skips=0)
    weights = [torch.ones(3)]
    guard.keep(weights, step=1)
    assert guard.good_weights is None and guard.good_step == 0
    with caplog.at_level(logging.WARNING, logger="scgrpo.guard"):
        assert not any(guard.finish_step("loss", weights, s, 0.1, 1.0) for s in range(10))
    assert not guard.diverged and guard.consecutive_skips == 10 and "training diverged" not in caplog.text
    guard.restore(weights)  # nothing kept: a no-op
    assert torch.equal(weights[0], torch.ones(3))


def test_a_stop_before_any_good_step_names_the_start_and_state_round_trips(caplog):
    guard = DivergenceGuard(max_nonfinite_skips=1)
    with caplog.at_level(logging.ERROR, logger="scgrpo.guard"):
        assert guard.finish_step("advantages", [torch.zeros(1)], 1, 0.5, 2.0)
    assert "as they were at the start" in caplog.text and "max_grad_norm (now 2)" in caplog.text
    other = DivergenceGuard()
    other.load_state_dict(guard.state_dict())
    assert (other.nonfinite_skips, other.consecutive_skips) == (1, 1)
    other.load_state_dict({})  # a checkpoint from before the guard's counters
    assert (other.nonfinite_skips, other.consecutive_skips) == (0, 0)
    with pytest.raises(ValueError, match="max_nonfinite_skips"):
        DivergenceGuard(max_nonfinite_skips=-1)


def test_a_skip_after_the_stop_is_a_warning_again(caplog):
    """Lightning may run on after ``should_stop`` (``min_steps``): a later skipped step that does not stop the run is
    logged as a skipped step, not as a second stop."""
    guard = DivergenceGuard(max_nonfinite_skips=2)
    params = [torch.zeros(1)]
    assert not guard.finish_step("loss", params, 1, 0.1, 1.0) and guard.finish_step("loss", params, 2, 0.1, 1.0)
    assert not guard.finish_step(None, params, 3, 0.1, 1.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scgrpo.guard"):
        assert not guard.finish_step("loss", params, 4, 0.1, 1.0)
    assert "training diverged" not in caplog.text and "non-finite loss at step 4" in caplog.text


def test_the_log_lines_in_full(caplog):
    guard = DivergenceGuard(max_nonfinite_skips=2)
    guard.keep([torch.zeros(1)], step=5)
    with caplog.at_level(logging.WARNING, logger="scgrpo.guard"):
        guard.finish_step("loss", [torch.zeros(1)], 6, 0.25, 0.5)
        guard.finish_step("gradient norm", [torch.zeros(1)], 7, 0.25, 0.5)
    warning, error = caplog.records
    assert (warning.levelno, error.levelno) == (logging.WARNING, logging.ERROR)
    assert warning.getMessage() == "non-finite loss at step 6: the step is skipped (1 so far, 1 in a row)"
    assert error.getMessage() == (
        "training diverged: 2 steps in a row met non-finite values (the last: gradient norm at step 7). Stopped; the "
        "weights as they were after step 5, the last to give finite values, are restored for the final adapter; "
        "earlier checkpoints are kept and none is written now. Lower model.optimizer's lr (now 0.25) or "
        "model.max_grad_norm (now 0.5).")


def test_a_new_guard_has_skipped_nothing_and_refuses_a_negative_limit_by_name():
    guard = DivergenceGuard()
    assert guard.max_nonfinite_skips == 3 and (guard.nonfinite_skips, guard.consecutive_skips) == (0, 0)
    assert not guard.diverged and not guard.last_step_skipped and guard.good_weights is None and guard.good_step == 0
    with pytest.raises(ValueError) as refused:
        DivergenceGuard(max_nonfinite_skips=-2)
    assert str(refused.value) == "max_nonfinite_skips must be >= 0 (0 = never stop), got -2"


def test_a_skip_on_another_rank_is_a_skip_here(monkeypatch):
    import scgrpo.guard

    def other_rank_failed(values, op="sum", device=None):  # the other rank's flag is 1: it met a non-finite value
        return [v + 1.0 for v in values] if op == "sum" else [max(v, 1.0) for v in values]

    monkeypatch.setattr(scgrpo.guard, "all_reduce", other_rank_failed)
    assert on_any_rank(None) == "another rank's inputs" and on_any_rank("loss") == "loss"
