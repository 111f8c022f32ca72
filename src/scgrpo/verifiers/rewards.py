"""Plain reward functions with TRL's calling convention, as a verifier.

A reward function scores a batch at once::

    def accuracy(completions, solution, **kwargs) -> list[float | None]:
        return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, solution)]

It is called with keyword arguments: ``prompts`` (each row's prompt as the dataset gave it: text, or a list of chat
messages), ``completions`` (text; for a prompt of messages, ``[{"role": "assistant", "content": text}]``, as TRL
passes them), ``completion_ids`` (each completion's token ids) and every other column of the dataset by its name
(one value per completion). It returns one float per completion, or None where it does not apply. A row's reward is
the weighted sum of the values it got; a row where every function gave None (or raised) has no reward, like a
verifier error: it is counted (``verifier/errors``) and left out of its group's statistics (``episodes.on_fault``). Each function's mean is logged as ``reward/<name>/mean``.

Pick them in YAML by import path: ``model.reward_funcs: [my_rewards.accuracy, my_rewards.format]`` and, optionally,
``model.reward_weights: [1.0, 0.2]``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from typing import Any, Callable, Optional, Sequence

from scgrpo.chat import is_chat
from scgrpo.errors import InputError
from scgrpo.verifiers.base import VerificationResult, Verifier
from scgrpo.verifiers.runner import VerifierTimeout, _time_limit


log = logging.getLogger(__name__)

ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every reward function is given besides the dataset's columns"""


class NoReward(Exception):
    """Every reward function gave None for a row (or raised)."""


def reward_name(function: Callable) -> str:
    """What a reward function (or a verifier) is logged as: its ``__name__`` (an object: its class's name)."""
    name = getattr(function, "__name__", None) or type(function).__name__
    return name if name != "<lambda>" else "lambda"


def reward_names(functions: Sequence[Callable]) -> list[str]:
    """:func:`reward_name` of each function, made distinct with ``_2``, ``_3`` ... where two share one."""
    names, seen = [], {}
    for function in functions:
        name = reward_name(function)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


def run_reward(verifier: Optional[Verifier], reward_funcs: Optional[Sequence[Callable]],
               reward_weights: Optional[Sequence[float]]) -> Optional[Verifier]:
    """The run's reward, from ``model.verifier`` or ``model.reward_funcs`` (with their ``reward_weights``): one of
    them, or neither (the data module's default verifier)."""
    if reward_funcs is not None and verifier is not None:
        raise ValueError("set model.verifier or model.reward_funcs, not both (a Verifier's score can be one of "
                         "the reward functions: wrap its verify in a function)")
    if reward_weights is not None and reward_funcs is None:
        raise ValueError("model.reward_weights is set without model.reward_funcs")
    return RewardFunctions(reward_funcs, reward_weights) if reward_funcs is not None else verifier


class RewardFunctions(Verifier):
    """Reward functions with TRL's calling convention (see the module docstring), weighted and summed.

    Args:
        functions: the reward functions (callables; in YAML, import paths).
        weights: one weight per function (default 1 each).
        timeout_s: limit on one function's call for a whole batch (None: none); past it, that function gives None
            for the batch, and the timeout is counted.
    """

    needs_answers = False
    prompts_as_given = True

    def __init__(self, functions: Sequence[Callable], weights: Optional[Sequence[float]] = None,
                 timeout_s: Optional[float] = 60.0) -> None:
        functions = list(functions)
        if not functions:
            raise ValueError("reward_funcs is empty; give at least one reward function")
        bad = [f for f in functions if not callable(f)]
        if bad:
            raise ValueError(f"reward_funcs holds {bad[0]!r}, which is not callable; give functions by import path")
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(functions)} reward functions")
        self.functions, self.weights, self.names = functions, weights, reward_names(functions)
        self.timeout_s = timeout_s
        self.timeouts = 0  # function calls that ran past timeout_s (the runner adds them to verifier/timeouts)
        self.failed_rows = {name: 0 for name in self.names}  # rows each function failed on (raised, timed out)
        self._warned: set[str] = set()

    def check_columns(self, columns: Sequence[str]) -> None:
        """Raises an :class:`InputError` when a dataset column would take the place of one of the arguments the
        functions get (``prompts``, ``completions``, ``completion_ids``)."""
        taken = sorted(set(columns) & set(ARGUMENTS))
        if taken:
            raise InputError(f"the dataset has a column {taken[0]!r}, the name of the reward functions' own argument; "
                             "rename it (data.source's columns map names only for question, answer and id)")

    def verify(self, completion: str, answer: Any, question: Any = "") -> VerificationResult:
        result = self.verify_batch([completion], [answer], [question])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def verify_batch(self, completions: Sequence[str], answers: Sequence[Any], questions: Sequence[Any],
                     columns: Optional[Sequence[dict[str, Any]]] = None,
                     completion_ids: Optional[Sequence[list[int]]] = None) -> list[Any]:
        """One :class:`VerificationResult` per completion (its ``info["rewards"]``: each function's value, None
        where it gave none), or a :class:`NoReward` where no function gave a value."""
        n = len(completions)
        rows = list(columns) if columns is not None else [{} for _ in range(n)]
        kwargs: dict[str, Any] = {name: [row.get(name) for row in rows] for name in dict.fromkeys(
            name for row in rows for name in row)}
        kwargs.update(prompts=list(questions), completion_ids=list(completion_ids) if completion_ids is not None else None,
                      completions=[[{"role": "assistant", "content": c}] if is_chat(q) else c
                                   for c, q in zip(completions, questions)])
        values: dict[str, list[Optional[float]]] = {}
        errors: dict[str, str] = {}
        for function, name in zip(self.functions, self.names):
            try:
                with _time_limit(self.timeout_s):
                    out = function(**kwargs)
                    if inspect.isawaitable(out):  # an async reward function
                        out = asyncio.run(_awaited(out))
                values[name] = _checked(out, n, name)
            except VerifierTimeout:
                self.timeouts += 1
                values[name], errors[name] = [None] * n, f"ran past {self.timeout_s}s"
            except Exception as err:  # noqa: BLE001 - a user's function may raise anything; the run goes on
                values[name], errors[name] = [None] * n, f"{type(err).__name__}: {err}"
            if name in errors:
                self.failed_rows[name] += n
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("reward function %s %s; its values are missing for that batch (the rows it fails on "
                                "are counted under reward/%s/errors; further failures are not logged)", name,
                                errors[name], name)
        results: list[Any] = []
        for i in range(n):
            got = {name: values[name][i] for name in self.names}
            present = [(w, v) for (name, v), w in zip(got.items(), self.weights) if v is not None]
            if not present:
                why = "; ".join(f"{name} {errors.get(name, 'gave None')}" for name in self.names)
                results.append(NoReward(f"no reward function gave a value ({why})"))
                continue
            info: dict[str, Any] = {"rewards": got}
            if errors:
                info["errors"] = dict(errors)
            results.append(VerificationResult(sum(w * v for w, v in present), info))
        return results


async def _awaited(awaitable):
    return await awaitable


def _checked(out: Any, n: int, name: str) -> list[Optional[float]]:
    """A function's output (a list, tuple, array, tensor or other iterable) as ``n`` floats or Nones; raises
    ValueError on a wrong length or a value that is not a number."""
    if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise ValueError(f"{name} returned {type(out).__name__}, not a list of {n} floats")
    out = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(out) != n:
        raise ValueError(f"{name} returned {len(out)} values for {n} completions")
    values = []
    for value in out:
        if value is None:
            values.append(None)
            continue
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} returned {value!r}, not a number") from None
        values.append(value if math.isfinite(value) else None)  # NaN: TRL's "does not apply"
    return values

