"""Environments for multi-turn episodes (tool calls, observations) and the runner that plays them."""

from scgrpo.envs.base import Action, Environment, EpisodeSettings, StepResult, ToolCall, parse_tool_call
from scgrpo.envs.calc import CalculatorEnv

__all__ = ["Action", "CalculatorEnv", "Environment", "EpisodeSettings", "StepResult", "ToolCall", "parse_tool_call"]
