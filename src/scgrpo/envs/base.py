"""The environment interface: gymnasium's ``reset``/``step`` for text.

An :class:`Environment` plays one episode at a time. The episode runner (:mod:`scgrpo.envs.runner`) makes one copy
per episode with :meth:`Environment.spawn`, calls :meth:`~Environment.reset` with the data row, then alternates the
model's turn and :meth:`~Environment.step` until the environment says the episode is over, or the turn limit or the
token budget ends it (then it is *truncated*). Choose one in YAML by ``class_path``, as verifiers and objectives::

    model:
      environment:
        class_path: my_pkg.MyEnv
        init_args: {difficulty: 3}

The episode's reward is the sum of the rewards :meth:`~Environment.step` returned. An environment that raises,
runs past ``timeout_s`` or returns something that is not a :class:`StepResult` ends its episode without a reward
(``episodes.on_fault``: out of its group's statistics, or reward 0); the run counts it (``episode/env_errors``,
``episode/env_timeouts``) and goes on.
"""

from __future__ import annotations

import copy
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union


@dataclass
class ToolCall:
    """A tool call parsed from the model's turn: the tool's ``name``, its ``arguments`` and where the call lies
    in the turn's text (``span``, characters ``[start, end)``; None when not parsed from text)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    span: Optional[tuple[int, int]] = None


@dataclass
class Action:
    """The model's turn as the environment receives it: the decoded ``text`` and the first tool call in it, if any
    (parsed by :meth:`Environment.parse_tool_call`)."""

    text: str
    tool_call: Optional[ToolCall] = None


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns: the next ``observation`` (the text of the next message the model
    reads; ignored when ``done``), the ``reward`` for this turn, whether the episode ended (``done``) and free-form
    ``info`` (kept with the rollout).

    ``info["decisions"]`` may mark the decisions in the model's text (:mod:`scgrpo.pivots`): a list of
    ``{"span": [start, end], "correct": bool}`` (characters of this turn's ``Action.text``), or with ``"turn": k``
    for model turn ``k`` (0-based) of the episode, so that a step may judge earlier moves, e.g. at the end. Runs
    log from them whether the token weights land on the wrong decisions (``credit/pivot_auroc``)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_call(text: str, names: Sequence[str] = ()) -> Optional[ToolCall]:
    """The first tool call in ``text``, or None.

    Two syntaxes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the JSON form of Hermes/Qwen chat
    templates, and TRL's), and, for each tool named in ``names``, a call written as ``name(expression)``, whose
    argument is the text between the balanced parentheses (``{"input": "..."}``). The earlier one in the text wins.
    """
    found: list[tuple[int, ToolCall]] = []
    match = _TOOL_CALL_TAG.search(text)
    if match:
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("name"), str):
            arguments = payload.get("arguments", payload.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = {"input": arguments}
            if not isinstance(arguments, dict):
                arguments = {"input": arguments}
            found.append((match.start(), ToolCall(payload["name"], arguments, match.span())))
    for name in names:
        for start in (m.start() for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\s*\(", text)):
            open_at = text.index("(", start)
            depth, end = 0, None
            for k in range(open_at, len(text)):
                depth += {"(": 1, ")": -1}.get(text[k], 0)
                if depth == 0:
                    end = k
                    break
            if end is not None:
                found.append((start, ToolCall(name, {"input": text[open_at + 1 : end].strip()}, (start, end + 1))))
                break
    return min(found, key=lambda f: f[0])[1] if found else None


class Environment(ABC):
    """One episode's world (see the module docstring). Subclass it and implement :meth:`reset` and :meth:`step`.

    Attributes a subclass may set:
        tools: names of the tools written ``name(...)`` that :meth:`parse_tool_call` recognises (the JSON
            ``<tool_call>`` form is always recognised).
        observation_role: the chat role the observations are rendered with ("user", or "tool" where the chat
            template has one).
        timeout_s: seconds one :meth:`reset` or :meth:`step` may take; past it the episode ends without a reward
            and is counted in ``episode/env_timeouts``.
    """

    tools: Sequence[str] = ()
    observation_role: str = "user"
    timeout_s: float = 10.0

    @abstractmethod
    def reset(self, row: dict[str, Any], seed: int) -> Union[str, list[dict[str, str]]]:
        """Starts an episode for the data ``row`` (``{"id", "question", "answer", "columns"}``) and returns the first
        observation: the text of the first user message (task, rules, tools), or the opening messages in TRL's
        conversational format (:mod:`scgrpo.chat`; a system message there replaces the run's). ``seed`` seeds the environment's own
        randomness: the episodes of one group get the same one (they start from one state), and it is fixed by the
        row's id and the run's seed (in evaluation by the row's id alone)."""

    @abstractmethod
    def step(self, action: Action) -> StepResult:
        """Takes the model's turn and returns the next observation, the turn's reward and whether it ended."""

    def parse_tool_call(self, text: str) -> Optional[ToolCall]:
        """The tool call in the model's turn (see :func:`parse_tool_call`); override for another syntax."""
        return parse_tool_call(text, self.tools)

    def spawn(self) -> "Environment":
        """A fresh copy for one episode (the configured instance is the template; a deep copy by default)."""
        return copy.deepcopy(self)

    def close(self) -> None:
        """Frees what one episode held (called once its episode ended, also after a fault)."""


@dataclass
class EpisodeSettings:
    """How episodes run (``model.episodes`` in YAML); one model turn samples at most
    ``generation.max_new_tokens`` tokens."""

    max_turns: int = 4
    """Model turns per episode; an episode still going after them is truncated"""
    max_episode_tokens: int = 256
    """Model and environment tokens after the first prompt; an episode that reaches it is cut there and truncated"""
    timeout_s: Optional[float] = None
    """Seconds one environment call may take (None: the environment's own ``timeout_s``)"""
    max_workers: int = 16
    """Environment calls run at once (threads)"""
    on_fault: str = "exclude"
    """A rollout without a reward (its environment raised, hung or returned junk; for single completions, every
    reward function failed on it or the verifier raised): "exclude" leaves it out of its group's mean and std and out
    of the loss (``rollout/excluded``; a group left with fewer than 2 is skipped, ``rollout/skipped_groups``);
    "zero" trains on it as a reward of 0"""
    gamma: float = 1.0
    """Discount of the per-turn returns: model turn k's return is the sum over the turns j >= k of gamma^(j-k) r_j,
    r_j the reward of the environment's step after turn j (read by objectives that credit turns: ``TurnGRPO``; the
    others train on the episode's reward, the sum of its turns' rewards)"""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"episodes.max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 1:
            raise ValueError(f"episodes.max_episode_tokens must be >= 1, got {self.max_episode_tokens}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"episodes.timeout_s must be > 0 (or null), got {self.timeout_s}")
        if self.max_workers < 1:
            raise ValueError(f"episodes.max_workers must be >= 1, got {self.max_workers}")
        if self.on_fault not in ("exclude", "zero"):
            raise ValueError(f"episodes.on_fault={self.on_fault!r}: expected 'exclude' (a rollout without a reward "
                             "leaves its group's statistics and the loss) or 'zero' (it is trained on with reward 0)")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"episodes.gamma must be in [0, 1], got {self.gamma}")
