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


def _boxed_contents(text: str) -> Optional[str]:
    """Contents of the last \\boxed{...} (balanced braces), or None."""
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
                return text[i + 1 : j]
    return None


def parse_number(text: str) -> Optional[Fraction]:
    text = text.replace(",", "").strip()
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def extract_number(text: str) -> Optional[str]:
    """The answer string a numeric verifier reads: "#### n", else \\boxed{n}, else the last number."""
    hashed = _HASH_RE.findall(text)
    if hashed:
        return hashed[-1]
    boxed = _boxed_contents(text)
    if boxed is not None:
        found = _NUMBER_RE.findall(boxed)
        if found:
            return found[-1]
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


class NumericVerifier(Verifier):
    """Score 1 when the completion's final number equals the reference (exactly, or within ``rel_tol``).

    Args:
        rel_tol: relative tolerance for non-integer answers (0 = exact rational equality).
    """

    def __init__(self, rel_tol: float = 0.0, timeout_s: Optional[float] = 5.0) -> None:
        self.rel_tol = rel_tol
        self.timeout_s = timeout_s

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        extracted = extract_number(completion)
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
        return VerificationResult(1.0 if ok else 0.0, {"extracted": extracted})
