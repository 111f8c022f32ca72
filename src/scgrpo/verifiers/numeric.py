"""Numeric answers: the number after "####", inside \\boxed{}, or else the last number of the text."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Optional

from scgrpo.verifiers.base import VerificationResult, Verifier

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(" + _NUMBER + ")")


def _boxed_span(text: str) -> Optional[tuple[int, int]]:
    """Where the contents of the last \\boxed{...} (balanced braces) lie in ``text``, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return i + 1, j
    return None


def parse_number(text: str) -> Optional[Fraction]:
    text = text.replace(",", "").strip()
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def number_span(text: str) -> Optional[tuple[int, int]]:
    """Where the answer a numeric verifier reads lies in ``text``: "#### n", else the last number in \\boxed{},
    else the last number; None when there is none."""
    hashed = list(_HASH_RE.finditer(text))
    if hashed:
        return hashed[-1].span(1)
    boxed = _boxed_span(text)
    if boxed is not None:
        found = list(_NUMBER_RE.finditer(text, boxed[0], boxed[1]))
        if found:
            return found[-1].span()
    found = list(_NUMBER_RE.finditer(text))
    return found[-1].span() if found else None


def extract_number(text: str) -> Optional[str]:
    """The answer string a numeric verifier reads: "#### n", else \\boxed{n}, else the last number."""
    span = number_span(text)
    return text[span[0]:span[1]] if span is not None else None


class NumericVerifier(Verifier):
    """Score 1 when the completion's final number equals the reference (exactly, or within ``rel_tol``).

    The number read is the completion's one decision (``info["decisions"]``, :mod:`scgrpo.pivots`): its span,
    right when it scores 1.

    Args:
        rel_tol: relative tolerance for non-integer answers (0 = exact rational equality).
    """

    def __init__(self, rel_tol: float = 0.0, timeout_s: Optional[float] = 5.0) -> None:
        self.rel_tol = rel_tol
        self.timeout_s = timeout_s

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        span = number_span(completion)
        extracted = completion[span[0]:span[1]] if span is not None else None
        target = parse_number(str(answer))
        if target is None:  # a worked solution such as GSM8K's "... #### 72"
            found = extract_number(str(answer))
            target = parse_number(found) if found is not None else None
        if target is None:
            raise ValueError(f"reference answer {answer!r} is not a number")
        value = parse_number(extracted) if extracted is not None else None
        if value is None:
            return VerificationResult(0.0, {"extracted": None})
        ok = value == target or (self.rel_tol > 0 and math.isclose(float(value), float(target), rel_tol=self.rel_tol))
        decision = {"span": list(span), "correct": bool(ok)}
        return VerificationResult(1.0 if ok else 0.0, {"extracted": extracted, "decisions": [decision]})
