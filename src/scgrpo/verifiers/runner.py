"""Runs a verifier over a batch of completions so that no single completion can break or stall a run."""

from __future__ import annotations

import contextlib
import inspect
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from scgrpo.chat import prompt_text
from scgrpo.rollout.types import NO_REWARD
from scgrpo.verifiers.base import VerificationResult, Verifier, VerifierSetupError

log = logging.getLogger(__name__)


class VerifierTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: Optional[float]) -> Iterator[None]:
    """Raise VerifierTimeout in this thread after ``seconds`` (SIGALRM; main thread on POSIX only)."""
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise VerifierTimeout()

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class VerifierRunner:
    """Applies ``verifier`` to each completion. A verifier that raises, times out or returns something that is
    not a finite score gives no reward (score 0, and ``no_reward`` in its info); each kind is counted (``errors``, ``timeouts``) and the first of each is
    logged with the prompt id. A :class:`VerifierSetupError` (the verifier cannot score anything) stops the run."""

    verifier: Verifier
    errors: int = 0
    timeouts: int = 0
    _logged: set = field(default_factory=set)

    def __call__(
        self, completions: Sequence[str], answers: Sequence[Any], questions: Sequence[Any], ids: Sequence[str],
        columns: Optional[Sequence[dict[str, Any]]] = None, completion_ids: Optional[Sequence[list[int]]] = None,
    ) -> list[VerificationResult]:
        """One result per completion. ``questions`` are the rows' prompts (text or chat messages: a verifier reads
        them as text unless it takes them as given, :attr:`Verifier.prompts_as_given`); ``columns`` each row's
        other dataset columns and ``completion_ids`` its tokens, for a ``verify_batch`` that takes them."""
        if not getattr(self.verifier, "prompts_as_given", False):
            questions = [q if isinstance(q, str) else prompt_text(q) for q in questions]
        if callable(getattr(self.verifier, "verify_batch", None)):
            return self.batch(completions, answers, questions, ids, columns, completion_ids)
        return [self.one(c, a, q, i) for c, a, q, i in zip(completions, answers, questions, ids)]

    def batch(
        self, completions: Sequence[str], answers: Sequence[Any], questions: Sequence[Any], ids: Sequence[str],
        columns: Optional[Sequence[dict[str, Any]]] = None, completion_ids: Optional[Sequence[list[int]]] = None,
    ) -> list[VerificationResult]:
        """A verifier with ``verify_batch`` scores the whole batch itself (in parallel, under its own time
        limits); an exception in place of a row's result, or the whole call raising, gives no reward and is
        counted."""
        name = type(self.verifier).__name__
        extra = {}
        accepted = inspect.signature(self.verifier.verify_batch).parameters
        if "columns" in accepted:
            extra["columns"] = list(columns) if columns is not None else [{} for _ in completions]
        if "completion_ids" in accepted:
            extra["completion_ids"] = completion_ids
        timeouts = getattr(self.verifier, "timeouts", 0)
        try:
            results = list(self.verifier.verify_batch(list(completions), list(answers), list(questions), **extra))
            if len(results) != len(completions):
                raise ValueError(f"verify_batch gave {len(results)} results for {len(completions)} completions")
        except VerifierSetupError:
            raise
        except Exception as err:
            results = [err] * len(completions)
        late = getattr(self.verifier, "timeouts", 0) - timeouts  # (reward functions count their own)
        if late:
            self.timeouts += late
            self._log_once("timeout", f"{name} ran past {self.verifier.timeout_s}s on a batch; its values are missing")
        out = []
        for result, sample_id in zip(results, ids):
            if isinstance(result, VerifierSetupError):
                raise result
            try:
                if isinstance(result, Exception):
                    raise result
                out.append(self._checked(result))
            except Exception as err:
                self.errors += 1
                self._log_once("error", f"{name} raised {type(err).__name__}: {err} on prompt {sample_id}; no reward (episodes.on_fault)")
                out.append(VerificationResult(0.0, {"error": f"{type(err).__name__}: {err}", NO_REWARD: True}))
        return out

    @staticmethod
    def _checked(result: Any) -> VerificationResult:
        if not isinstance(result, VerificationResult):
            result = VerificationResult(float(result))
        score = float(result.score)
        if score != score or score in (float("inf"), float("-inf")):
            raise ValueError(f"non-finite score {score}")
        result.score = score
        return result

    def one(self, completion: str, answer: Any, question: str, sample_id: str) -> VerificationResult:
        name = type(self.verifier).__name__
        try:
            with _time_limit(getattr(self.verifier, "timeout_s", None)):
                result = self.verifier.verify(completion, answer, question)
            return self._checked(result)
        except VerifierSetupError:
            raise
        except VerifierTimeout:
            self.timeouts += 1
            self._log_once("timeout", f"{name} ran past {self.verifier.timeout_s}s on prompt {sample_id}; no reward (episodes.on_fault)")
            return VerificationResult(0.0, {"error": "timeout", NO_REWARD: True})
        except Exception as err:  # a user's verifier may raise anything; the run must go on
            self.errors += 1
            self._log_once("error", f"{name} raised {type(err).__name__}: {err} on prompt {sample_id}; no reward (episodes.on_fault)")
            return VerificationResult(0.0, {"error": f"{type(err).__name__}: {err}", NO_REWARD: True})

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (further ones are counted under verifier/%ss, not logged)", kind)
