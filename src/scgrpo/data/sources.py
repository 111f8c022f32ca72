"""Where prompts come from: the source interface, local files and Hugging Face hub datasets (the built-in tasks are
in :mod:`scgrpo.data.tasks`).

A source turns a split name into a list of rows ``{"id": str, "question": str, "answer": Any}`` and names the
verifier that fits its answers. Choose one in YAML by ``class_path`` or, for built-in tasks, by name.
"""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from typing import Any, Optional, Union

from scgrpo.chat import as_prompt, prompt_fault
from scgrpo.errors import InputError, json_fault, one_line
from scgrpo.verifiers import NumericVerifier, Verifier

log = logging.getLogger(__name__)
Row = dict[str, Any]


class PromptSource(ABC):
    """A provider of prompt rows for each split ("train" plus evaluation splits)."""

    @abstractmethod
    def rows(self, split: str) -> list[Row]:
        """All rows of ``split``: dicts with "id", "question" and "answer"."""

    @abstractmethod
    def splits(self) -> list[str]:
        """Names of the splits this source can give, "train" first."""

    def default_verifier(self) -> Verifier:
        return NumericVerifier()

    def describe(self, split: str) -> str:
        """Where the rows of ``split`` come from, for messages (a file's path, a dataset's name)."""
        return f"{type(self).__name__} split {split!r}"

    def eval_splits(self) -> list[str]:
        return [s for s in self.splits() if s != "train"]

    def answer_fault(self) -> Optional[str]:
        """Why the rows carry no reference answers (a table without an answer column), or None. A verifier that
        reads answers refuses such rows at setup; reward functions read the rows' own columns."""
        return None


TEST_COLUMNS = ("tests", "test_list", "test", "input_output")
"""Columns of unit tests (ours, MBPP, HumanEval, APPS): read with :class:`scgrpo.verifiers.PythonTests`."""
TEST_CONTEXT = ("entry_point", "fn_name", "test_setup_code")
"""Columns beside the tests that say how to run them (HumanEval, LiveCodeBench, MBPP)."""


PROMPT_COLUMNS = ("prompt", "question")
"""Columns read as the prompt when ``columns`` names none: TRL's (text, or a list of chat messages; a TRL script
often keeps the plain question beside the prompt it built from it), then ours"""
NOT_PASSED = ("completion",)
"""Columns that reach no reward function (TRL's prompt-completion datasets: the reference completion)"""


def _answer_column(names: list[str], columns: dict[str, str]) -> Optional[str]:
    """The column that holds answers: the one named in ``columns``, else "answer", else a column of unit tests
    (:data:`TEST_COLUMNS`), else None (rows without a reference answer: reward functions read their own columns)."""
    if "answer" in columns:
        return columns["answer"]
    if "answer" in names:
        return "answer"
    return next((name for name in TEST_COLUMNS if name in names), None)


def _question_column(names: list[str], columns: dict[str, str]) -> str:
    if "question" in columns:
        return columns["question"]
    return next((name for name in PROMPT_COLUMNS if name in names), "question")


def _table_rows(table: Any, columns: dict[str, str], where: str) -> tuple[list[Row], Optional[str]]:
    """Map a datasets.Dataset to rows through ``columns`` (our name -> its column), skipping bad rows. Returns the
    rows and, when the table has no answer column, the message that says so (raised by a verifier that needs
    answers, :meth:`PromptSource.answer_fault`).

    Each row keeps every column of the table under "columns" (TRL passes them to reward functions by name) but the
    prompt's and :data:`NOT_PASSED`. A prompt is text or a list of chat messages (:mod:`scgrpo.chat`); a row whose prompt is
    malformed, or whose answer is missing where the table has answers, is skipped, and the skips are counted in one
    warning with the first reason."""
    names = list(getattr(table, "column_names", []))
    qcol, acol = _question_column(names, columns), _answer_column(names, columns)
    if qcol not in names:
        raise InputError(f"{where}: no column {qcol!r} for the prompt (columns: {names}); set columns: "
                         "{question: <name>}")
    if "answer" in columns and acol not in names:
        raise InputError(f"{where}: no column {acol!r} for the answer (columns: {names}); set columns: "
                         "{answer: <name>}")
    no_answers = None
    if acol is None:
        no_answers = (f"{where}: no column 'answer' for the answer (columns: {names}); set columns: {{answer: <name>}}, "
                      "or score with model.reward_funcs, which read any column")
    if len(table) == 0:
        raise InputError(f"{where}: the dataset is empty")
    if qcol == "prompt" and "question" in names and "question" not in columns:
        log.info("%s: prompts read from the 'prompt' column (TRL's); 'question' reaches reward functions as a column "
                 "(set columns: {question: question} to prompt with it)", where)
    icol = columns.get("id", "id")
    # the function the tests call travels with them (APPS keeps its fn_name inside input_output)
    context = [c for c in TEST_CONTEXT if c in names] if acol in TEST_COLUMNS and acol != "input_output" else []
    rows, skipped, first_fault = [], 0, None
    for i, record in enumerate(table):
        question, answer = record.get(qcol), (record.get(acol) if acol is not None else None)
        fault = prompt_fault(question)
        if fault is None and acol is not None and answer is None:
            fault = "no answer"
        if fault is not None:
            skipped += 1
            first_fault = first_fault or f"row {i + 1}: {fault}"
            continue
        if context:
            answer = {acol: answer, **{c: record[c] for c in context if record.get(c) is not None}}
        rows.append({"id": str(record.get(icol, i)) if icol in names else str(i), "question": as_prompt(question),
                     "answer": answer, "columns": {k: v for k, v in record.items() if k != qcol and k not in NOT_PASSED}})
    if skipped:
        log.warning("%s: skipped %d of %d rows with a missing or malformed prompt or answer (first: %s)", where,
                    skipped, len(table), first_fault)
    if not rows:
        raise InputError(f"{where}: every row lacks a usable prompt or answer (first: {first_fault})")
    return rows, no_answers


_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}


def _reason(err: BaseException) -> str:
    """The message of the exception at the root of ``err``'s chain, on one line (datasets wraps a reader's error,
    e.g. pandas' "Expected 2 fields in line 3, saw 4", in "An error occurred while generating the dataset")."""
    seen = {id(err)}
    while (err.__cause__ or err.__context__) is not None and id(err.__cause__ or err.__context__) not in seen:
        err = err.__cause__ or err.__context__
        seen.add(id(err))
    return one_line(err)


def _text_file_fault(path: str, ext: str) -> Optional[str]:
    """The first fault of a text data file, as "line N: what is wrong" (or "the file is empty"); None when none is
    found (and for Parquet). Checks that every line is UTF-8 and, for JSON Lines, a JSON object."""
    if ext == ".parquet":
        return None
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        return "the file is empty"
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, 1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"line {number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
    text = data.decode("utf-8")
    if ext == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as err:
            if not err.msg.startswith("Extra data"):  # else: JSON Lines in a .json file, checked line by line
                return json_fault(err)
    if ext in (".jsonl", ".json"):
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                return json_fault(err, number)
            if not isinstance(value, dict):
                return f"line {number}: a JSON {type(value).__name__}, where each line should be an object of columns"
    return None


class TableSource(PromptSource):
    """A source whose rows come from tables (:class:`FileSource`, :class:`HubDataset`): it knows which of its splits
    have no answer column."""

    _no_answers: dict[str, str]  # split -> the message saying so, for the splits read so far

    def answer_fault(self) -> Optional[str]:
        for split in self.splits():  # (each read once, cached)
            self.rows(split)
        return next(iter(self._no_answers.values()), None)


class FileSource(TableSource):
    """Prompts from local JSONL, JSON, Parquet or CSV files, read with ``datasets``.

    Args:
        files: one path (the train split) or a mapping split -> path, e.g. ``{train: a.jsonl, test: b.jsonl}``
            (without "train": for ``scgrpo validate`` and ``test`` only).
        columns: our field -> the file's column, for "question", "answer" and optionally "id". The prompt is read from
            a "question" column, else from TRL's "prompt" (text or a list of chat messages). Without an
            "answer" column, a column of unit tests (``tests``, ``test_list``, ``test``, ``input_output``) is read
            as the answers, with ``entry_point``, ``fn_name`` and ``test_setup_code`` beside them, for
            :class:`scgrpo.verifiers.PythonTests` (LiveCodeBench, MBPP, HumanEval or APPS style).
        verifier: the verifier that fits the answers (default: ``PythonTests`` when the train split's answers
            are a column of unit tests, else numeric).
    """

    def __init__(
        self, files: Union[str, dict[str, str]], columns: Optional[dict[str, str]] = None, verifier: Optional[Verifier] = None
    ) -> None:
        self.files = {"train": files} if isinstance(files, str) else dict(files)
        if not self.files:
            raise ValueError("files names no split; give a path, or a mapping such as {train: a.jsonl, test: b.jsonl}")
        for split, path in self.files.items():
            if not os.path.exists(path):
                raise FileNotFoundError(f"data file for split {split!r} does not exist: {path}")
            if os.path.splitext(path)[1].lower() not in _FORMATS:
                raise ValueError(f"{path}: unknown file type; expected one of {sorted(_FORMATS)}")
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                raise InputError(f"{path}: the file is empty")
        self.columns = dict(columns or {})
        self._verifier = verifier
        self._answers_are_tests = False
        self._cache: dict[str, list[Row]] = {}
        self._no_answers: dict[str, str] = {}

    def splits(self) -> list[str]:
        return sorted(self.files, key=lambda split: split != "train")

    def describe(self, split: str) -> str:
        return self.files.get(split, super().describe(split))

    def default_verifier(self) -> Verifier:
        if self._verifier is not None:
            return self._verifier
        self.rows(self.splits()[0])
        if self._answers_are_tests:
            from scgrpo.verifiers import PythonTests

            return PythonTests()
        return NumericVerifier()

    def rows(self, split: str) -> list[Row]:
        if split not in self.files:
            raise ValueError(f"no file for split {split!r}; splits: {list(self.files)}")
        if split not in self._cache:
            import datasets

            path = self.files[split]
            ext = os.path.splitext(path)[1].lower()
            kwargs = {"delimiter": "\t"} if ext == ".tsv" else {}
            # datasets reports a bad file as a bare StopIteration, a UnicodeDecodeError at a byte position or a
            # JSON error at a character position, some of them only when the rows are read: on any failure the
            # file is read again to find the line at fault
            readers = logging.getLogger("datasets.packaged_modules")  # they log a failure before raising it
            level = readers.level
            readers.setLevel(logging.CRITICAL)
            try:
                table = datasets.load_dataset(_FORMATS[ext], data_files=path, split="train", **kwargs)
                answer_column = _answer_column(list(table.column_names), self.columns)
                rows, no_answers = _table_rows(table, self.columns, path)
            except InputError:
                raise
            except Exception as err:  # noqa: BLE001 - whatever the reader raised, the user sees the file and line
                fault = _text_file_fault(path, ext)
                if fault is not None:
                    raise InputError(f"{path}: {fault}") from err
                if isinstance(err, ValueError) and "no data" in str(err):
                    raise InputError(f"{path}: the dataset is empty") from err
                raise InputError(f"{path}: could not be read as {ext[1:]}: {_reason(err)}") from err
            finally:
                readers.setLevel(level)
            if split == self.splits()[0]:  # the default verifier follows the train split's answers
                self._answers_are_tests = answer_column in TEST_COLUMNS
            if no_answers:
                self._no_answers[split] = no_answers
            self._cache[split] = rows
        return self._cache[split]


class HubDataset(TableSource):
    """A dataset by name through ``datasets.load_dataset`` (a hub id such as ``openai/gsm8k``, or a local
    folder in the hub's layout).

    Args:
        name: the dataset id or folder.
        subset: its configuration name (e.g. ``main`` for gsm8k).
        splits: our split -> its split, e.g. ``{train: train, test: test}``.
        columns: our field -> its column, for "question", "answer" and optionally "id" (the prompt: "question",
            else TRL's "prompt", text or a list of chat messages).
        verifier: the verifier that fits the answers (default: numeric).
    """

    def __init__(
        self,
        name: str,
        subset: Optional[str] = None,
        splits: Optional[dict[str, str]] = None,
        columns: Optional[dict[str, str]] = None,
        verifier: Optional[Verifier] = None,
    ) -> None:
        self.name, self.subset = name, subset
        self.split_map = dict(splits or {"train": "train", "test": "test"})
        if not self.split_map:
            raise ValueError("splits maps no split; e.g. {train: train, test: test}")
        self.columns = dict(columns or {})
        self._verifier = verifier
        self._cache: dict[str, list[Row]] = {}
        self._no_answers: dict[str, str] = {}

    def splits(self) -> list[str]:
        return sorted(self.split_map, key=lambda split: split != "train")

    def describe(self, split: str) -> str:
        return f"{self.name}[{self.split_map.get(split, split)}]"

    def default_verifier(self) -> Verifier:
        return self._verifier or NumericVerifier()

    def rows(self, split: str) -> list[Row]:
        if split not in self.split_map:
            raise ValueError(f"no split {split!r}; splits: {list(self.split_map)}")
        if split not in self._cache:
            import datasets

            where = self.describe(split)
            try:
                table = datasets.load_dataset(self.name, self.subset, split=self.split_map[split])
            except Exception as err:  # noqa: BLE001 - not found, offline, malformed: one line naming the dataset
                raise InputError(f"{where}: could not be loaded: {_reason(err)}") from err
            self._cache[split], no_answers = _table_rows(table, self.columns, where)
            if no_answers:
                self._no_answers[split] = no_answers
        return self._cache[split]
