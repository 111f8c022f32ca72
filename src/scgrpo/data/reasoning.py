"""Tasks of reasoning_gym, a maintained library of procedural reasoning tasks that carry their own scorers.

Offline: every problem is generated from a seed. ``pip install "scgrpo[reasoning]"`` installs the library.

    data:
      source:
        class_path: scgrpo.data.ReasoningGymTask
        init_args: {task: chain_sum, config: {min_terms: 4, max_terms: 6}, ood_config: {min_terms: 7, max_terms: 9}}
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from scgrpo.data.sources import PromptSource, Row
from scgrpo.verifiers.base import VerificationResult, Verifier, VerifierSetupError
from scgrpo.verifiers.numeric import number_span, parse_number

DEFAULT_INSTRUCTION = "Think it through, then give only the final answer inside <answer></answer>."


def _library():
    try:
        import reasoning_gym
    except ImportError as exc:  # pragma: no cover - exercised where the extra is missing
        raise ModuleNotFoundError('reasoning_gym tasks need the library: pip install "scgrpo[reasoning]" '
                                  "(or pip install reasoning-gym)") from exc
    return reasoning_gym


def create(task: str, config: dict[str, Any]):
    """reasoning_gym's dataset ``task`` with the settings ``config`` (its own validation, as one clear error)."""
    library = _library()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"reasoning_gym has no task {task!r}; some of its tasks: {', '.join(sorted(DATASETS)[:12])}, ...")
    try:
        return library.create_dataset(task, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning_gym task {task!r} rejected the settings {config}: {exc}") from exc


EXTRACTIONS = ("tag", "tag_or_number")


ANSWER_BLOCK = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
"""reasoning_gym's answer block (``reasoning_gym.utils.extract_answer``: the last one counts, its text stripped)"""


def extract(completion: str, extraction: str = "tag") -> tuple[Optional[str], bool, Optional[tuple[int, int]]]:
    """The answer text the scorer reads, whether it came from a block, and its characters in the completion: the
    last ``<answer>...</answer>`` block, stripped as reasoning_gym strips it; with ``tag_or_number``, a completion
    without a block gives its last number instead (small models that answer in prose)."""
    blocks = list(ANSWER_BLOCK.finditer(completion))
    if blocks:
        start, end = blocks[-1].span(1)
        text = completion[start:end]
        start += len(text) - len(text.lstrip())
        end -= len(text) - len(text.rstrip())
        return completion[start:end], True, (start, max(start, end))
    if extraction == "tag_or_number":
        span = number_span(completion)
        return (completion[span[0]:span[1]] if span else None), False, span
    return None, False, None


class ReasoningGymVerifier(Verifier):
    """Scores with the task's own scorer: reasoning_gym's ``score_answer`` on the text of the completion's last
    ``<answer>...</answer>`` block (no block: 0, unless ``extraction`` reads the last number). Rewards are in
    [0, 1]; some tasks give partial credit. The answer read is the completion's one decision (``info["decisions"]``,
    :mod:`scgrpo.pivots`): its span, right when it scores 1.

    Args:
        extraction: ``tag`` (reasoning_gym's convention: only the block counts) or ``tag_or_number`` (ours: a
            completion without a block is scored on its last number, 1 when it equals the reference answer as a
            number, else 0; for tasks whose answers are numbers). A block is always scored by the task's scorer,
            which may give partial credit (reasoning_gym's default gives len(reference) / len(answer) to an
            answer that contains the reference).
    """

    def __init__(self, extraction: str = "tag") -> None:
        if extraction not in EXTRACTIONS:
            raise ValueError(f"extraction must be one of {EXTRACTIONS}, got {extraction!r}")
        self.extraction = extraction
        self._datasets: dict[str, Any] = {}

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        if not isinstance(answer, dict) or not {"task", "config", "entry"} <= set(answer):
            raise VerifierSetupError("ReasoningGymVerifier scores rows of ReasoningGymTask (answers holding the task, "
                                     "its settings and the generated entry)")
        key = json.dumps([answer["task"], answer["config"]], sort_keys=True, default=str)
        if key not in self._datasets:
            self._datasets[key] = create(answer["task"], {**answer["config"], "size": 1})
        extracted, tagged, span = extract(completion, self.extraction)
        if extracted is None:
            score = 0.0
        elif tagged:
            score = float(self._datasets[key].score_answer(extracted, answer["entry"]))
        else:  # the last number of prose: right or wrong, no partial credit for digits that contain the answer
            reference = parse_number(str(answer["entry"]["answer"]))
            if reference is None:
                raise VerifierSetupError(f"extraction 'tag_or_number' needs numeric answers; task {answer['task']!r} "
                                         f"has the answer {answer['entry']['answer']!r}: use extraction 'tag'")
            score = float(parse_number(extracted) == reference)
        info: dict[str, Any] = {"extracted": extracted, "from_block": tagged}
        if span is not None and span[1] > span[0]:  # the answer read is the completion's decision (scgrpo.pivots), right at full credit
            info["decisions"] = [{"span": list(span), "correct": score == 1.0}]
        return VerificationResult(score, info=info)


class ReasoningGymTask(PromptSource):
    """A reasoning_gym task as prompt rows, scored by :class:`ReasoningGymVerifier`.

    Splits: ``train`` (``num_train`` problems from ``seed``), ``id`` (``num_eval`` problems from another seed, the
    same settings), and, with ``ood_config``, ``ood`` (``num_eval`` problems with those settings over ``config``:
    for instance more terms or digits). Each question is the task's own, followed by ``instruction``.

    Args:
        task: a reasoning_gym task name (``reasoning_gym.factory.DATASETS``), e.g. ``chain_sum``.
        config: the task's settings (its config dataclass's fields, without ``seed`` and ``size``).
        ood_config: settings that replace ``config``'s for the ood split; None: no ood split.
        num_train, num_eval: problems in train, and in each evaluation split.
        seed: seeds train; id and ood use ``seed + 1`` and ``seed + 2``.
        instruction: appended to each question (the verifier reads the last ``<answer>`` block).
        extraction: how the default verifier finds the answer (:class:`ReasoningGymVerifier`).
    """

    def __init__(self, task: str, config: Optional[dict[str, Any]] = None, ood_config: Optional[dict[str, Any]] = None,
                 num_train: int = 10000, num_eval: int = 64, seed: int = 1234,
                 instruction: str = DEFAULT_INSTRUCTION, extraction: str = "tag") -> None:
        for name in ("seed", "size"):
            if name in (config or {}) or name in (ood_config or {}):
                raise ValueError(f"set {name!r} on ReasoningGymTask (seed, num_train, num_eval), not in the task's config")
        if num_train < 1 or num_eval < 1:
            raise ValueError(f"num_train and num_eval must be >= 1, got {num_train} and {num_eval}")
        self.task, self.config, self.ood_config = task, dict(config or {}), ood_config
        self.num_train, self.num_eval, self.seed, self.instruction = num_train, num_eval, seed, instruction
        self.extraction = ReasoningGymVerifier(extraction).extraction  # checked here
        create(task, {**self.config, "size": 1})  # an unknown task or bad settings fail here, before training
        if ood_config is not None:
            create(task, {**self.config, **ood_config, "size": 1})
        if extraction == "tag_or_number":
            sample = [entry for split in ("train", "ood") if split == "train" or ood_config is not None
                      for entry in create(task, {**self.settings(split), "seed": seed, "size": 8})]
            words = [entry["answer"] for entry in sample if parse_number(str(entry["answer"])) is None]
            if words:
                raise ValueError(f"extraction 'tag_or_number' reads numbers, but reasoning_gym task {task!r} answers "
                                 f"{words[0]!r}: use extraction 'tag'")
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id"] + (["ood"] if self.ood_config is not None else [])

    def default_verifier(self) -> Verifier:
        return ReasoningGymVerifier(self.extraction)

    def describe(self, split: str) -> str:
        return f"reasoning_gym task {self.task!r} split {split!r}"

    def settings(self, split: str) -> dict[str, Any]:
        return {**self.config, **(self.ood_config or {})} if split == "ood" else dict(self.config)

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"reasoning_gym task {self.task!r} has no split {split!r}; expected one of {self.splits()}")
        if split not in self._cache:
            settings = self.settings(split)
            offset = {"train": 0, "id": 1, "ood": 2}[split]
            size = self.num_train if split == "train" else self.num_eval
            dataset = create(self.task, {**settings, "seed": self.seed + offset, "size": size})
            self._cache[split] = [
                {"id": f"{split}-{i}", "question": f"{entry['question']}\n\n{self.instruction}".strip(),
                 "answer": {"task": self.task, "config": settings, "entry": entry}}
                for i, entry in enumerate(dataset)]
        return self._cache[split]
