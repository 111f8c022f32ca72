"""Objectives: one class per file, each selectable in YAML by ``class_path``."""

from scgrpo.objectives.base import (Credit, CreditInputs, CreditStats, DistillInputs, LossInputs, LossOutput, LossStats,
                                    Needs, Objective)
from scgrpo.objectives.dapo import DAPO
from scgrpo.objectives.drgrpo import DrGRPO
from scgrpo.objectives.grpo import GRPO, GSPO
from scgrpo.objectives.high_entropy import HighEntropyGRPO
from scgrpo.objectives.opsd import OPSD
from scgrpo.objectives.reinforce_pp import REINFORCEPlusPlus
from scgrpo.objectives.scaled_grpo import ScaledGRPO
from scgrpo.objectives.scgrpo import SCGRPO
from scgrpo.objectives.selfdistill import SelfDistillation
from scgrpo.objectives.turn_grpo import TurnGRPO

__all__ = ["DAPO", "GRPO", "GSPO", "OPSD", "REINFORCEPlusPlus", "SCGRPO", "ScaledGRPO", "Credit", "CreditInputs", "CreditStats",
           "DistillInputs", "DrGRPO", "HighEntropyGRPO", "LossInputs", "LossOutput", "LossStats", "Needs", "Objective",
           "SelfDistillation", "TurnGRPO"]
