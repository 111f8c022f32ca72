"""The rows of the doors task (:mod:`scgrpo.envs.doors`): one seed and its settings per episode."""

from __future__ import annotations

import random
from typing import Any, Sequence

from scgrpo.data.gym import ScoredByEnvironment
from scgrpo.data.sources import PromptSource, Row
from scgrpo.envs.doors import INTRO, NAMES, OOD_NAMES, ROOM, DoorsEnv, check_settings
from scgrpo.verifiers.base import Verifier


class DoorsTask(PromptSource):
    """Rooms with two doors, the key behind one (``data.source: doors``; played by :class:`~scgrpo.envs.doors.DoorsEnv`,
    the task's default environment). Each row's answer is ``{"seed", "rooms", "names"}``: a row is one fixed
    episode, the same for the G episodes of its group. Splits: ``train`` and ``id`` (``rooms`` rooms, doors named
    from ``names``; their seeds disjoint), ``ood`` (``ood_rooms`` rooms, doors named from ``ood_names``, words
    never seen in training).

    Args:
        rooms, names: the train and id episodes' rooms and door names.
        ood_rooms, ood_names: the ood split's.
        intro, room, shots: the texts and worked rooms of :class:`~scgrpo.envs.doors.DoorsEnv`.
        num_train, num_eval, num_ood: the splits' sizes.
        seed: fixes the splits' seeds.
    """

    def __init__(self, rooms: int = 4, names: Sequence[str] = NAMES, ood_rooms: int = 6,
                 ood_names: Sequence[str] = OOD_NAMES, intro: str = INTRO, room: str = ROOM, shots: int = 2,
                 num_train: int = 20000, num_eval: int = 256, num_ood: int = 256, seed: int = 1234) -> None:
        check_settings(rooms, names)
        check_settings(ood_rooms, ood_names)
        if num_train < 1 or num_eval < 0 or num_ood < 0:
            raise ValueError(f"num_train must be >= 1, num_eval and num_ood >= 0; got {num_train}, {num_eval}, "
                             f"{num_ood}")
        self.rooms, self.names, self.ood_rooms, self.ood_names = rooms, list(names), ood_rooms, list(ood_names)
        self.intro, self.room, self.shots = intro, room, shots
        self.default_environment()  # the texts and shots checked here
        self.num_train, self.num_eval, self.num_ood, self.seed = num_train, num_eval, num_ood, seed
        self._cache: dict[str, list[Row]] = {}

    def splits(self) -> list[str]:
        return ["train", "id", "ood"]

    def default_verifier(self) -> Verifier:
        return ScoredByEnvironment()

    def default_environment(self) -> DoorsEnv:
        return DoorsEnv(self.rooms, self.names, self.intro, self.room, self.shots)

    def rows(self, split: str) -> list[Row]:
        if split not in self.splits():
            raise ValueError(f"DoorsTask has no split {split!r}; expected one of {self.splits()}")
        if not self._cache:
            counts = {"train": self.num_train, "id": self.num_eval, "ood": self.num_ood}
            seeds = random.Random(f"{self.seed}-doors").sample(range(2**31), sum(counts.values()))
            start = 0
            for name, count in counts.items():
                rooms, names = (self.ood_rooms, self.ood_names) if name == "ood" else (self.rooms, self.names)
                answer: dict[str, Any] = {"rooms": rooms, "names": names}
                self._cache[name] = [{"id": f"{name}-{k}", "question": "doors",
                                      "answer": {"seed": seeds[start + k], **answer}} for k in range(count)]
                start += count
        return self._cache[split]
