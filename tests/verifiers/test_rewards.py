"""Reward functions with TRL's calling convention (:mod:`scgrpo.verifiers.rewards`), alone and in the runner."""

import math

import pytest

from scgrpo.verifiers import RewardFunctions, VerificationResult, Verifier, VerifierRunner
from scgrpo.verifiers.rewards import NoReward, reward_names
from tests.verifiers import reward_functions as rf

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]


def test_weighted_sum_skips_none_and_a_row_with_no_value_fails():
    def first(completions, **kwargs):
        return [1.0, None, None]

    def second(completions, **kwargs):
        return [0.5, 2.0, None]

    results = RewardFunctions([first, second], weights=[2.0, 0.25]).verify_batch(["a", "b", "c"], [None] * 3, ["q"] * 3)
    assert results[0].score == pytest.approx(2.0 * 1.0 + 0.25 * 0.5)
    assert results[0].info["rewards"] == {"first": 1.0, "second": 0.5}
    assert results[1].score == pytest.approx(0.25 * 2.0) and results[1].info["rewards"]["first"] is None
    assert isinstance(results[2], NoReward) and "first gave None" in str(results[2])


def test_called_as_trl_calls_them_columns_prompts_and_chat_completions():
    rf.CALLS.clear()
    rewards = RewardFunctions([rf.recording])
    columns = [{"topic": "apple", "solution": 1}, {"topic": "pear", "solution": 2}]
    results = rewards.verify_batch(["an apple", "x"], [None, None], [CHAT, "plain text prompt"], columns=columns,
                                   completion_ids=[[5, 6, 7], [8]])
    (call,) = rf.CALLS
    assert call["prompts"] == [CHAT, "plain text prompt"]  # as the dataset gave them
    # a prompt of messages gets its completion as one assistant message, a text prompt as text (TRL's formats)
    assert call["completions"] == [[{"role": "assistant", "content": "an apple"}], "x"]
    assert call["completion_ids"] == [[5, 6, 7], [8]]
    assert call["topic"] == ["apple", "pear"] and call["solution"] == [1, 2]
    assert results[0].score == 0.5 and isinstance(results[1], NoReward)


def test_a_raising_function_leaves_the_others_and_is_named_and_counted(caplog):
    rewards = RewardFunctions([rf.raises, rf.even_length])
    results = rewards.verify_batch(["ab", "abc"], [None] * 2, ["q"] * 2)
    assert [r.score for r in results] == [1.0, 0.0]
    assert results[0].info["errors"] == {"raises": "ValueError: no reward today"}
    rewards.verify_batch(["abcd"], [None], ["q"])
    assert rewards.failed_rows == {"raises": 3, "even_length": 0}
    warnings = [r.getMessage() for r in caplog.records if "reward function raises" in r.getMessage()]
    assert len(warnings) == 1 and "ValueError: no reward today" in warnings[0]  # once, not per batch
    alone = RewardFunctions([rf.raises]).verify_batch(["ab"], [None], ["q"])
    assert isinstance(alone[0], NoReward) and "raises ValueError: no reward today" in str(alone[0])


def test_async_functions_and_iterables_are_read_and_text_is_not_a_number():
    async def later(completions, **kwargs):
        return [0.25] * len(completions)

    def generator(completions, **kwargs):
        return (float(len(c)) for c in completions)

    def text(completions, **kwargs):
        return ["1"] * len(completions)

    results = RewardFunctions([later, generator, text]).verify_batch(["ab", "abc"], [None] * 2, ["q"] * 2)
    assert [r.score for r in results] == [2.25, 3.25]
    assert results[0].info["rewards"]["text"] is None and "returned '1', not a number" in results[0].info["errors"]["text"]


def test_a_column_named_like_an_argument_is_refused():
    from scgrpo.errors import InputError

    RewardFunctions([rf.even_length]).check_columns(["solution", "topic"])
    with pytest.raises(InputError, match="column 'completions', the name of the reward functions' own argument"):
        RewardFunctions([rf.even_length]).check_columns(["solution", "completions"])


@pytest.mark.parametrize("output, message", [(None, "returned NoneType"), ([1.0], "returned 1 values for 2"),
                                             ("11", "returned str")])
def test_a_malformed_output_is_that_function_failing(output, message):
    def bad(completions, **kwargs):
        return output

    (first, _) = RewardFunctions([bad]).verify_batch(["a", "b"], [None] * 2, ["q"] * 2)
    assert isinstance(first, NoReward) and message in str(first)


def test_nan_is_none_and_numpy_like_outputs_are_read():
    import torch

    def tensor_out(completions, **kwargs):
        return torch.tensor([math.nan, 3.0])

    results = RewardFunctions([tensor_out]).verify_batch(["a", "b"], [None] * 2, ["q"] * 2)
    assert isinstance(results[0], NoReward) and results[1].score == 3.0


def test_names_are_distinct_and_settings_are_checked():
    assert reward_names([rf.even_length, rf.even_length, lambda completions, **k: []]) == [
        "even_length", "even_length_2", "lambda"]
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        RewardFunctions([rf.even_length], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="not callable"):
        RewardFunctions(["tests.verifiers.reward_functions.even_length"])
    with pytest.raises(ValueError, match="empty"):
        RewardFunctions([])


def test_a_function_past_its_time_limit_gives_none_and_is_counted():
    import time

    def slow(completions, **kwargs):
        time.sleep(3)
        return [1.0] * len(completions)

    runner = VerifierRunner(RewardFunctions([slow, rf.even_length], timeout_s=1.0))  # (3 s against 1: a loaded machine still tells them apart)
    results = runner(["ab", "abc"], [None] * 2, ["q"] * 2, ["p0", "p1"])
    assert [r.score for r in results] == [1.0, 0.0] and results[0].info["rewards"]["slow"] is None
    assert runner.timeouts == 1 and runner.errors == 0


def test_the_runner_counts_rows_without_a_reward_as_errors_and_passes_columns():
    runner = VerifierRunner(RewardFunctions([rf.mentions_topic, rf.always_none]))
    results = runner(["an apple", "a plum"], [None] * 2, [CHAT, CHAT], ["p0", "p1"],
                     columns=[{"topic": "apple"}, {"topic": "pear"}])
    assert [r.score for r in results] == [1.0, 0.0] and runner.errors == 0
    runner = VerifierRunner(RewardFunctions([rf.always_none]))
    results = runner(["a"], [None], ["q"], ["p0"])
    assert results[0].score == 0.0 and runner.errors == 1 and "NoReward" in results[0].info["error"]


def test_a_verifier_reads_a_prompt_of_messages_as_its_last_user_turn():
    seen = []

    class Reads(Verifier):
        def verify(self, completion, answer, question=""):
            seen.append(question)
            return VerificationResult(1.0)

    VerifierRunner(Reads())(["a", "b"], [1, 1], [CHAT, "text"], ["p0", "p1"])
    assert seen == ["Name a fruit.", "text"]
