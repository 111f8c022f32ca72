"""Objectives: one class per file, each selectable in YAML by ``class_path``."""

from scgrpo.objectives.base import LossInputs, LossOutput, Objective
from scgrpo.objectives.grpo import GRPO

__all__ = ["GRPO", "LossInputs", "LossOutput", "Objective"]
