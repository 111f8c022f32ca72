"""The calculator: what it evaluates and what it refuses; the environment's turns; the tool_calc task's splits."""

from fractions import Fraction

import pytest

from scgrpo.data import TASKS, ToolCalcTask, resolve_source
from scgrpo.envs import Action, CalculatorEnv
from scgrpo.envs.calc import CalcError, evaluate, format_number


@pytest.mark.parametrize("expression, value", [
    ("417 * 386 - 902", 160060),
    ("2 + 3 * 4", 14),  # precedence
    ("(2 + 3) * 4", 20),
    ("-5 + +3", -2),
    ("-(7 - 10) * 2", 6),
    ("7 / 2", Fraction(7, 2)),
    ("7 // 2", 3),
    ("-7 // 2", -4),
    ("17 % 5", 2),
    ("2 ** 10", 1024),
    ("0.5 * 3", Fraction(3, 2)),
    ("1,234 + 1", 1235),  # thousands separator
    ("12 x 3", 36),
    ("12×3 ÷ 4", 9),
    ("3 ^ 2", 9),
    ("  6 * 7 = ", 42),  # a trailing "=" is ignored
])
def test_evaluate_gives_exact_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("", "empty"),
    ("x + 1", "not 'x'"),
    ("__import__('os').system('true')", "not"),
    ("(1).__class__", "not"),
    ("abs(-3)", r"not 'abs\(-3\)'"),
    ("[1, 2]", "not"),
    ("'12' * 3", "not"),
    ("True + 1", "not 'True'"),
    ("1 < 2", "not"),
    ("2 ** 65", "exponent"),
    ("2 ** -1", "exponent"),
    ("2 ** 0.5", "exponent"),
    ("99999 ** 60", "too large"),
    ("9" * 41, "too large"),
    ("10 ** 30 * 10 ** 30", "too large"),
    ("1 / 0", "division by zero"),
    ("5 % (3 - 3)", "division by zero"),
    ("3 +* 4", "cannot read"),
    ("1" + " + 1" * 100, "longer than"),
    ("calc(1)", "not"),
])
def test_evaluate_refuses_without_running_anything(expression, message):
    with pytest.raises(CalcError, match=message):
        evaluate(expression)


def test_format_number():
    assert format_number(Fraction(-185177)) == "-185177"
    assert format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "0.333333"
    assert format_number(Fraction(10**20)) == "1" + "0" * 20  # no float rounding for integers


def _turn(env: CalculatorEnv, text: str):
    return env.step(Action(text, env.parse_tool_call(text)))


ROW = {"id": "id-0", "question": "What is 397 - 942 * 197?", "answer": -185177}


def test_first_message_is_the_template_around_the_question():
    env = CalculatorEnv(template="Use calc(...). {question} End with Answer: <number>")
    assert env.reset(ROW, seed=3) == "Use calc(...). What is 397 - 942 * 197? End with Answer: <number>"
    first = CalculatorEnv().reset(ROW, seed=0)
    assert first.endswith("What is 397 - 942 * 197?") and "calc(" in first and "Answer:" in first
    with pytest.raises(ValueError, match="no {question}"):
        CalculatorEnv(template="What is it?")


def test_tool_calls_get_results_or_errors_and_do_not_end_the_episode():
    env = CalculatorEnv()
    env.reset(ROW, seed=0)
    first = _turn(env, "Let me compute. calc(397 - 942 * 197) and then answer.")
    assert (first.observation, first.reward, first.done) == ("calc result: -185177", 0.0, False)
    # the call is the turn's decision: its span, right when its value is the answer
    assert first.info == {"tool_calls": 1, "decisions": [{"span": [16, 37], "correct": True}]}
    assert "Let me compute. calc(397 - 942 * 197) and then answer."[16:37] == "calc(397 - 942 * 197)"
    json_form = _turn(env, '<tool_call>{"name": "calc", "arguments": {"expression": "942 * 197"}}</tool_call>')
    assert json_form.observation == "calc result: 185574" and not json_form.done
    assert "decisions" not in json_form.info  # 185574 may be an intermediate value: not marked
    bad = _turn(env, "calc(import os)")
    assert bad.observation.startswith("calc error: cannot read") and not bad.done and bad.reward == 0.0
    assert bad.info["decisions"] == [{"span": [0, 15], "correct": False}]
    other = _turn(env, '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert other.observation == "calc error: there is no tool 'search'; the only tool is calc" and not other.done
    nested = _turn(env, "calc((1 + 2) * (3 + 4))")  # balanced parentheses
    assert nested.observation == "calc result: 21"
    assert nested.info == {"tool_calls": 5}
    whole = _turn(env, '<tool_call>{"name": "calc", "arguments": {"expression": "397 - 942 * 197"}}</tool_call>')
    assert whole.info["decisions"] == [{"span": [0, 87], "correct": True}]  # the whole tag


@pytest.mark.parametrize("text, extracted, reward", [
    ("Answer: -185177", "-185177", 1.0),
    ("The calculator said -185177, so the answer is -185177.", "-185177", 1.0),
    ("942 * 197 = 185574, 397 - 185574 = -185177", "-185177", 1.0),  # no "Answer:": the last number
    ("Answer: -185,177", "-185,177", 1.0),
    ("Answer: \\boxed{-185177}", "-185177", 1.0),
    ("Answer: 185177", "185177", 0.0),  # the sign matters
    ("Answer: -185177 (check: 942 * 197 = 185574)", "-185177", 1.0),  # the number after "Answer:" wins
    ("-185177 is close but the Answer: 12", "12", 0.0),
    ("Answer: <number> ... it is -185177", "-185177", 1.0),  # "Answer:" with no number after it
    ("I do not know.", None, 0.0),
])
def test_a_turn_without_a_tool_call_is_the_final_answer(text, extracted, reward):
    env = CalculatorEnv()
    env.reset(ROW, seed=0)
    result = _turn(env, text)
    assert result.done and result.reward == reward
    decisions = result.info.pop("decisions", [])
    assert result.info == {"extracted": extracted, "tool_calls": 0}
    # the number read is the turn's decision, right when it scores 1
    assert [(text[slice(*d["span"])], d["correct"]) for d in decisions] == \
        ([(extracted, reward == 1.0)] if extracted is not None else [])


def test_spawned_episodes_keep_their_own_answer_and_count():
    template = CalculatorEnv()
    a, b = template.spawn(), template.spawn()
    a.reset(ROW, seed=0)
    b.reset({"id": "id-1", "question": "What is 1 + 2 * 3?", "answer": 7}, seed=1)
    _turn(a, "calc(1 + 1)")
    assert _turn(b, "Answer: 7").info == {"extracted": "7", "tool_calls": 0,
                                          "decisions": [{"span": [8, 9], "correct": True}]}
    assert _turn(a, "Answer: 7").reward == 0.0 and template.answer is None


def _parse(question: str) -> tuple[list[int], list[str]]:
    tokens = question.removeprefix("What is ").removesuffix("?").split()
    return [int(t) for t in tokens[::2]], tokens[1::2]


def test_task_is_registered_and_defaults_to_the_calculator():
    assert TASKS["tool_calc"] is ToolCalcTask
    task = resolve_source("tool_calc")
    assert isinstance(task, ToolCalcTask) and task.splits() == ["train", "id", "ood"]
    assert isinstance(task.default_environment(), CalculatorEnv)
    assert task.default_verifier().verify("Answer: 7", 7).score == 1.0


def test_task_splits_are_disjoint_deterministic_and_correct():
    task = ToolCalcTask(num_train=2000, num_eval=64, num_ood=40)
    train, ident, ood = task.rows("train"), task.rows("id"), task.rows("ood")
    assert (len(train), len(ident), len(ood)) == (2000, 64, 40)
    questions = [r["question"] for r in train + ident + ood]
    assert len(set(questions)) == len(questions)  # no question twice, none shared between splits
    for row in train + ident:
        numbers, ops = _parse(row["question"])
        assert len(numbers) == 3 and all(100 <= n <= 999 for n in numbers) and set(ops) <= {"+", "-", "*"}
    for row in train + ident + ood:  # the answer follows the usual precedence
        assert row["answer"] == evaluate(row["question"].removeprefix("What is ").removesuffix("?"))
    assert {op for r in train for op in _parse(r["question"])[1]} == {"+", "-", "*"}
    again = ToolCalcTask(num_train=2000, num_eval=64, num_ood=40)
    assert again.rows("ood") == ood and again.rows("train") == train and again.rows("id") == ident
    assert ToolCalcTask(num_eval=64).rows("id") == ident  # the id split does not depend on num_train
    assert ToolCalcTask(num_eval=64, seed=7).rows("id") != ident
    assert [r["id"] for r in ident[:2]] == ["id-0", "id-1"]


def test_ood_alternates_longer_operands_and_more_operations():
    ood = ToolCalcTask(num_eval=8, num_ood=20).rows("ood")
    for i, row in enumerate(ood):
        numbers, _ = _parse(row["question"])
        if i % 2:  # trained length, one more operation
            assert len(numbers) == 4 and all(100 <= n <= 999 for n in numbers)
        else:  # unseen length, the trained number of operations
            assert len(numbers) == 3 and all(1000 <= n <= 9999 for n in numbers)
    custom = ToolCalcTask(digits=2, terms=2, ood_digits=5, ood_terms=3, operations=("*",), num_train=100, num_eval=8,
                          num_ood=4)
    assert [len(_parse(r["question"])[0]) for r in custom.rows("ood")] == [2, 3, 2, 3]
    assert all(10 <= n <= 99 for r in custom.rows("id") for n in _parse(r["question"])[0])
    assert all(r["answer"] == _parse(r["question"])[0][0] * _parse(r["question"])[0][1] for r in custom.rows("id"))


def test_task_refuses_bad_settings():
    with pytest.raises(ValueError, match="operations"):
        ToolCalcTask(operations=("/",))
    with pytest.raises(ValueError, match="unseen in training"):
        ToolCalcTask(ood_digits=3)
    with pytest.raises(ValueError, match="terms"):
        ToolCalcTask(terms=1)
    with pytest.raises(ValueError, match="no split 'test'"):
        ToolCalcTask().rows("test")
    with pytest.raises(ValueError, match="only 91 distinct questions"):  # 1 digit, 2 terms, "+": 100 questions,
        ToolCalcTask(digits=1, terms=2, operations=("+",), num_eval=9, num_train=200).rows("train")  # 9 in id


@pytest.mark.parametrize("expression", ["1e999", "-1e999 + 1", "2 * 1e400"])
def test_a_literal_too_large_for_a_float_is_a_calculator_error_not_an_environment_fault(expression):
    with pytest.raises(CalcError, match="too large"):
        evaluate(expression)
