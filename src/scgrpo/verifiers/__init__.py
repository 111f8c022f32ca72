"""Verifiers: the abstract :class:`Verifier` and the built-ins."""

from scgrpo.verifiers.base import VerificationResult, Verifier, VerifierSetupError
from scgrpo.verifiers.code import PythonTests
from scgrpo.verifiers.combined import WeightedVerifier
from scgrpo.verifiers.countdown import CountdownVerifier
from scgrpo.verifiers.math import MathVerifier
from scgrpo.verifiers.numeric import NumericVerifier
from scgrpo.verifiers.rewards import RewardFunctions
from scgrpo.verifiers.runner import VerifierRunner

__all__ = [
    "CountdownVerifier",
    "MathVerifier",
    "NumericVerifier",
    "PythonTests",
    "RewardFunctions",
    "VerificationResult",
    "Verifier",
    "VerifierRunner",
    "WeightedVerifier",
]
