"""Gymnasium environments as text environments.

:class:`GymnasiumEnv` plays any gymnasium-style environment (a registered id, or an import path to an ``Env``
class) through the :class:`~scgrpo.envs.Environment` interface: the observation is rendered as text, the
model's turn is parsed into an action, and gymnasium's ``terminated``/``truncated`` end the episode. The
prompt sources of its episodes are in :mod:`scgrpo.data.gym`; :func:`blackjack_text` renders the packaged
task's Blackjack-v1. gymnasium is an optional dependency: ``pip install 'scgrpo[gym]'``.
"""

from __future__ import annotations

import copy
import importlib
import re
from typing import Any, Callable, Optional

from scgrpo.chat import prompt_text
from scgrpo.envs.base import Action, Environment, StepResult

GYM_INSTALL = "pip install 'scgrpo[gym]'"
REWARDS = ("success", "raw")
ANSWER_KEYS = ("seed", "make_kwargs", "options")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def gymnasium_module():
    try:
        import gymnasium
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"gymnasium environments need the package gymnasium; install it with: {GYM_INSTALL}") from err
    return gymnasium


def import_path(path: str, what: str) -> Any:
    """The object named by ``"pkg.module:name"`` (``name`` may be dotted: ``Class.method``)."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what} {path!r}: expected an import path 'pkg.module:name'")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"{what} {path!r}: cannot import {module!r} ({err})") from err
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def default_render(obs: Any, info: dict[str, Any], env: Any) -> str:
    """The environment's ``ansi`` rendering without its colour codes when it was made with
    ``render_mode="ansi"``, else ``str(obs)``. A cue given by colour alone (FrozenLake's position) is lost:
    give a ``render`` then."""
    if getattr(env, "render_mode", None) == "ansi":
        return _ANSI.sub("", str(env.render())).strip("\n")
    return str(obs)


class GymnasiumEnv(Environment):
    """A gymnasium environment played over text.

    One episode: :meth:`reset` makes the environment (``gymnasium.make``, a fresh one per episode), resets it
    with the row's seed and returns ``instructions`` followed by the rendered observation; each model turn is
    parsed into an action and passed to ``env.step``; ``terminated`` or ``truncated`` ends the episode.

    The row's ``answer`` says how the episode starts:
      - an int: the seed given to ``env.reset`` (the row is one fixed start in training and evaluation);
      - a dict with any of ``seed`` (int), ``make_kwargs`` (dict, merged over the environment's own) and
        ``options`` (dict, passed to ``env.reset``);
      - null, or no ``seed``: the seed :meth:`reset` is given (the runner's: shared by the row's episodes,
        drawn anew each time the row is played in training, fixed by the row's id in evaluation).

    A turn in which no action is found is answered with an observation listing the valid words and counted
    (``info["invalid_turns"]``); the ``max_invalid``-th such turn ends the episode without further reward.

    Args:
        env_id: a registered gymnasium id (``"FrozenLake-v1"``, or ``"my_pkg.module:MyEnv-v0"``, which imports
            ``my_pkg.module`` to register it first).
        entry_point: instead of ``env_id``, an import path ``"pkg.module:EnvClass"`` of an unregistered
            environment (any callable returning a ``gymnasium.Env``).
        make_kwargs: keyword arguments of ``gymnasium.make`` (the environment's own, ``max_episode_steps``,
            ``render_mode``); ``render_mode`` defaults to ``"ansi"`` where the environment offers it.
        instructions: the text put before the first observation (the task, the valid replies); None: the row's
            ``question``.
        actions: reply word -> action, for ``Discrete`` action spaces; the word found first in the turn (whole
            word, any case) is the action. Several words may map to one action. Default: the action numbers.
        render: import path of ``render(obs, info, env) -> str`` (default :func:`default_render`; ``env`` is
            the gymnasium environment, its state at ``env.unwrapped``).
        parse: import path of ``parse(text, env) -> action or None`` (None: no valid action), replacing
            ``actions``, e.g. for action spaces that are not ``Discrete``.
        reward: "success": the episode's reward is 1 when the sum of the gymnasium rewards at its end exceeds
            ``success_threshold``, else 0 (an episode cut short scores 0); "raw": each turn returns the
            gymnasium reward.
        success_threshold: see ``reward``.
        max_invalid: turns without a valid action that end the episode.
        timeout_s: seconds one reset or step may take.
        judge: import path of ``judge(obs, action, env) -> bool or None``: whether ``action`` was the right move
            in the state ``obs`` the model read (None: no rule for it). Each judged move is marked as the turn's
            decision (``info["decisions"]``: the action word's span, :mod:`scgrpo.pivots`); needs ``actions``.
    """

    def __init__(
        self,
        env_id: Optional[str] = None,
        entry_point: Optional[str] = None,
        make_kwargs: Optional[dict[str, Any]] = None,
        instructions: Optional[str] = None,
        actions: Optional[dict[str, Any]] = None,
        render: Optional[str] = None,
        parse: Optional[str] = None,
        reward: str = "success",
        success_threshold: float = 0.0,
        max_invalid: int = 2,
        timeout_s: float = 10.0,
        judge: Optional[str] = None,
    ) -> None:
        if (env_id is None) == (entry_point is None):
            raise ValueError(
                f"give one of env_id and entry_point, got env_id={env_id!r}, entry_point={entry_point!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {list(REWARDS)}, got {reward!r}")
        if max_invalid < 1:
            raise ValueError(f"max_invalid must be >= 1, got {max_invalid}")
        if actions is not None and parse is not None:
            raise ValueError("give actions or parse, not both")
        if judge is not None and parse is not None:
            raise ValueError("judge marks the action word's span: it needs actions, not parse")
        if actions is not None and not (actions and all(isinstance(w, str) and w.strip() for w in actions)):
            raise ValueError(f"actions must map non-empty reply words to actions, got {actions!r}")
        self.env_id, self.entry_point = env_id, entry_point
        self.make_kwargs = dict(make_kwargs or {})
        self.instructions, self.render, self.parse = instructions, render, parse
        self.reward, self.success_threshold, self.max_invalid = reward, float(success_threshold), max_invalid
        self.timeout_s = timeout_s
        self._render_fn: Callable[..., str] = import_path(render, "render") if render else default_render
        self._parse_fn: Optional[Callable[..., Any]] = import_path(parse, "parse") if parse else None
        self.judge = judge
        self._judge_fn: Optional[Callable[..., Any]] = import_path(judge, "judge") if judge else None
        self._spec = self._find_spec()
        self._ansi = self._offers_ansi()
        # one environment made here checks the settings and the actions before any episode runs
        env = self._make({})
        try:
            self.actions = self._check_actions(actions, env.action_space)
        finally:
            env.close()
        words = "|".join(re.escape(w) for w in sorted(self.actions, key=len, reverse=True))  # longest first
        self._pattern = re.compile(rf"(?<!\w)({words})(?!\w)", re.IGNORECASE)
        self._lower = {w.lower(): a for w, a in self.actions.items()}
        shown = {}  # the first word of each action, as the reply after an invalid turn lists them
        for word, a in self.actions.items():
            shown.setdefault(str(a), word)
        self._shown = ", ".join(shown.values()) if shown else "a valid action"
        self._env: Any = None
        self._obs: Any = None
        self._total, self._invalid = 0.0, 0

    # ---------------------------------------------------------------- set-up
    def _find_spec(self) -> Any:
        gym = gymnasium_module()
        if self.env_id is not None:
            try:
                return gym.spec(self.env_id)
            except gym.error.Error as err:
                raise ValueError(f"env_id {self.env_id!r}: {err}") from err
        import_path(self.entry_point, "entry_point")  # a clear error for a bad path, before gymnasium's own
        name = self.entry_point.rpartition(":")[2]
        return gym.envs.registration.EnvSpec(id=f"{name}-v0", entry_point=self.entry_point)

    def _offers_ansi(self) -> bool:
        creator = self._spec.entry_point
        if isinstance(creator, str):
            creator = gymnasium_module().envs.registration.load_env_creator(creator)
        return "ansi" in (getattr(creator, "metadata", None) or {}).get("render_modes", ())

    def _make(self, extra: dict[str, Any]) -> Any:
        gym = gymnasium_module()
        kwargs = {**self.make_kwargs, **extra}
        if "render_mode" not in kwargs and self._ansi:
            kwargs["render_mode"] = "ansi"
        try:
            return gym.make(self._spec, **kwargs)
        except Exception as err:  # noqa: BLE001 - a bad keyword, a bad map: one line naming the settings
            raise ValueError(f"{self._spec.id}: gymnasium.make(**{kwargs!r}) failed: {err}") from err

    def _check_actions(self, actions: Optional[dict[str, Any]], space: Any) -> dict[str, Any]:
        if self._parse_fn is not None:
            return {}
        gym = gymnasium_module()
        if not isinstance(space, gym.spaces.Discrete):
            raise ValueError(f"{self._spec.id}: its action space {space} is not Discrete; give parse: "
                             "'pkg.module:function'")
        if actions is None:
            return {str(a): a for a in range(int(space.start), int(space.start + space.n))}
        bad = {w: a for w, a in actions.items()
               if isinstance(a, bool) or not isinstance(a, int) or not space.contains(a)}
        if bad:
            raise ValueError(f"{self._spec.id}: actions {bad} are not actions of its action space {space}")
        return dict(actions)

    # ---------------------------------------------------------------- one episode
    @staticmethod
    def episode_start(answer: Any, seed: int) -> tuple[int, dict[str, Any], Optional[dict[str, Any]]]:
        """The reset seed, make_kwargs and reset options of a row whose answer is ``answer`` (see the class
        docstring); ``seed`` is the one :meth:`reset` was given."""
        if answer is None:
            return seed, {}, None
        if isinstance(answer, int) and not isinstance(answer, bool):
            return answer, {}, None
        if not isinstance(answer, dict):
            raise ValueError(f"a gymnasium row's answer must be a seed, a dict or null, got {answer!r}")
        unknown = sorted(set(answer) - set(ANSWER_KEYS))
        if unknown:
            raise ValueError(f"a gymnasium row's answer has keys {unknown}; expected any of "
                             f"{list(ANSWER_KEYS)}")
        row_seed, make_kwargs, options = answer.get("seed"), answer.get("make_kwargs"), answer.get("options")
        if row_seed is not None and (isinstance(row_seed, bool) or not isinstance(row_seed, int)):
            raise ValueError(f"a gymnasium row's seed must be an int, got {row_seed!r}")
        for key, value in (("make_kwargs", make_kwargs), ("options", options)):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"a gymnasium row's {key} must be a dict, got {value!r}")
        return (seed if row_seed is None else row_seed), dict(make_kwargs or {}), options

    def reset(self, row: dict[str, Any], seed: int) -> str:
        reset_seed, make_kwargs, options = self.episode_start(row.get("answer"), seed)
        self.close()
        self._env = self._make(make_kwargs)
        obs, info = self._env.reset(seed=reset_seed, options=options)
        self._obs, self._total, self._invalid = obs, 0.0, 0
        intro = self.instructions if self.instructions is not None else prompt_text(row.get("question") or "")
        text = self._render_fn(obs, info, self._env)
        return f"{intro}\n\n{text}" if intro else text

    def choose(self, text: str) -> Any:
        """The action in the model's turn ``text``, or None."""
        return self._choose(text)[0]

    def _choose(self, text: str) -> tuple[Any, Optional[tuple[int, int]]]:
        """The action in ``text`` and the span of its word (None with ``parse``), or (None, None)."""
        if self._parse_fn is not None:
            return self._parse_fn(text, self._env), None
        match = self._pattern.search(text)
        return (self._lower[match.group(1).lower()], match.span(1)) if match else (None, None)

    def step(self, action: Action) -> StepResult:
        if self._env is None:
            raise RuntimeError("step() before reset(), or after the episode ended")
        chosen, span = self._choose(action.text)
        if chosen is None:
            self._invalid += 1
            info = {"invalid": True, "invalid_turns": self._invalid}
            if self._invalid >= self.max_invalid:
                self.close()
                return StepResult("", 0.0, True, {**info, "success": False})
            observation = f"That is not a valid move. Reply with one of: {self._shown}."
            return StepResult(observation, 0.0, False, info)
        right = self._judge_fn(self._obs, chosen, self._env) if self._judge_fn is not None and span else None
        obs, gym_reward, terminated, truncated, gym_info = self._env.step(chosen)
        self._obs = obs
        self._total += float(gym_reward)
        done = bool(terminated or truncated)
        info = {"action": chosen if isinstance(chosen, (int, float, str)) else str(chosen),
                "gym_reward": float(gym_reward), "invalid_turns": self._invalid}
        if right is not None:
            info["decisions"] = [{"span": list(span), "correct": bool(right)}]
        if done:
            info.update(terminated=bool(terminated), truncated=bool(truncated),
                        success=self._total > self.success_threshold)
        if self.reward == "raw":
            reward = float(gym_reward)
        else:
            reward = 1.0 if done and self._total > self.success_threshold else 0.0
        observation = "" if done else self._render_fn(obs, gym_info, self._env)
        if done:
            self.close()
        return StepResult(observation, reward, done, info)

    def spawn(self) -> "GymnasiumEnv":
        """A copy for one episode: the settings shared (never changed), its own environment made in reset."""
        episode = copy.copy(self)
        episode._env, episode._obs, episode._total, episode._invalid = None, None, 0.0, 0
        return episode

    def close(self) -> None:
        if self._env is not None:
            env, self._env = self._env, None
            env.close()


# ---------------------------------------------------------------------------- the packaged task's rendering
_CARD = {1: "A"}


def _hand(cards: list[int]) -> str:
    return ", ".join(_CARD.get(c, str(c)) for c in cards)


def blackjack_text(obs: Any, info: dict[str, Any], env: Any) -> str:
    """Blackjack-v1's state (the player's cards and total, the dealer's face-up card) and the question."""
    total, dealer, usable_ace = (int(x) for x in obs)
    ace = ", an ace counting 11" if usable_ace else ""
    return (f"Your cards: {_hand(env.unwrapped.player)} (total {total}{ace}). "
            f"The dealer shows: {_CARD.get(dealer, str(dealer))}.\n"
            "Do you hit (take a card) or stick (stop)? Reply hit or stick.")


def blackjack_basic_strategy(obs: Any, action: Any, env: Any = None) -> bool:
    """Whether ``action`` (1 hit, 0 stick) is the basic-strategy move of Blackjack-v1's state ``obs`` (the
    player's total, the dealer's face-up card, 1 for an ace, and whether an ace counts 11): the move of highest
    expected return when the deck is infinite and the dealer stands on 17 (with hit and stick only, Sutton and
    Barto's optimal policy, Figure 5.2). With a usable ace: stick on 19 or more, on 18 against a dealer 2 to 8;
    otherwise stick on 17 or more, on 13 to 16 against 2 to 6, on 12 against 4 to 6."""
    total, dealer, usable_ace = (int(x) for x in obs)
    if usable_ace:
        stick = total >= 19 or (total == 18 and 2 <= dealer <= 8)
    else:
        stick = total >= 17 or (13 <= total <= 16 and 2 <= dealer <= 6) or (total == 12 and 4 <= dealer <= 6)
    return int(action) == (0 if stick else 1)
