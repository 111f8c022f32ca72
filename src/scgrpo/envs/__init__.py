"""Environments for multi-turn episodes (tool calls, observations) and the runner that plays them."""

from scgrpo.envs.base import Action, Environment, EpisodeSettings, StepResult, ToolCall, parse_tool_call
from scgrpo.envs.calc import CalculatorEnv
from scgrpo.envs.doors import DoorsEnv
from scgrpo.envs.gym import GymnasiumEnv

__all__ = ["Action", "CalculatorEnv", "DoorsEnv", "Environment", "EpisodeSettings", "GymnasiumEnv", "StepResult", "ToolCall",
           "parse_tool_call"]
