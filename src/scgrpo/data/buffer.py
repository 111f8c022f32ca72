"""The verified-trajectory buffer: the model's own verified completions, per prompt, kept across steps."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass
class VerifiedTrajectory:
    """One verified completion of a prompt."""

    token_ids: list[int]
    text: str
    reward: float
    step: int


class VerifiedBuffer:
    """Up to ``size_per_prompt`` verified completions for each prompt id, at most ``max_total`` overall.

    Duplicates (same token ids) are stored once; adding one again makes it the most recent. Past a cap the
    oldest entry goes first: the oldest completion of a prompt past ``size_per_prompt``, and past
    ``max_total`` the oldest completion of the prompt updated longest ago. ``state_dict`` /
    ``load_state_dict`` make it part of a checkpoint (loaded under this buffer's caps).
    """

    def __init__(self, size_per_prompt: int = 4, max_total: Optional[int] = 100_000) -> None:
        if size_per_prompt < 0:
            raise ValueError(f"buffer_size_per_prompt must be >= 0, got {size_per_prompt}")
        if max_total is not None and max_total < 0:
            raise ValueError(f"buffer max_total must be >= 0 or null, got {max_total}")
        self.size_per_prompt, self.max_total = size_per_prompt, max_total
        self._entries: "OrderedDict[str, list[VerifiedTrajectory]]" = OrderedDict()  # prompt id -> oldest first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def get(self, prompt_id: str) -> list[VerifiedTrajectory]:
        """The prompt's verified completions, oldest first (a copy)."""
        return list(self._entries.get(prompt_id, ()))

    def add(self, prompt_id: str, token_ids: list[int], text: str, reward: float, step: int) -> None:
        if self.size_per_prompt == 0:
            return
        entries = self._entries.setdefault(prompt_id, [])
        key = list(token_ids)
        for i, entry in enumerate(entries):
            if entry.token_ids == key:
                entries.pop(i)
                self._count -= 1
                break
        entries.append(VerifiedTrajectory(key, text, float(reward), int(step)))
        self._count += 1
        self._entries.move_to_end(prompt_id)
        while len(entries) > self.size_per_prompt:
            entries.pop(0)
            self._count -= 1
        self._evict()

    def _evict(self) -> None:
        """Past ``max_total``: the oldest completion of the prompt updated longest ago, until within it."""
        while self.max_total is not None and self._count > self.max_total:
            oldest_id = next(iter(self._entries))
            oldest = self._entries[oldest_id]
            oldest.pop(0)
            self._count -= 1
            if not oldest:
                del self._entries[oldest_id]

    @classmethod
    def merge_states(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state from several buffers' states (one per rank), under the first state's caps: every completion
        added again in the order of the steps that verified them, so that the merged buffer holds what one buffer
        that saw every rank's adds would (a completion two ranks hold is kept once, as of its latest step)."""
        first = states[0]
        items = [(prompt_id, entry) for state in states for prompt_id, entries in state["entries"] for entry in entries]
        merged = cls(first["size_per_prompt"], first["max_total"])
        for prompt_id, entry in sorted(items, key=lambda item: item[1]["step"]):  # stable: rank order within a step
            merged.add(prompt_id, entry["token_ids"], entry["text"], entry["reward"], entry["step"])
        return merged.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "size_per_prompt": self.size_per_prompt,
            "max_total": self.max_total,
            "entries": [[pid, [asdict(e) for e in entries]] for pid, entries in self._entries.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state's completions, in its recency order, under this buffer's caps (a resumed run's settings): past
        them the oldest go, as they would have gone when added."""
        self._entries = OrderedDict()
        for pid, entries in state["entries"]:
            kept = [VerifiedTrajectory(**e) for e in entries][-self.size_per_prompt:] if self.size_per_prompt else []
            if kept:
                self._entries[pid] = kept
        self._count = sum(len(v) for v in self._entries.values())
        self._evict()
