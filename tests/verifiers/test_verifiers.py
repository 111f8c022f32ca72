import time

import pytest

from scgrpo.verifiers import CountdownVerifier, MathVerifier, NumericVerifier, VerifierRunner, WeightedVerifier
from tests.verifiers.helpers import ParityVerifier, RaisingVerifier, SleepingVerifier

NUMERIC_CASES = [
    ("The answer is 42.", 42, 1.0),
    ("42", 42, 1.0),
    ("I think 40 + 2 = 42", 42, 1.0),
    ("42 is wrong, it is 41", 42, 0.0),
    ("#### 1,234", 1234, 1.0),
    ("so the total is 7 dollars. #### 7", 7, 1.0),
    ("The result is \\boxed{-3}", -3, 1.0),
    ("\\boxed{12} but later 13", 12, 1.0),
    ("3.50", 3.5, 1.0),
    ("1/2", 0.5, 1.0),
    ("no number here", 5, 0.0),
    ("", 5, 0.0),
    ("forty-two", 42, 0.0),
    ("The answer is 420", 42, 0.0),
]


@pytest.mark.parametrize("completion, answer, score", NUMERIC_CASES)
def test_numeric_verifier_table(completion, answer, score):
    assert NumericVerifier().verify(completion, answer).score == score


def test_numeric_verifier_reads_gsm8k_style_reference():
    assert NumericVerifier().verify("It is 72", "Natalia sold 48/2 = 24 clips... #### 72").score == 1.0


MATH_CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
    ("so \\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("the roots are \\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("nothing to see", "7", 0.0),
]


@pytest.mark.parametrize("completion, answer, score", MATH_CASES)
def test_math_verifier_table(completion, answer, score):
    assert MathVerifier().verify(completion, answer).score == score


COUNTDOWN = {"target": 24, "numbers": [2, 3, 4, 6]}
COUNTDOWN_CASES = [
    ("<answer>(6 - 2) * 3 * 2</answer>", 0.0),  # 2 used twice
    ("<answer>6 * 4</answer>", 1.0),
    ("<answer>(2 + 4) * (6 - 3) + 6</answer>", 0.0),  # 6 used twice
    ("<answer>2 * 3 * 4</answer>", 1.0),
    ("<answer>6 * 4 = 24</answer>", 1.0),
    ("<answer>6 * 5</answer>", 0.0),  # 5 not given
    ("<answer>6 * 3</answer>", 0.0),  # 18
    ("6 * 4", 0.0),  # no tags
    ("<answer>__import__('os')</answer>", 0.0),
    ("<answer>6 / (3 - 3)</answer>", 0.0),
    ("<answer>48 / 2</answer>", 0.0),
    ("<answer>(3 - 2) * 4 * 6</answer>", 1.0),
]


@pytest.mark.parametrize("completion, score", COUNTDOWN_CASES)
def test_countdown_verifier_table(completion, score):
    assert CountdownVerifier().verify(completion, COUNTDOWN).score == score


def test_countdown_use_all():
    assert CountdownVerifier(use_all=True).verify("<answer>6 * 4</answer>", COUNTDOWN).score == 0.0
    assert CountdownVerifier(use_all=True).verify("<answer>(3 - 2) * 4 * 6</answer>", COUNTDOWN).score == 1.0
    assert CountdownVerifier(use_all=True).verify("<answer>2 * 3 * 4 * 6 / 6</answer>", COUNTDOWN).score == 0.0
    assert CountdownVerifier(use_all=True).verify("<answer>(6 - 2) * 3 * 4 / 2</answer>", COUNTDOWN).score == 0.0
    assert CountdownVerifier(use_all=True).verify("<answer>6 * 2 * (4 - 3)</answer>", COUNTDOWN).score == 0.0
    assert CountdownVerifier(use_all=True).verify("<answer>6 * 4 * (3 - 2)</answer>", COUNTDOWN).score == 1.0


def test_weighted_verifier_sums_parts():
    combined = WeightedVerifier([NumericVerifier(), ParityVerifier()], weights=[1.0, 0.5])
    result = combined.verify("42", 42)  # correct, even length
    assert result.score == 1.5 and result.info == {"rewards": {"NumericVerifier": 1.0, "ParityVerifier": 1.0},
                                                   "decisions": [{"span": [0, 2], "correct": True}]}  # NumericVerifier's
    assert WeightedVerifier([ParityVerifier(), ParityVerifier(offset=1)]).names == ["ParityVerifier", "ParityVerifier_2"]
    assert combined.verify("421", 42).score == 0.0
    with pytest.raises(ValueError, match="weights"):
        WeightedVerifier([NumericVerifier()], weights=[1.0, 2.0])


def test_runner_turns_a_raising_verifier_into_counted_zeros(caplog):
    runner = VerifierRunner(RaisingVerifier())
    results = runner(["a", "b", "c"], [1, 2, 3], ["q"] * 3, ["id-0", "id-1", "id-2"])
    assert [r.score for r in results] == [0.0, 0.0, 0.0]
    assert runner.errors == 3
    assert "id-0" in caplog.text and "boom" in caplog.text
    assert caplog.text.count("boom") == 1  # logged once, counted every time


def test_runner_times_out_a_hanging_verifier():
    runner = VerifierRunner(SleepingVerifier())
    start = time.perf_counter()
    results = runner(["a", "b"], [1, 1], ["q", "q"], ["x", "y"])
    assert time.perf_counter() - start < 5.0  # (each call sleeps 5 s: had either run to its end, 5 s or more)
    assert [r.score for r in results] == [0.0, 0.0] and runner.timeouts == 2


def test_runner_rejects_non_finite_scores():
    class NaNVerifier(ParityVerifier):
        def verify(self, completion, answer, question=""):
            return float("nan")

    runner = VerifierRunner(NaNVerifier())
    assert runner(["x"], [1], ["q"], ["i"])[0].score == 0.0 and runner.errors == 1
