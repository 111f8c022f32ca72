"""Countdown: an arithmetic expression over the given numbers (each at most once) that hits the target."""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Optional

from scgrpo.verifiers.base import VerificationResult, Verifier

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, used)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)[:60]}")


def extract_equation(completion: str) -> Optional[str]:
    """The last <answer>...</answer> block, without any "= target" tail."""
    found = _ANSWER_RE.findall(completion)
    if not found:
        return None
    return found[-1].split("=")[0].strip()


class CountdownVerifier(Verifier):
    """Score 1 when the expression in the last ``<answer>`` block uses only the given numbers, each at most
    once (``use_all=True``: each exactly once), and evaluates exactly to the target.

    The reference answer is ``{"target": int, "numbers": [int, ...]}``.
    """

    def __init__(self, use_all: bool = False, timeout_s: Optional[float] = 5.0) -> None:
        self.use_all = use_all
        self.timeout_s = timeout_s

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        target, numbers = int(answer["target"]), [int(n) for n in answer["numbers"]]
        equation = extract_equation(completion)
        if not equation or len(equation) > 200:
            return VerificationResult(0.0, {"extracted": equation, "reason": "no answer"})
        used: list[int] = []
        try:
            value = _evaluate(ast.parse(equation, mode="eval"), used)
        except (SyntaxError, ValueError, ZeroDivisionError) as err:
            return VerificationResult(0.0, {"extracted": equation, "reason": f"invalid: {err}"})
        available, wanted = Counter(numbers), Counter(used)
        if any(wanted[n] > available[n] for n in wanted) or (self.use_all and wanted != available):
            return VerificationResult(0.0, {"extracted": equation, "reason": "numbers"})
        return VerificationResult(1.0 if value == target else 0.0, {"extracted": equation, "value": str(value)})
