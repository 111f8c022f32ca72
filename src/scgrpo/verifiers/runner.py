"""Runs a verifier over a batch of completions so that no single completion can break or stall a run."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from scgrpo.verifiers.base import VerificationResult, Verifier

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
    not a finite score gives score 0; each kind is counted (``errors``, ``timeouts``) and the first of each is
    logged with the prompt id."""

    verifier: Verifier
    errors: int = 0
    timeouts: int = 0
    _logged: set = field(default_factory=set)

    def __call__(
        self, completions: Sequence[str], answers: Sequence[Any], questions: Sequence[str], ids: Sequence[str]
    ) -> list[VerificationResult]:
        return [self.one(c, a, q, i) for c, a, q, i in zip(completions, answers, questions, ids)]

    def one(self, completion: str, answer: Any, question: str, sample_id: str) -> VerificationResult:
        name = type(self.verifier).__name__
        try:
            with _time_limit(getattr(self.verifier, "timeout_s", None)):
                result = self.verifier.verify(completion, answer, question)
            if not isinstance(result, VerificationResult):
                result = VerificationResult(float(result))
            score = float(result.score)
            if score != score or score in (float("inf"), float("-inf")):
                raise ValueError(f"non-finite score {score}")
            result.score = score
            return result
        except VerifierTimeout:
            self.timeouts += 1
            self._log_once("timeout", f"{name} ran past {self.verifier.timeout_s}s on prompt {sample_id}; score 0")
            return VerificationResult(0.0, {"error": "timeout"})
        except Exception as err:  # a user's verifier may raise anything; the run must go on
            self.errors += 1
            self._log_once("error", f"{name} raised {type(err).__name__}: {err} on prompt {sample_id}; score 0")
            return VerificationResult(0.0, {"error": f"{type(err).__name__}: {err}"})

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (further ones are counted under verifier/%ss, not logged)", kind)
