"""Callbacks: rollout generation, verification, dynamic sampling, logging of completions and credit, adapters."""

from scgrpo.callbacks.credit import CreditLogging
from scgrpo.callbacks.logging import AdapterExport, CompletionsTable, ValidateBeforeTraining
from scgrpo.callbacks.rollout import DynamicSamplingCallback, RolloutCallback, VerificationCallback

__all__ = [
    "AdapterExport",
    "CompletionsTable",
    "CreditLogging",
    "DynamicSamplingCallback",
    "RolloutCallback",
    "ValidateBeforeTraining",
    "VerificationCallback",
]
