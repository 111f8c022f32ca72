"""A task with known pivots: rooms in a row, one door to choose in each (ours, DESIGN §4.2).

An episode's two doors are named by two words drawn from a pool (both named in the first message); in each room
the key is behind one of them, drawn per room, and the room says which (rule ``named``) or shows a number on each
door, the key behind the larger (rule ``larger``: the move cannot be copied from the room), or the two alternate
(rule ``mixed``). The model's turn is one move: the first of the two door names
in its reply (whole word, any case). No feedback until the end: the next room follows whatever the move; after the
last room the episode scores 1 only if every move was right. So a policy that does not read the room (always the
first-named door, always one word, alternating) succeeds with probability 2^-rooms. The first message holds
``shots`` worked rooms as earlier chat turns (the room, then the door's name as the assistant's reply): the
untrained SmolLM2-135M-Instruct names a door in 16-48% of its replies without them and about 80% with two, and
is then right in about 70% of first rooms (benchmarks/results/credit/calibration.md).

Every move is the turn's decision (``info["decisions"]``, :mod:`scgrpo.pivots`): the door name's span in the
reply, right or wrong. A reply that names neither door is a wrong move without a span (no decision marked).
The episodes of a group share their seed, so a verified episode holds exactly the right moves of every room: its
teacher knows each pivot. The task's rows are :class:`scgrpo.data.DoorsTask`.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Sequence, Union

from scgrpo.envs.base import Action, Environment, StepResult

NAMES = ("red", "blue", "green", "yellow", "white", "black")
"""Door names of the train and id splits"""
OOD_NAMES = ("purple", "orange", "pink", "brown", "grey", "golden")
"""Door names of the ood split (never seen in training)"""

INTRO = "Every room has a {a} door and a {b} door. Open the door with the key.\n\n"
ROOM = "The key is behind the {key} door. Which door do you open?"
"""The room of the rule ``named``: the room names the key's door (a move the reply can copy)"""
LARGER_ROOM = ("The {a} door shows {x} and the {b} door shows {y}. The key is behind the door with the larger "
               "number. Which door do you open?")
"""The room of the rule ``larger``: each door shows a number and the key is behind the larger (nothing to copy:
the move needs the comparison)"""
RULES = {"named": ROOM, "larger": LARGER_ROOM, "mixed": None}
"""Each rule's room text (``mixed``: the rooms alternate, ``named`` first, each kind with its own text)"""


class DoorsEnv(Environment):
    """Rooms with two doors (see the module docstring).

    A row's ``answer`` may fix the episode (``{"seed": s, "rooms": k, "names": [...]}``, any of them); what it
    leaves out comes from the environment's settings and, for the seed, the runner's (shared by a group).

    Args:
        rooms: rooms per episode.
        names: the pool the episode's two door names are drawn from (at least 2 distinct words).
        intro: text before the first (worked) room, with ``{a}``, ``{b}`` (the doors) and ``{rooms}``.
        room: one room's text, with ``{key}`` (the door with the key) and optionally ``{room}`` (1-based), ``{a}``
            and ``{b}``.
        shots: worked rooms before the first room, as user and assistant turns of the first message (0: the
            first message is the intro and the first room, as text).
        rule: what puts the key behind a door: ``named`` (the room says which door: ``{key}``), ``larger``
            (each door shows a number, ``{x}`` on the first-named and ``{y}`` on the other, two different numbers
            of ``digits`` digits; the key is behind the larger) or ``mixed`` (the worked rooms, then the rooms,
            alternate between the two, ``named`` first; each kind's room is ROOM or LARGER_ROOM, ``room`` unset).
        digits: the numbers' digits (rule ``larger``; 1: 1 to 9).
    """

    def __init__(self, rooms: int = 4, names: Sequence[str] = NAMES, intro: str = INTRO, room: Optional[str] = None,
                 shots: int = 2, rule: str = "named", digits: int = 2) -> None:
        check_settings(rooms, names, digits)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {sorted(RULES)}, got {rule!r}")
        if rule == "mixed" and room is not None:
            raise ValueError("the rule 'mixed' takes no room text (its rooms are ROOM and LARGER_ROOM)")
        room = RULES[rule] if room is None else room
        needs = ("{key}",) if rule == "named" else ("{x}", "{y}")
        if room is not None and not all(field in room for field in needs):
            raise ValueError(f"room {room!r} of the rule {rule!r} needs {' and '.join(needs)}")
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            raise ValueError(f"shots must be an int >= 0, got {shots!r}")
        self.rooms, self.names, self.intro, self.room, self.shots = rooms, list(names), intro, room, shots
        self.rule, self.digits = rule, digits
        self.doors: tuple[str, str] = ("", "")
        self.layout: list[tuple[str, str, int]] = []  # (first name, second name, index of the key's door)
        self.numbers: list[Optional[tuple[int, int]]] = []  # per room, worked rooms first: the doors' numbers
        # (None: a named room)
        self.moves: list[Optional[int]] = []

    def reset(self, row: dict[str, Any], seed: int) -> Union[str, list[dict[str, str]]]:
        answer = row.get("answer") if isinstance(row.get("answer"), dict) else {}
        rooms, names = int(answer.get("rooms", self.rooms)), list(answer.get("names", self.names))
        digits = int(answer.get("digits", self.digits))
        check_settings(rooms, names, digits)
        rng = random.Random(int(answer.get("seed", seed)))
        a, b = rng.sample(list(dict.fromkeys(names)), 2)
        self.doors = (a, b)
        low = 1 if digits == 1 else 10 ** (digits - 1)
        self.numbers, keys = [], []
        for k in range(self.shots + rooms):
            if self.rule == "named" or (self.rule == "mixed" and k % 2 == 0):
                keys.append(rng.randrange(2))
                self.numbers.append(None)
            else:
                x, y = rng.sample(range(low, 10 ** digits), 2)
                keys.append(int(y > x))
                self.numbers.append((x, y))
        if self.rule == "named":
            self.numbers = []
        worked = keys[:self.shots]
        self.layout = [(a, b, key) for key in keys[self.shots:]]
        self.moves = []
        intro = self.intro.replace("{a}", a).replace("{b}", b).replace("{rooms}", str(rooms))
        if not self.shots:
            return intro + self._room_text(0)
        messages = []
        for k, key in enumerate(worked):
            text = self._text(a, b, key, k)
            messages += [{"role": "user", "content": intro + text if k == 0 else text},
                         {"role": "assistant", "content": (a, b)[key]}]
        return messages + [{"role": "user", "content": self._room_text(0)}]

    def _room_text(self, k: int) -> str:
        a, b, key = self.layout[k]
        return self._text(a, b, key, self.shots + k)

    def _text(self, a: str, b: str, key: int, k: int) -> str:
        numbers = self.numbers[k] if self.numbers else None
        room = self.room if self.room is not None else (ROOM if numbers is None else LARGER_ROOM)
        text = room.replace("{room}", str(k + 1)).replace("{a}", a).replace("{b}", b)
        if numbers is not None:
            text = text.replace("{x}", str(numbers[0])).replace("{y}", str(numbers[1]))
        return text.replace("{key}", (a, b)[key])

    def step(self, action: Action) -> StepResult:
        k = len(self.moves)
        if k >= len(self.layout):
            raise RuntimeError("step() after the last room")
        a, b, key = self.layout[k]
        move, span = first_name(action.text, (a, b))
        self.moves.append(move)
        info: dict[str, Any] = {"room": k + 1, "doors": [a, b], "move": None if move is None else (a, b)[move]}
        if self.numbers and self.numbers[self.shots + k] is not None:
            info["numbers"] = list(self.numbers[self.shots + k])
        if span is not None:
            info["decisions"] = [{"span": list(span), "correct": move == key}]
        if k + 1 < len(self.layout):
            return StepResult(self._room_text(k + 1), 0.0, False, info)
        right = sum(m == door[2] for m, door in zip(self.moves, self.layout))
        info.update(right_moves=right, rooms=len(self.layout))
        return StepResult("", 1.0 if right == len(self.layout) else 0.0, True, info)


def check_settings(rooms: int, names: Sequence[str], digits: int = 1) -> None:
    if isinstance(rooms, bool) or not isinstance(rooms, int) or rooms < 1:
        raise ValueError(f"rooms must be an int >= 1, got {rooms!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be an int >= 1, got {digits!r}")
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
