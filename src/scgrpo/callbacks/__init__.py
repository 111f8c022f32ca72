"""Callbacks: rollout generation, verification, logging of completions, adapter export."""

from scgrpo.callbacks.logging import AdapterExport, CompletionsTable, ValidateBeforeTraining
from scgrpo.callbacks.rollout import RolloutCallback, VerificationCallback

__all__ = ["AdapterExport", "CompletionsTable", "RolloutCallback", "ValidateBeforeTraining", "VerificationCallback"]
