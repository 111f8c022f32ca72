"""The rows of the doors task (:mod:`scgrpo.envs.doors`): one seed and its settings per episode."""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

from scgrpo.data.gym import ScoredByEnvironment
from scgrpo.data.sources import PromptSource, Row
from scgrpo.envs.doors import INTRO, NAMES, OOD_NAMES, DoorsEnv, check_settings
from scgrpo.verifiers.base import Verifier


class DoorsTask(PromptSource):
    """Rooms with two doors, the key behind one (``data.source: doors``; played by :class:`~scgrpo.envs.doors.DoorsEnv`,
    the task's default environment). Each row's answer is ``{"seed", "rooms", "names"}``: a row is one fixed
    episode, the same for the G episodes of its group. Splits: ``train`` and ``id`` (``rooms`` rooms, doors named
    from ``names``; their seeds disjoint), ``ood`` (``ood_rooms`` rooms, doors named from ``ood_names``, words
    never seen in training, and with the rule ``larger`` numbers of ``ood_digits`` digits).

    Args:
        rooms, names, digits: the train and id episodes' rooms, door names and (rule ``larger``) numbers' digits.
        ood_rooms, ood_names, ood_digits: the ood split's (``ood_digits`` None: ``digits`` + 1).
        intro, room, shots, rule: the texts, worked rooms and rule of :class:`~scgrpo.envs.doors.DoorsEnv`.
        num_train, num_eval, num_ood: the splits' sizes.
        seed: fixes the splits' seeds.
    """

    def __init__(self, rooms: int = 4, names: Sequence[str] = NAMES, ood_rooms: int = 6,
                 ood_names: Sequence[str] = OOD_NAMES, intro: str = INTRO, room: Optional[str] = None,
                 shots: int = 2, rule: str = "named", digits: int = 2, ood_digits: Optional[int] = None,
                 num_train: int = 20000, num_eval: int = 256, num_ood: int = 256, seed: int = 1234) -> None:
        ood_digits = digits + 1 if ood_digits is None else ood_digits
        check_settings(rooms, names, digits)
        check_settings(ood_rooms, ood_names, ood_digits)
        if num_train < 1 or num_eval < 0 or num_ood < 0:
            raise ValueError(f"num_train must be >= 1, num_eval and num_ood >= 0; got {num_train}, {num_eval}, "
                             f"{num_ood}")
        self.rooms, self.names, self.ood_rooms, self.ood_names = rooms, list(names), ood_rooms, list(ood_names)
        self.intro, self.room, self.shots, self.rule = intro, room, shots, rule
        self.digits, self.ood_digits = digits, ood_digits
        self.default_environment()  # the texts and shots checked here
        self.num_train, self.num_eval, self.num_ood, self.seed = num_train, num_eval, num_ood, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id", "ood"]

    def default_verifier(self) -> Verifier:
        return ScoredByEnvironment()

    def default_environment(self) -> DoorsEnv:
        return DoorsEnv(self.rooms, self.names, self.intro, self.room, self.shots, self.rule, self.digits)

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"DoorsTask has no split {split!r}; expected one of {self.splits()}")
        if not self._cache:
            counts = {"train": self.num_train, "id": self.num_eval, "ood": self.num_ood}
            seeds = random.Random(f"{self.seed}-doors").sample(range(2**31), sum(counts.values()))
            start = 0
            for name, count in counts.items():
                ood = name == "ood"
                answer: dict[str, Any] = {"rooms": self.ood_rooms if ood else self.rooms,
                                          "names": self.ood_names if ood else self.names}
                if self.rule != "named":
                    answer["digits"] = self.ood_digits if ood else self.digits
                self._cache[name] = [{"id": f"{name}-{k}", "question": "doors",
                                      "answer": {"seed": seeds[start + k], **answer}} for k in range(count)]
                start += count
        return self._cache[split]
