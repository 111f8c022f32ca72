"""A tool-use task: arithmetic too long to do in one's head, with a calculator the model may call.

The model reads a question such as "What is 417 * 386 - 902?" and may write ``calc(417 * 386 - 902)``; the
environment answers ``calc result: 160060`` in the next user message. A turn without a tool call is the final
answer, read as the first number after the last "Answer:" (else as :class:`~scgrpo.verifiers.NumericVerifier` reads a
completion: "#### n", ``\\boxed{n}``, or the last number) and scored 1 when it equals the row's answer. The task
that supplies such questions is :class:`scgrpo.data.ToolCalcTask` (``data.source: tool_calc``).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction
from typing import Any

from scgrpo.chat import prompt_text
from scgrpo.envs.base import Action, Environment, StepResult
from scgrpo.verifiers import NumericVerifier
from scgrpo.verifiers.numeric import _NUMBER_RE

MAX_EXPRESSION_CHARS = 200
"""Longest expression the calculator reads"""
MAX_DIGITS = 40
"""Largest magnitude (in decimal digits) of a literal, an intermediate value or a result"""
MAX_EXPONENT = 64
"""Largest exponent ``**`` accepts"""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_LIMIT = 10**MAX_DIGITS


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def _check(value: Fraction) -> Fraction:
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalcError(f"number too large (more than {MAX_DIGITS} digits)")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):  # a literal such as 1e999 reads as inf
            raise CalcError("number too large")
        return _check(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or not 0 <= right <= MAX_EXPONENT:
                raise CalcError(f"the exponent must be a whole number from 0 to {MAX_EXPONENT}")
            # the result's size, bounded before it is computed
            if max(abs(left.numerator), left.denominator).bit_length() * int(right) > 4 * MAX_DIGITS:
                raise CalcError(f"number too large (more than {MAX_DIGITS} digits)")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        return _check(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalcError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression``: numbers, ``+ - * / // % **`` (exponent at most
    :data:`MAX_EXPONENT`), parentheses and signs; "x", "×", "÷", "^" and thousands commas are read as
    ``*``, ``*``, ``/``, ``**`` and nothing, and a trailing "=" is ignored. Raises :class:`CalcError` for anything
    else (names, calls, attributes, numbers over :data:`MAX_DIGITS` digits, a syntax error)."""
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = text.replace("×", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", text)
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    if re.search(rf"\d{{{MAX_DIGITS + 1}}}", text):  # before int() reads a huge literal
        raise CalcError(f"number too large (more than {MAX_DIGITS} digits)")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot read {text!r}") from None
    return _eval(tree.body)


def format_number(value: Fraction) -> str:
    """``value`` as the calculator shows it: an integer exactly, else a decimal rounded to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


_ANSWER = re.compile(r"\banswer\b(?:\s+is)?\s*[:=]?", re.IGNORECASE)


def _final_answer(text: str) -> tuple[str, int]:
    """The first number after the last "Answer:" (or "answer is"), else the whole ``text``; and where it starts."""
    for found in reversed(list(_ANSWER.finditer(text))):
        number = _NUMBER_RE.search(text, found.end())
        if number is not None:
            return number.group(), number.start()
    return text, 0


class CalculatorEnv(Environment):
    """Arithmetic with a calculator tool (see the module docstring).

    Each turn that calls ``calc(...)`` (or ``<tool_call>{"name": "calc", "arguments": {"expression": ...}}``) gets
    ``calc result: N`` or ``calc error: ...`` back, reward 0; the first turn without a tool call ends the episode
    with reward 1 when its number equals the answer, else 0. ``info`` holds the ``extracted`` answer and the
    episode's number of ``tool_calls``, and marks the decisions (``info["decisions"]``): a call whose value is the
    answer (right), a call the calculator refuses (wrong; a call with another value may be an intermediate step
    and is not marked), and the final answer's number, right when it scores 1.

    Args:
        template: the first message, with ``{question}``; says how to call the tool and how to answer. The default,
            a worked example before the question, is the wording the embedded SmolLM2-135M-Instruct follows best
            of those tried (docs/envs.md gives its Pass@8).
    """

    tools = ("calc",)

    def __init__(
        self,
        template: str = (
            "Example:\nQuestion: What is 12 * 34 + 5?\nYou: calc(12 * 34 + 5)\nCalculator: calc result: 413\n"
            "You: Answer: 413\n\nNow you. Start your reply with calc(\nQuestion: {question}"
        ),
    ) -> None:
        if "{question}" not in template:
            raise ValueError(f"template {template!r} has no {{question}}")
        self.template = template
        self.answer: Any = None
        self.tool_calls = 0
        self._verifier = NumericVerifier(timeout_s=None)

    def reset(self, row: dict[str, Any], seed: int) -> str:
        self.answer, self.tool_calls = row["answer"], 0
        return self.template.replace("{question}", prompt_text(row["question"]))

    def step(self, action: Action) -> StepResult:
        call = action.tool_call
        if call is not None:
            self.tool_calls += 1
            info = {"tool_calls": self.tool_calls}
            if call.name != "calc":
                return StepResult(f"calc error: there is no tool {call.name!r}; the only tool is calc", info=info)
            try:
                value = format_number(evaluate(_expression(call.arguments)))
            except CalcError as err:
                return StepResult(f"calc error: {err}", info=_decided(info, call.span, False))
            if self._verifier.verify(value, self.answer).score >= 1.0:  # (an intermediate value is no wrong move)
                info = _decided(info, call.span, True)
            return StepResult(f"calc result: {value}", info=info)
        text, offset = _final_answer(action.text)
        result = self._verifier.verify(text, self.answer)
        info = {"extracted": result.info["extracted"], "tool_calls": self.tool_calls}
        for decision in result.info.get("decisions", []):  # the number read, in the turn's text
            start, end = decision["span"]
            info = _decided(info, (start + offset, end + offset), decision["correct"])
        return StepResult(reward=result.score, done=True, info=info)


def _decided(info: dict[str, Any], span, correct: bool) -> dict[str, Any]:
    """``info`` with the decision at ``span`` (None: not marked) in ``info["decisions"]``."""
    if span is None:
        return info
    return {**info, "decisions": [{"span": [int(span[0]), int(span[1])], "correct": bool(correct)}]}


def _expression(arguments: dict[str, Any]) -> str:
    """The expression among a tool call's arguments ("input", "expression", else the only argument)."""
    for key in ("input", "expression"):
        if isinstance(arguments.get(key), str):
            return arguments[key]
    values = list(arguments.values())
    if len(values) == 1 and isinstance(values[0], (str, int, float)):
        return str(values[0])
    raise CalcError(f"expected one argument, the expression; got {sorted(arguments)}")
