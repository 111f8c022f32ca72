"""Scripted environments for the episode tests: fixed observations, chosen rewards, and faults on demand."""

from __future__ import annotations

import time

from scgrpo.envs import Environment, StepResult


class Scripted(Environment):
    """Answers each model turn with ``obs<k>`` and ends after ``turns`` turns with reward 1 for rows whose
    answer is odd (0 otherwise). ``fault`` makes ``step`` misbehave on rows whose answer equals ``fault_row``:
    "raise", "hang", "junk" (a string instead of a StepResult), "nan" (a NaN reward), "info" (info that is not a dict) or "reset" (reset raises).
    ``more_turns_per_rank`` makes the ranks of a sharded run play episodes of different lengths."""

    def __init__(self, turns: int = 2, fault: str = "", fault_row: int = -1, hang_s: float = 30.0,
                 more_turns_per_rank: int = 0) -> None:
        self.turns, self.fault, self.fault_row, self.hang_s = turns, fault, fault_row, hang_s
        self.more_turns_per_rank = more_turns_per_rank  # rank r's episodes last r x this many turns more

    def reset(self, row, seed):
        self.t, self.row, self.seed = 0, row, seed
        if self.more_turns_per_rank:
            import torch.distributed as dist

            self.turns += self.more_turns_per_rank * (dist.get_rank() if dist.is_initialized() else 0)
        if self.fault == "reset" and row["answer"] == self.fault_row:
            raise RuntimeError("reset failed")
        return f"Task {row['question']}"

    def step(self, action):
        self.t += 1
        if self.row["answer"] == self.fault_row:
            if self.fault == "raise":
                raise ValueError("environment broke")
            if self.fault == "hang":
                time.sleep(self.hang_s)
            if self.fault == "junk":
                return "not a step result"
            if self.fault == "nan":
                return StepResult(reward=float("nan"), done=True)
            if self.fault == "info":
                return StepResult(observation="o", info=None)
        if self.t >= self.turns:
            return StepResult(reward=float(self.row["answer"] % 2), done=True, info={"turn": self.t})
        return StepResult(observation=f"obs{self.t}")


class FastClock:
    """A monotonic clock ``rate`` times as fast as the real one: time limits pass without the tests' sleeping them."""

    def __init__(self, rate: float = 50.0) -> None:
        self.rate, self.start = rate, time.monotonic()

    def __call__(self) -> float:
        return (time.monotonic() - self.start) * self.rate
