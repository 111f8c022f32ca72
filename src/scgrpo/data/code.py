"""A built-in code task: small Python function problems with hidden unit tests, made offline.

Each problem is a family (e.g. "the sum of the elements divisible by k") with its own parameters, a function
name, and ``tests_per_problem`` call tests computed by a reference solution on seeded random inputs. The first
half of the tests is the problem's visible set, the other half is held out; the example in the prompt is one
more input, in neither. Splits: ``train`` (most problems, rewarded on their visible tests) and ``test`` (problems
not in train, scored on their held-out tests only), as the paper holds out half of LiveCodeBench's tests.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any, Callable

from scgrpo.data.sources import PromptSource, Row


@dataclass(frozen=True)
class Family:
    name: str
    """Function name, formatted with the parameters (a minus sign written "m")."""
    signature: str
    describe: str
    """What the function returns, formatted with the parameters."""
    params: Callable[[random.Random], dict[str, Any]]
    solve: Callable[..., Any]
    """Reference solution: solve(params, *args)."""
    inputs: Callable[[random.Random], list[Any]]


def _ints(rng: random.Random, n: int = 8, lo: int = -20, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeilmnorst") for _ in range(rng.randint(0, 10)))


FAMILIES = [
    Family("sum_divisible_by_{k}", "xs", "the sum of the elements of the list xs that are divisible by {k}",
           lambda r: {"k": r.randint(2, 9)}, lambda p, xs: sum(x for x in xs if x % p["k"] == 0), lambda r: [_ints(r)]),
    Family("count_above_{k}", "xs", "how many elements of the list xs are greater than {k}",
           lambda r: {"k": r.randint(-5, 30)}, lambda p, xs: sum(x > p["k"] for x in xs), lambda r: [_ints(r)]),
    Family("scale_{k}_shift_{c}", "x", "x multiplied by {k}, plus {c}",
           lambda r: {"k": r.randint(2, 12), "c": r.randint(1, 20)}, lambda p, x: x * p["k"] + p["c"],
           lambda r: [r.randint(-100, 100)]),
    Family("drop_{ch}", "s", "the string s with every '{ch}' removed",
           lambda r: {"ch": r.choice("aeiolnst")}, lambda p, s: s.replace(p["ch"], ""), lambda r: [_word(r)]),
    Family("repeat_{k}_times", "s", "the string s repeated {k} times, the copies separated by '-'",
           lambda r: {"k": r.randint(2, 5)}, lambda p, s: "-".join([s] * p["k"]), lambda r: [_word(r)]),
    Family("every_{k}th", "xs",
           "the elements of the list xs at positions 0, {k}, 2*{k}, ... (every {k} steps from the first), as a list",
           lambda r: {"k": r.randint(2, 4)}, lambda p, xs: xs[:: p["k"]], lambda r: [_ints(r, 12)]),
    Family("clamp_{lo}_{hi}", "x", "x limited to the range from {lo} to {hi} (the nearest bound if x is outside it)",
           lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(5, 40)})(r.randint(-20, 20)),
           lambda p, x: min(max(x, p["lo"]), p["hi"]), lambda r: [r.randint(-60, 80)]),
    Family("digit_sum_mod_{k}", "n", "the sum of the decimal digits of the non-negative integer n, modulo {k}",
           lambda r: {"k": r.randint(3, 11)}, lambda p, n: sum(map(int, str(n))) % p["k"], lambda r: [r.randint(0, 99999)]),
    Family("is_multiple_of_{k}", "n", "True if the integer n is a multiple of {k}, else False",
           lambda r: {"k": r.randint(2, 13)}, lambda p, n: n % p["k"] == 0,
           lambda r: [r.choice([r.randint(-50, 200), r.randint(-5, 20) * 7])]),
    Family("count_letter_{ch}", "s", "how many times the letter '{ch}' occurs in the string s",
           lambda r: {"ch": r.choice(string.ascii_lowercase[:13])}, lambda p, s: s.count(p["ch"]), lambda r: [_word(r)]),
    Family("spread_plus_{k}", "xs", "the largest element of the non-empty list xs minus the smallest, plus {k}",
           lambda r: {"k": r.randint(0, 9)}, lambda p, xs: max(xs) - min(xs) + p["k"],
           lambda r: [[r.randint(-30, 30) for _ in range(r.randint(1, 8))]]),
]


class CodeTask(PromptSource):
    """Small Python function problems with hidden unit tests (call tests), scored by
    :class:`scgrpo.verifiers.PythonTests`. Runs offline.

    Args:
        num_train: problems in the train split.
        num_test: problems in the test split (none of them in train).
        tests_per_problem: tests per problem; the first half is visible (train reward), the rest held out.
        template: question text with {name}, {signature}, {description}, {example_call} and {example_result}.
        seed: fixes the problems and their tests.
    """

    def __init__(
        self,
        num_train: int = 200,
        num_test: int = 50,
        tests_per_problem: int = 8,
        template: str = (
            "Write a Python function `{name}({signature})` that returns {description}. For example, "
            "`{example_call}` returns `{example_result}`. Reply with the function in a ```python code block."
        ),
        seed: int = 1234,
    ) -> None:
        if num_train < 1 or num_test < 0:
            raise ValueError(f"num_train must be >= 1 and num_test >= 0, got {num_train} and {num_test}")
        if tests_per_problem < 2:
            raise ValueError(f"tests_per_problem must be >= 2 (half visible, half held out), got {tests_per_problem}")
        self.num_train, self.num_test, self.tests_per_problem = num_train, num_test, tests_per_problem
        self.template, self.seed = template, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "test"]

    def default_verifier(self):
        from scgrpo.verifiers import PythonTests

        return PythonTests()

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"code has no split {split!r}; expected one of {self.splits()}")
        if not self._cache:
            self._make()
        return self._cache[split]

    def _make(self) -> None:
        rng = random.Random(self.seed)
        problems, seen = [], set()
        wanted = self.num_train + self.num_test
        for _ in range(wanted * 50):
            if len(problems) == wanted:
                break
            family = rng.choice(FAMILIES)
            params = family.params(rng)
            name = family.name.format(**{k: str(v).replace("-", "m") for k, v in params.items()})
            if name not in seen:
                seen.add(name)
                problems.append((family, params, name))
        if len(problems) < wanted:
            raise ValueError(f"only {len(problems)} distinct problems can be made; ask for fewer than {wanted}")
        self._cache["train"] = [self._row("train", i, *p) for i, p in enumerate(problems[: self.num_train])]
        self._cache["test"] = [self._row("test", i, *p) for i, p in enumerate(problems[self.num_train :])]

    def _row(self, split: str, index: int, family: Family, params: dict[str, Any], name: str) -> Row:
        rng = random.Random(f"{self.seed}-{name}")
        tests, inputs_seen = [], set()
        for _ in range(self.tests_per_problem * 20):
            if len(tests) == self.tests_per_problem + 1:  # the last one is the prompt's example
                break
            args = family.inputs(rng)
            key = repr(args)
            if key not in inputs_seen:
                inputs_seen.add(key)
                tests.append({"type": "call", "fn": name, "args": args, "expected": family.solve(params, *args)})
        example, tests = tests[-1], tests[:-1]
        half = len(tests) // 2
        visible, held_out = tests[:half], tests[half:]
        question = self.template.format(
            name=name, signature=family.signature, description=family.describe.format(**params),
            example_call=f"{name}({', '.join(map(repr, example['args']))})", example_result=repr(example["expected"]))
        return {"id": f"{split}-{index}-{name}", "question": question,
                "answer": {"tests": visible if split == "train" else held_out}}
