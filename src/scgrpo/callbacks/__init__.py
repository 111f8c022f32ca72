"""Callbacks: rollout generation, verification, dynamic sampling, logging of completions and credit, adapters,
checkpoints by step."""

from scgrpo.atomic_io import AtomicCheckpointIO
from scgrpo.callbacks.checkpoint import StepCheckpoint
from scgrpo.callbacks.credit import CreditLogging
from scgrpo.callbacks.interrupt import ReleaseHeldInterrupt
from scgrpo.callbacks.logging import AdapterExport, CompletionsTable, ValidateBeforeTraining
from scgrpo.callbacks.rollout import DynamicSamplingCallback, RolloutCallback, VerificationCallback

__all__ = [
    "AdapterExport",
    "AtomicCheckpointIO",
    "CompletionsTable",
    "CreditLogging",
    "DynamicSamplingCallback",
    "ReleaseHeldInterrupt",
    "RolloutCallback",
    "StepCheckpoint",
    "ValidateBeforeTraining",
    "VerificationCallback",
]
