"""Math answers (LaTeX, fractions, sets, intervals) compared symbolically with math-verify."""

from __future__ import annotations

from typing import Any, Optional

from scgrpo.verifiers.base import VerificationResult, Verifier


class MathVerifier(Verifier):
    """Score 1 when math-verify finds the completion's answer equal to the reference.

    The reference is parsed as LaTeX or a plain expression (wrapped in ``$...$`` when it has no delimiters);
    the completion is searched for a \\boxed{} answer or a final expression. The run's own timeout guards the
    call, so math-verify's internal timer is switched off.
    """

    def __init__(self, timeout_s: Optional[float] = 5.0) -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError as err:  # pragma: no cover - math-verify is a dependency
            raise ImportError("MathVerifier needs math-verify: pip install math-verify") from err
        self.timeout_s = timeout_s

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        from math_verify import parse, verify

        reference = str(answer)
        if "$" not in reference and "\\boxed" not in reference:
            reference = f"${reference}$"
        gold = parse(reference, parsing_timeout=None)
        if not gold:
            raise ValueError(f"math-verify could not parse the reference answer {answer!r}")
        predicted = parse(completion, parsing_timeout=None)
        ok = bool(predicted) and verify(gold, predicted, timeout_seconds=None)
        return VerificationResult(1.0 if ok else 0.0, {"extracted": str(predicted[-1]) if predicted else None})
