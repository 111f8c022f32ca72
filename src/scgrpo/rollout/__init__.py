"""Rollout generation and the typed batches it produces."""

from scgrpo.rollout.engine import GenerationSettings, completion_mask_from_eos, generate
from scgrpo.rollout.types import PromptBatch, RolloutBatch

__all__ = ["GenerationSettings", "PromptBatch", "RolloutBatch", "completion_mask_from_eos", "generate"]
