"""Prompt sources whose rows are episodes of a gymnasium environment, and the packaged one.

A :class:`GymTask` row fixes the environment's seed and settings; its :meth:`~GymTask.default_environment` (a
:class:`~scgrpo.envs.gym.GymnasiumEnv`) plays it and gives the reward. Packaged: ``blackjack``
(:class:`BlackjackTask`), gymnasium's Blackjack-v1.
"""

from __future__ import annotations

import random
from typing import Any, Optional

from scgrpo.data.sources import PromptSource, Row
from scgrpo.envs.gym import GymnasiumEnv
from scgrpo.verifiers.base import VerificationResult, Verifier, VerifierSetupError


class ScoredByEnvironment(Verifier):
    """The verifier of sources whose rows are episodes: it scores nothing, their environment does."""

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        raise VerifierSetupError(
            "this task's rows are episodes, scored by their environment: set model.environment (the source's "
            "default_environment()) instead of scoring completions with a verifier"
        )


class GymTask(PromptSource):
    """Episodes of a gymnasium environment as rows; :meth:`default_environment` is the :class:`GymnasiumEnv`
    that plays them.

    Each row's answer is ``{"seed": s, "make_kwargs": {...}}`` (see :class:`GymnasiumEnv`): the G episodes of
    a row start from the same state and, where the environment draws at random, see the same draws until their
    actions differ. Splits: ``train`` (``num_train`` seeds), ``id`` (``num_eval`` other seeds, same settings),
    ``ood`` (``num_ood`` other seeds, with ``ood_make_kwargs`` over the settings). Seeds of the splits are
    disjoint; whether their start states are depends on the environment. With ``model.environment`` set, only
    the rows' arguments matter (``ood_make_kwargs``, the sizes, ``seed``).

    Args:
        env_id, entry_point, make_kwargs, instructions, actions, render, parse, reward, success_threshold,
            max_invalid, judge: those of :class:`GymnasiumEnv` (``instructions`` is also each row's question).
        ood_make_kwargs: the ood split's settings, over ``make_kwargs`` (None: no ood split).
        num_train: size of the train split.
        num_eval: size of the id split.
        num_ood: size of the ood split.
        seed: fixes the splits' seeds.
    """

    def __init__(
        self,
        env_id: Optional[str] = None,
        entry_point: Optional[str] = None,
        make_kwargs: Optional[dict[str, Any]] = None,
        instructions: str = "",
        actions: Optional[dict[str, Any]] = None,
        render: Optional[str] = None,
        parse: Optional[str] = None,
        reward: str = "success",
        success_threshold: float = 0.0,
        max_invalid: int = 2,
        judge: Optional[str] = None,
        ood_make_kwargs: Optional[dict[str, Any]] = None,
        num_train: int = 10000,
        num_eval: int = 64,
        num_ood: int = 64,
        seed: int = 1234,
    ) -> None:
        if num_train < 1 or num_eval < 0 or num_ood < 0:
            raise ValueError(f"num_train must be >= 1, num_eval and num_ood >= 0; got {num_train}, "
                             f"{num_eval}, {num_ood}")
        self.env_settings = dict(env_id=env_id, entry_point=entry_point, make_kwargs=make_kwargs,
                                 instructions=instructions or None, actions=actions, render=render,
                                 parse=parse, reward=reward, success_threshold=success_threshold,
                                 max_invalid=max_invalid, judge=judge)
        self.instructions, self.ood_make_kwargs = instructions, ood_make_kwargs
        self.num_train, self.num_eval, self.num_ood, self.seed = num_train, num_eval, num_ood, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id"] + (["ood"] if self.ood_make_kwargs is not None else [])

    def default_verifier(self) -> Verifier:
        return ScoredByEnvironment()

    def default_environment(self) -> GymnasiumEnv:
        return GymnasiumEnv(**self.env_settings)

    def describe(self, split: str) -> str:
        env = self.env_settings["env_id"] or self.env_settings["entry_point"]
        return f"{type(self).__name__} ({env}) split {split!r}"

    def make_kwargs(self, split: str, rng: random.Random) -> dict[str, Any]:
        """The settings of one row of ``split`` over the environment's own (override to vary them by row, e.g.
        a map; ``rng`` is the split's)."""
        return dict(self.ood_make_kwargs or {}) if split == "ood" else {}

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"{type(self).__name__} has no split {split!r}; expected one of {self.splits()}")
        if not self._cache:
            counts = {"train": self.num_train, "id": self.num_eval, "ood": self.num_ood}
            seeds = random.Random(f"{self.seed}-seeds").sample(range(2**31), sum(counts.values()))
            start = 0
            for name, count in counts.items():
                rng = random.Random(f"{self.seed}-{name}")
                self._cache[name] = [
                    {"id": f"{name}-{k}", "question": self.instructions,
                     "answer": {"seed": seeds[start + k], "make_kwargs": self.make_kwargs(name, rng)}}
                    for k in range(count)
                ]
                start += count
        return self._cache[split]


class BlackjackTask(GymTask):
    """gymnasium's Blackjack-v1: reply ``hit`` or ``stick`` until the hand is over; an episode succeeds when
    it wins. Each row is one shuffle of the (infinite) deck. The ood split plays Sutton and Barto's rules
    (``sab=True``: a natural blackjack wins over the dealer's non-natural 21). Each move is marked as its turn's
    decision, right when it is the basic-strategy move (:func:`scgrpo.envs.gym.blackjack_basic_strategy`)."""

    INSTRUCTIONS = "Play blackjack: get closer to 21 than the dealer without going over 21."
    ACTIONS = {"hit": 1, "hits": 1, "hitting": 1, "stick": 0, "sticks": 0, "sticking": 0, "stand": 0,
               "stands": 0, "standing": 0, "stay": 0, "stays": 0}

    def __init__(self, num_train: int = 10000, num_eval: int = 64, num_ood: int = 64, seed: int = 1234,
                 instructions: str = INSTRUCTIONS, max_invalid: int = 2) -> None:
        super().__init__("Blackjack-v1", instructions=instructions, actions=self.ACTIONS,
                         judge="scgrpo.envs.gym:blackjack_basic_strategy",
                         render="scgrpo.envs.gym:blackjack_text", max_invalid=max_invalid,
                         ood_make_kwargs={"sab": True}, num_train=num_train, num_eval=num_eval,
                         num_ood=num_ood, seed=seed)
