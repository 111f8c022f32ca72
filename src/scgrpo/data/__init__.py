"""Prompt sources and the data module."""

from scgrpo.data.code import CodeTask
from scgrpo.data.doors import DoorsTask
from scgrpo.data.datamodule import PromptDataModule, PromptStream
from scgrpo.data.gym import BlackjackTask, GymTask
from scgrpo.data.reasoning import ReasoningGymTask, ReasoningGymVerifier
from scgrpo.data.sources import FileSource, HubDataset, PromptSource
from scgrpo.data.tasks import TASKS, ArithmeticTask, CountdownTask, ToolCalcTask, resolve_source

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
