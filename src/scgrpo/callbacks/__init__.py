"""Callbacks: the rollout stage before each step, logging of completions, credit and evaluations, adapters,
checkpoints by step."""

from scgrpo.atomic_io import AtomicCheckpointIO
from scgrpo.callbacks.checkpoint import StepCheckpoint
from scgrpo.callbacks.credit import CreditLogging
from scgrpo.callbacks.interrupt import ReleaseHeldInterrupt
from scgrpo.callbacks.logging import AdapterExport, CompletionsTable, ValidateBeforeTraining
from scgrpo.callbacks.rollout import RolloutCallback

__all__ = [
    "AdapterExport",
    "AtomicCheckpointIO",
    "CompletionsTable",
    "CreditLogging",
    "ReleaseHeldInterrupt",
    "RolloutCallback",
    "StepCheckpoint",
    "ValidateBeforeTraining",
]
