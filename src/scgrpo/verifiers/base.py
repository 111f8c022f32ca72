"""The verifier interface. Any importable subclass can be chosen in YAML by ``class_path``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


class VerifierSetupError(RuntimeError):
    """The verifier cannot score anything at all (e.g. its sandbox cannot be set up). Unlike an error on one
    completion, which scores 0 and is counted, it stops the run."""


@dataclass
class VerificationResult:
    """A verifier's verdict: ``score`` (usually 0 or 1; success means score >= the run's threshold) and
    free-form ``info`` (the extracted answer, a reason) that is shown in the completions table."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)


class Verifier(ABC):
    """Scores one completion against the reference answer of its prompt.

    Subclass it and implement :meth:`verify`; pick it in YAML with
    ``verifier: {class_path: my_pkg.MyVerifier, init_args: {...}}``. A verifier that raises or runs longer than
    ``timeout_s`` gives that completion no reward (score 0, left out of the statistics under ``episodes.on_fault:
    exclude``); the run counts it and goes on.

    A verifier may also define ``verify_batch(completions, answers, questions)`` returning one result (or
    exception) per completion, to score a whole batch at once (e.g. in parallel, as :class:`PythonTests`
    does); it then enforces its own time limits. A ``verify_batch`` that takes ``columns`` and ``completion_ids``
    keyword arguments also gets each row's other dataset columns and its completion's token ids.
    """

    timeout_s: Optional[float] = 5.0
    needs_answers: bool = True
    """Scores against the rows' reference answers (a dataset without an answer column is refused at setup)"""
    prompts_as_given: bool = False
    """``question`` is the prompt as the dataset gave it (text, or a list of chat messages); False: as text (a
    prompt of messages gives its last user turn)"""

    @abstractmethod
    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        """Score ``completion`` for a prompt whose reference answer is ``answer``."""
