"""Prompt sources and the data module."""

from scgrpo.data.datamodule import PromptDataModule, PromptStream
from scgrpo.data.sources import TASKS, ArithmeticTask, CountdownTask, FileSource, HubDataset, PromptSource, resolve_source

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "FileSource",
    "HubDataset",
    "PromptDataModule",
    "PromptSource",
    "PromptStream",
    "resolve_source",
]
