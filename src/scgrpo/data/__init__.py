"""Prompt sources and the data module."""

from scgrpo.data.code import CodeTask
from scgrpo.data.doors import DoorsTask
from scgrpo.data.datamodule import PromptDataModule, PromptStream
from scgrpo.data.gym import BlackjackTask, GymTask
from scgrpo.data.reasoning import ReasoningGymTask, ReasoningGymVerifier
from scgrpo.data.sources import (
    TASKS,
    ArithmeticTask,
    CountdownTask,
    FileSource,
    HubDataset,
    PromptSource,
    ToolCalcTask,
    resolve_source,
)

TASKS["code"] = CodeTask
TASKS["blackjack"] = BlackjackTask
TASKS["doors"] = DoorsTask

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "BlackjackTask",
    "CodeTask",
    "CountdownTask",
    "DoorsTask",
    "FileSource",
    "GymTask",
    "HubDataset",
    "PromptDataModule",
    "PromptSource",
    "PromptStream",
    "ReasoningGymTask",
    "ReasoningGymVerifier",
    "ToolCalcTask",
    "resolve_source",
]
