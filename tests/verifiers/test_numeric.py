"""The numeric verifier reads the answer a solution ends on: the last "####", else the last \\boxed{}, else the
last number; each case below tells two candidate readings apart."""

import pytest

from scgrpo.verifiers import NumericVerifier
from scgrpo.verifiers.numeric import extract_number, parse_number

CASES = [
    # two boxed answers: the last one is the final answer (a corrected first attempt)
    ("First try: \\boxed{3}. That was wrong; the answer is \\boxed{5}.", "5"),
    ("\\boxed{1} \\boxed{2} \\boxed{7}", "7"),
    # the last boxed answer wins even when a number follows it
    ("\\boxed{12} and 13 more words, then \\boxed{14}; check: 15", "14"),
    # braces inside the last box are balanced; the box's last number is read
    ("\\boxed{3} so \\boxed{\\frac{{4}}{9}}", "9"),
    ("\\boxed{x = 2, y = 8}", "8"),
    # "####" comes before any box, and the last "####" wins
    ("\\boxed{4} #### 6", "6"),
    ("#### 1 and later #### 2", "2"),
    ("#### -3.5", "-3.5"),
    # a box with no number, or one never closed, falls back to the last number of the text
    ("\\boxed{none} but 11", "11"),
    ("answer 21 then \\boxed{22", "22"),
    ("1,234,567 apples", "1,234,567"),
    ("+5/8 of it", "+5/8"),
    ("nothing", None),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_extract_number_reads_the_final_answer(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize("completion, answer, score", [
    ("First try: \\boxed{3}. That was wrong; the answer is \\boxed{5}.", 5, 1.0),
    ("First try: \\boxed{3}. That was wrong; the answer is \\boxed{5}.", 3, 0.0),
    ("\\boxed{1,000}", 1000, 1.0),
    ("#### 7", "The total is 3 + 4. #### 7", 1.0),  # a worked reference is read as a solution is
    ("#### 7", "#### 8", 0.0),
])
def test_numeric_verifier_scores_the_last_answer(completion, answer, score):
    result = NumericVerifier().verify(completion, answer)
    assert result.score == score


def test_rel_tol_accepts_a_near_value_and_exact_mode_does_not():
    assert NumericVerifier().verify("3.1416", 3.14159).score == 0.0
    assert NumericVerifier(rel_tol=1e-4).verify("3.1416", 3.14159).score == 1.0
    assert NumericVerifier(rel_tol=1e-6).verify("3.1416", 3.14159).score == 0.0
    assert NumericVerifier().verify("0.5", "1/2").score == 1.0  # exact rational equality


def test_extracted_value_is_reported_and_a_non_numeric_reference_is_an_error():
    assert NumericVerifier().verify("\\boxed{2} then \\boxed{4}", 4).info == {
        "extracted": "4", "decisions": [{"span": [22, 23], "correct": True}]}
    assert NumericVerifier().verify("no number", 4).info == {"extracted": None}
    with pytest.raises(ValueError, match="not a number"):
        NumericVerifier().verify("4", "four")


def test_parse_number_drops_commas_and_refuses_what_is_not_a_number():
    assert parse_number(" 1,234 ") == 1234
    assert parse_number("3/4") == parse_number("0.75")
    assert parse_number("1/0") is None and parse_number("abc") is None


@pytest.mark.parametrize("text, answer, span, correct", [
    ("The sum is 41.", 42, (11, 13), False),
    ("#### 1,234 and then 7", 1234, (5, 10), True),
    ("\\boxed{x = 3/4} so 9", "3/4", (11, 14), True),  # the last number inside the box
    ("12 then -5", -5, (8, 10), True),
])
def test_the_number_read_is_marked_as_the_completions_decision(text, answer, span, correct):
    """The answer's span is the one decision (scgrpo.pivots), right exactly when it scores 1."""
    result = NumericVerifier().verify(text, answer)
    assert result.info["decisions"] == [{"span": list(span), "correct": correct}]
    assert text[span[0]:span[1]] == result.info["extracted"] and result.score == float(correct)
