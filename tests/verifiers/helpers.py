"""Verifiers defined outside the package, to show that any importable subclass plugs in."""

import time

from scgrpo.verifiers import VerificationResult, Verifier


class ParityVerifier(Verifier):
    """Score 1 when the completion has an even number of characters (a reward a random model can earn)."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def verify(self, completion, answer, question=""):
        return VerificationResult(float((len(completion) + self.offset) % 2 == 0))


class RaisingVerifier(Verifier):
    def verify(self, completion, answer, question=""):
        raise RuntimeError("boom")


class SleepingVerifier(Verifier):
    timeout_s = 0.2

    def verify(self, completion, answer, question=""):
        time.sleep(5)
        return VerificationResult(1.0)


class AlwaysRight(Verifier):
    def verify(self, completion, answer, question=""):
        return VerificationResult(1.0)
