"""The built-in tasks: arithmetic, countdown and the calculator tool task, each a :class:`PromptSource` that makes
its rows from a seed; ``data.source`` names them and the tasks of their own files (:data:`TASKS`), or ``class_path``
does."""

from __future__ import annotations

import random
from typing import Union

from scgrpo.data.code import CodeTask
from scgrpo.data.doors import DoorsTask
from scgrpo.data.gym import BlackjackTask
from scgrpo.data.sources import PromptSource, Row
from scgrpo.verifiers import CountdownVerifier, NumericVerifier, Verifier


class ArithmeticTask(PromptSource):
    """Integer arithmetic questions "What is a + b? Answer with just the number.".

    Splits: ``train`` (operands with ``digits`` digits), ``id`` (``num_eval`` operand pairs of the same
    distribution, held out of train), ``ood`` (``num_ood`` pairs with ``ood_digits`` digits: unseen lengths;
    with ``ood_operations``, every second one is instead a ``digits``-digit pair under an operation never trained on).

    Args:
        digits: digits of each operand in train and id.
        ood_digits: digits of each operand in ood.
        operations: any of "+", "-", "*".
        ood_operations: operations of the ood split's second half (alternate rows), none of ``operations``;
            empty: the ood split varies the length alone.
        num_eval: size of the id split.
        num_ood: size of the ood split.
        template: question text with {a}, {op} and {b}.
        seed: fixes which pairs are held out.
    """

    def __init__(
        self,
        digits: int = 2,
        ood_digits: int = 3,
        operations: tuple[str, ...] = ("+",),
        num_eval: int = 64,
        num_ood: int = 64,
        template: str = "What is {a} {op} {b}? Answer with just the number.",
        seed: int = 1234,
        ood_operations: tuple[str, ...] = (),
    ) -> None:
        bad = [op for op in (*operations, *ood_operations) if op not in ("+", "-", "*")]
        if bad or not operations:
            raise ValueError(f"operations={list(operations)}, ood_operations={list(ood_operations)}: each must be one "
                             "of '+', '-', '*'")
        seen = sorted(set(operations) & set(ood_operations))
        if seen:
            raise ValueError(f"ood_operations {seen} are also training operations; they must be unseen in training")
        self.ood_operations = tuple(ood_operations)
        if digits < 1 or ood_digits < 1:
            raise ValueError(f"digits and ood_digits must be >= 1, got {digits} and {ood_digits}")
        self.digits, self.ood_digits, self.operations = digits, ood_digits, tuple(operations)
        self.num_eval, self.num_ood, self.template, self.seed = num_eval, num_ood, template, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id", "ood"]

    def _row(self, split: str, a: int, op: str, b: int) -> Row:
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        return {"id": f"{split}-{a}{op}{b}", "question": self.template.format(a=a, op=op, b=b), "answer": answer}

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"arithmetic has no split {split!r}; expected one of {self.splits()}")
        if split not in self._cache:
            self._cache[split] = self._make(split)
        return self._cache[split]

    def _make(self, split: str) -> list[Row]:
        rng = random.Random(self.seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        if self.digits == 1:
            lo = 0
        pairs = [(a, op, b) for op in self.operations for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        rng.shuffle(pairs)
        if self.num_eval >= len(pairs):
            raise ValueError(f"num_eval={self.num_eval} leaves no training pairs out of {len(pairs)}")
        if split == "id":
            return [self._row(split, *p) for p in pairs[: self.num_eval]]
        if split == "train":
            return [self._row(split, *p) for p in pairs[self.num_eval :]]
        # unseen lengths; with ood_operations, alternately unseen operations at the trained length
        kinds = [((10 ** (self.ood_digits - 1), 10**self.ood_digits - 1), self.operations)]
        if self.ood_operations:
            kinds.append(((lo, hi), self.ood_operations))
        ood_rng = random.Random(self.seed + 1)
        seen, rows = set(), []
        while len(rows) < self.num_ood:
            (lo, hi), operations = kinds[len(rows) % len(kinds)]
            p = (ood_rng.randint(lo, hi), ood_rng.choice(operations), ood_rng.randint(lo, hi))
            if p not in seen:
                seen.add(p)
                rows.append(self._row(split, *p))
        return rows


class CountdownTask(PromptSource):
    """Countdown: reach a target with some given numbers and + - * /, each number at most once.

    Every target is reachable by construction (it is the value of a random expression over the numbers).
    Splits: ``train`` (``num_train`` problems with ``num_numbers`` numbers), ``id`` (``num_eval`` more of the
    same kind, another seed), ``ood`` (``num_eval`` problems with ``ood_num_numbers`` numbers).
    """

    def __init__(
        self,
        num_numbers: int = 3,
        ood_num_numbers: int = 4,
        max_number: int = 50,
        num_train: int = 10000,
        num_eval: int = 64,
        template: str = (
            "Using the numbers {numbers}, create an equation that equals {target}. You can use +, -, *, / and each "
            "number at most once. Give the equation inside <answer></answer>, e.g. <answer>(1 + 2) * 3</answer>."
        ),
        seed: int = 1234,
    ) -> None:
        if num_numbers < 2 or ood_num_numbers < 2:
            raise ValueError("countdown needs at least 2 numbers per problem")
        self.num_numbers, self.ood_num_numbers, self.max_number = num_numbers, ood_num_numbers, max_number
        self.num_train, self.num_eval, self.template, self.seed = num_train, num_eval, template, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id", "ood"]

    def default_verifier(self) -> Verifier:
        return CountdownVerifier()

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"countdown has no split {split!r}; expected one of {self.splits()}")
        if split not in self._cache:
            count = self.num_train if split == "train" else self.num_eval
            k = self.ood_num_numbers if split == "ood" else self.num_numbers
            rng = random.Random(f"{self.seed}-{split}")
            self._cache[split] = [self._problem(rng, split, i, k) for i in range(count)]
        return self._cache[split]

    def _problem(self, rng: random.Random, split: str, index: int, k: int) -> Row:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(k)]
            value = numbers[0]
            for n in numbers[1:]:
                op = rng.choice("+-*/")
                if op == "/" and (n == 0 or value % n):
                    op = "+"
                value = value + n if op == "+" else value - n if op == "-" else value * n if op == "*" else value // n
            if 0 < value <= 1000:
                break
        shuffled = numbers[:]
        rng.shuffle(shuffled)
        answer = {"target": value, "numbers": shuffled}
        question = self.template.format(numbers=shuffled, target=value)
        return {"id": f"{split}-{index}", "question": question, "answer": answer}


class ToolCalcTask(PromptSource):
    """Arithmetic with several operations, "What is 417 * 386 - 902?", played with a calculator tool
    (:class:`scgrpo.envs.CalculatorEnv`, its :meth:`default_environment`).

    Each question has ``terms`` operands of ``digits`` digits joined by operations drawn from ``operations``, read
    with the usual precedence (``*`` before ``+`` and ``-``). Splits: ``train`` (``num_train`` questions), ``id``
    (``num_eval`` more of the same kind, none of them in train), ``ood`` (``num_ood`` questions of two unseen shapes
    in turn: even rows have ``ood_digits``-digit operands, ``terms`` of them; odd rows ``digits``-digit operands,
    ``ood_terms`` of them, i.e. more operations than trained on).

    Args:
        digits: digits of each operand in train and id.
        terms: operands per question in train and id (``terms - 1`` operations).
        ood_digits: digits of each operand in the ood split's even rows (differs from ``digits``).
        ood_terms: operands per question in the ood split's odd rows (differs from ``terms``).
        operations: any of "+", "-", "*".
        num_train: size of the train split.
        num_eval: size of the id split.
        num_ood: size of the ood split.
        seed: fixes the questions of every split.
    """

    def __init__(
        self,
        digits: int = 3,
        terms: int = 3,
        ood_digits: int = 4,
        ood_terms: int = 4,
        operations: tuple[str, ...] = ("+", "-", "*"),
        num_train: int = 10000,
        num_eval: int = 64,
        num_ood: int = 64,
        seed: int = 1234,
    ) -> None:
        bad = [op for op in operations if op not in ("+", "-", "*")]
        if bad or not operations:
            raise ValueError(f"operations={list(operations)}: each must be one of '+', '-', '*'")
        if digits < 1 or ood_digits < 1:
            raise ValueError(f"digits and ood_digits must be >= 1, got {digits} and {ood_digits}")
        if terms < 2 or ood_terms < 2:
            raise ValueError(f"terms and ood_terms must be >= 2, got {terms} and {ood_terms}")
        if ood_digits == digits or ood_terms == terms:
            raise ValueError(f"ood_digits ({ood_digits}) and ood_terms ({ood_terms}) must differ from digits "
                             f"({digits}) and terms ({terms}): the ood split's shapes are unseen in training")
        self.digits, self.terms, self.ood_digits, self.ood_terms = digits, terms, ood_digits, ood_terms
        self.operations = tuple(operations)
        self.num_train, self.num_eval, self.num_ood, self.seed = num_train, num_eval, num_ood, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id", "ood"]

    def default_environment(self):
        """A :class:`scgrpo.envs.CalculatorEnv` with its default instructions."""
        from scgrpo.envs.calc import CalculatorEnv

        return CalculatorEnv()

    def default_verifier(self) -> Verifier:
        return NumericVerifier()

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"tool_calc has no split {split!r}; expected one of {self.splits()}")
        if split not in self._cache:
            shape = [(self.digits, self.terms)]
            if split == "ood":
                unseen = [(self.ood_digits, self.terms), (self.digits, self.ood_terms)]
                self._cache[split] = self._draw(split, self.num_ood, unseen, set())
            else:  # train never holds an id question
                self._cache["id"] = self._draw("id", self.num_eval, shape, set())
                held_out = {r["question"] for r in self._cache["id"]}
                self._cache["train"] = self._draw("train", self.num_train, shape, held_out)
        return self._cache[split]

    def _draw(self, split: str, count: int, shapes: list[tuple[int, int]], exclude: set[str]) -> list[Row]:
        """``count`` distinct questions, the i-th of shape ``shapes[i % len(shapes)]`` (digits, terms)."""
        rng = random.Random(f"{self.seed}-{split}")
        seen, rows = set(exclude), []
        for _ in range(100 * count + 1000):
            if len(rows) == count:
                return rows
            digits, terms = shapes[len(rows) % len(shapes)]
            lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
            numbers = [rng.randint(lo, hi) for _ in range(terms)]
            ops = [rng.choice(self.operations) for _ in range(terms - 1)]
            question = "What is " + " ".join(f"{op} {n}" for op, n in zip(["", *ops], numbers)).strip() + "?"
            if question not in seen:
                seen.add(question)
                rows.append({"id": f"{split}-{len(rows)}", "question": question, "answer": _value(numbers, ops)})
        if len(rows) < count:
            raise ValueError(f"tool_calc split {split!r} has only {len(rows)} distinct questions, {count} wanted; "
                             "use more digits or terms")
        return rows


def _value(numbers: list[int], ops: list[str]) -> int:
    """``numbers[0] ops[0] numbers[1] ...`` with ``*`` before ``+`` and ``-``."""
    total, sign, product = 0, 1, numbers[0]
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            product *= n
        else:
            total, sign, product = total + sign * product, (1 if op == "+" else -1), n
    return total + sign * product


TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "tool_calc": ToolCalcTask, "code": CodeTask,
         "blackjack": BlackjackTask, "doors": DoorsTask}
"""The tasks ``data.source`` names"""


def resolve_source(source: Union[str, PromptSource]) -> PromptSource:
    if isinstance(source, PromptSource):
        return source
    if source in TASKS:
        return TASKS[source]()
    raise ValueError(
        f"unknown task {source!r}; expected one of {sorted(TASKS)} or a PromptSource "
        "(class_path: scgrpo.data.FileSource / scgrpo.data.HubDataset / your own)"
    )
