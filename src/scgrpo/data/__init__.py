"""Prompt sources and the data module."""

from scgrpo.data.code import CodeTask
from scgrpo.data.datamodule import PromptDataModule, PromptStream
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

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CodeTask",
    "CountdownTask",
    "FileSource",
    "HubDataset",
    "PromptDataModule",
    "PromptSource",
    "PromptStream",
    "ToolCalcTask",
    "resolve_source",
]
