"""A task with known pivots: rooms in a row, one door to choose in each (ours, DESIGN §4.2).

Each room shows two doors, named by words drawn from a pool, and says which of them holds the key; the side
(first- or second-named) of the key's door is drawn per room. The model's turn is one move: the first of the two
door names in its reply (whole word, any case). No feedback until the end: the next room follows whatever the
move; after the last room the episode scores 1 only if every move was right. So a policy that does not read the
room (always the first-named door, always one word, alternating) succeeds with probability 2^-rooms.

Every move is the turn's decision (``info["decisions"]``, :mod:`scgrpo.pivots`): the door name's span in the
reply, right or wrong. A reply that names neither door is a wrong move without a span (no decision marked).
The episodes of a group share their seed, so a verified episode holds exactly the right moves of every room: its
teacher knows each pivot. The task's rows are :class:`scgrpo.data.DoorsTask`.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Sequence

from scgrpo.envs.base import Action, Environment, StepResult

NAMES = ("red", "blue", "green", "yellow", "white", "black")
"""Door names of the train and id splits"""
OOD_NAMES = ("purple", "orange", "pink", "brown", "grey", "golden")
"""Door names of the ood split (never seen in training)"""

INTRO = "You walk through {rooms} rooms. In each room, open the door with the key.\n\n"
ROOM = "Room {room}: a {a} door and a {b} door. The key is behind the {key} door. Which door do you open?"


class DoorsEnv(Environment):
    """Rooms with two doors (see the module docstring).

    A row's ``answer`` may fix the episode (``{"seed": s, "rooms": k, "names": [...]}``, any of them); what it
    leaves out comes from the environment's settings and, for the seed, the runner's (shared by a group).

    Args:
        rooms: rooms per episode.
        names: the pool the two door names of a room are drawn from (at least 2 distinct words).
        intro: text before the first room, with ``{rooms}``.
        room: one room's text, with ``{room}`` (1-based), ``{a}`` and ``{b}`` (the doors in the order named) and
            ``{key}`` (the door with the key).
    """

    def __init__(self, rooms: int = 3, names: Sequence[str] = NAMES, intro: str = INTRO, room: str = ROOM) -> None:
        check_settings(rooms, names)
        for field in ("{a}", "{b}", "{key}"):
            if field not in room:
                raise ValueError(f"room {room!r} has no {field}")
        self.rooms, self.names, self.intro, self.room = rooms, list(names), intro, room
        self.layout: list[tuple[str, str, int]] = []  # (first name, second name, index of the key's door)
        self.moves: list[Optional[int]] = []

    def reset(self, row: dict[str, Any], seed: int) -> str:
        answer = row.get("answer") if isinstance(row.get("answer"), dict) else {}
        rooms, names = int(answer.get("rooms", self.rooms)), list(answer.get("names", self.names))
        check_settings(rooms, names)
        rng = random.Random(int(answer.get("seed", seed)))
        self.layout = []
        for _ in range(rooms):
            a, b = rng.sample(names, 2)
            self.layout.append((a, b, rng.randrange(2)))
        self.moves = []
        return self.intro.replace("{rooms}", str(rooms)) + self._room_text(0)

    def _room_text(self, k: int) -> str:
        a, b, key = self.layout[k]
        return (self.room.replace("{room}", str(k + 1)).replace("{a}", a).replace("{b}", b)
                .replace("{key}", (a, b)[key]))

    def step(self, action: Action) -> StepResult:
        k = len(self.moves)
        if k >= len(self.layout):
            raise RuntimeError("step() after the last room")
        a, b, key = self.layout[k]
        move, span = first_name(action.text, (a, b))
        self.moves.append(move)
        info: dict[str, Any] = {"room": k + 1, "doors": [a, b], "move": None if move is None else (a, b)[move]}
        if span is not None:
            info["decisions"] = [{"span": list(span), "correct": move == key}]
        if k + 1 < len(self.layout):
            return StepResult(self._room_text(k + 1), 0.0, False, info)
        right = sum(m == door[2] for m, door in zip(self.moves, self.layout))
        info.update(right_moves=right, rooms=len(self.layout))
        return StepResult("", 1.0 if right == len(self.layout) else 0.0, True, info)


def check_settings(rooms: int, names: Sequence[str]) -> None:
    if isinstance(rooms, bool) or not isinstance(rooms, int) or rooms < 1:
        raise ValueError(f"rooms must be an int >= 1, got {rooms!r}")
    if isinstance(names, str) or len(set(names)) < 2 or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"names must be at least 2 distinct words, got {names!r}")


def first_name(text: str, names: Sequence[str]) -> tuple[Optional[int], Optional[tuple[int, int]]]:
    """Which of ``names`` ``text`` names first (whole word, any case) and where, or (None, None)."""
    best: Optional[tuple[int, int, int]] = None
    for k, name in enumerate(names):
        match = re.search(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", text, re.IGNORECASE)
        if match and (best is None or match.start() < best[1]):
            best = (k, match.start(), match.end())
    return (None, None) if best is None else (best[0], (best[1], best[2]))
