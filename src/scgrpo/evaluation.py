"""Evaluation on held-out prompts: k sampled completions per prompt, verified, as Avg@k and Pass@k, and greedy
accuracy, per split (the paper reports Avg@8 and Pass@8)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Optional, Protocol

import torch

from scgrpo.distributed import max_over_ranks, rank, sum_over_ranks
from scgrpo.rollout.engine import Generated
from scgrpo.rollout.types import PromptBatch, token_lists
from scgrpo.verifiers import VerifierRunner

log = logging.getLogger(__name__)


class Sampler(Protocol):
    """What evaluation samples with (the module, or a :class:`~scgrpo.policy.Policy`)."""

    def format_prompts(self, questions: list[Any]) -> list[str]: ...

    def sample(self, prompts: list[str], num_samples: int, greedy: bool = False,
               temperature: Optional[float] = None) -> Generated: ...


class EpisodePlayer(Protocol):
    """Plays ``k`` episodes of each row (greedy or at a temperature) and returns them with their rewards."""

    def __call__(self, rows: list[dict], k: int, greedy: bool, temperature: Optional[float]) -> Any: ...


PROGRESS_EVERY_S = 15.0
"""Seconds between an evaluation's progress lines (none for an evaluation shorter than this)"""


class Evaluation:
    """Accumulates one validation (or test) epoch's results per split and turns them into metrics.

    Args:
        k: completions sampled per prompt (Avg@k: mean accuracy; Pass@k: any correct).
        temperature: sampling temperature (None: the training temperature).
        greedy: also measure greedy accuracy.
        success_threshold: a completion is correct when its reward is >= this.
    """

    def __init__(self, k: int, temperature: Optional[float], greedy: bool, success_threshold: float) -> None:
        if k < 1:
            raise ValueError(f"eval_samples must be >= 1, got {k}")
        self.k, self.temperature, self.greedy, self.success_threshold = k, temperature, greedy, success_threshold
        self.sums: dict[str, dict[str, float]] = {}  # per split: prompts and the sums of each metric
        self.seconds: dict[str, float] = {}  # per split: this rank's time in its batches
        self.reported = time.perf_counter()  # when progress was last logged

    def start(self) -> None:
        self.sums, self.seconds, self.reported = {}, {}, time.perf_counter()

    def metric_names(self, splits: list[str], stage: str = "val") -> list[str]:
        """The keys :meth:`metrics` gives for ``splits``, in its order."""
        names = [f"avg@{self.k}", f"pass@{self.k}", "completion_length", "truncated", *(["greedy"] if self.greedy else [])]
        return [f"{stage}/{split}/{name}" for split in splits for name in [*names, "time_s"]]

    def add(self, batch: PromptBatch, policy: Sampler, verifier: VerifierRunner,
            episodes: Optional[EpisodePlayer] = None) -> None:
        """Samples, verifies and counts one batch of held-out prompts; with ``episodes``, plays k episodes of each
        (rewarded by the environment, seeded by the row alone) instead."""
        started = time.perf_counter()
        try:
            self._add(batch, policy, verifier, episodes)
        finally:
            now = time.perf_counter()
            self.seconds[batch.split] = self.seconds.get(batch.split, 0.0) + now - started
        if now - self.reported >= PROGRESS_EVERY_S and rank() == 0:  # a long evaluation says how far it got
            self.reported = now
            log.info("evaluating [%s]: %d prompts done (this rank), %.0f s in this split", batch.split,
                     int(self.sums[batch.split]["prompts"]), self.seconds[batch.split])

    def _add(self, batch: PromptBatch, policy: Sampler, verifier: VerifierRunner,
             episodes: Optional[EpisodePlayer]) -> None:
        k = self.k
        if episodes is not None:
            rows = batch.rows()
            sampled = episodes(rows, k, False, self.temperature)
            scores = sampled.rewards.float().cpu()
        else:
            prompts = policy.format_prompts(batch.questions)
            sampled = policy.sample(prompts, k, temperature=self.temperature)
            ids = [i for i in batch.ids for _ in range(k)]
            answers = [a for a in batch.answers for _ in range(k)]
            questions = [q for q in batch.questions for _ in range(k)]
            columns = [c for c in batch.row_columns() for _ in range(k)]
            results = verifier(sampled.completions, answers, questions, ids, columns,
                               token_lists(sampled.completion_ids, sampled.completion_mask))
            scores = torch.tensor([r.score for r in results])
        correct = (scores >= self.success_threshold).float().view(-1, k)  # [P, k]
        acc = self.sums.setdefault(batch.split, defaultdict(float))
        acc["prompts"] += correct.shape[0]
        acc["avg"] += float(correct.mean(1).sum())
        acc["pass"] += float(correct.max(1).values.sum())
        acc["length"] += float(sampled.completion_mask.sum(1).view(-1, k).mean(1).sum())
        acc["truncated"] += float(sampled.truncated.float().view(-1, k).mean(1).sum())
        if self.greedy and episodes is not None:
            greedy_scores = episodes(rows, 1, True, None).rewards.float().cpu()
            acc["greedy"] += float((greedy_scores >= self.success_threshold).sum())
        elif self.greedy:
            greedy = policy.sample(prompts, 1, greedy=True)
            results = verifier(greedy.completions, batch.answers, batch.questions, batch.ids, batch.row_columns(),
                               token_lists(greedy.completion_ids, greedy.completion_mask))
            acc["greedy"] += sum(float(r.score >= self.success_threshold) for r in results)

    def metrics(self, step: int, log_summary: bool = True, stage: str = "val") -> dict[str, dict[str, float]]:
        """Per split, ``<stage>/<split>/avg@k``, ``pass@k``, ``completion_length``, ``truncated`` and ``greedy``, means
        over all ranks' prompts (each rank evaluated its share), and ``time_s``, the split's batches' time on the
        slowest rank; ``stage``: "val" (validation) or "test". Every rank must call it."""
        out = {}
        sums = sum_over_ranks(self.sums)
        # a split's time: its batches' on the slowest rank (the ranks evaluate their shares at once)
        seconds = max_over_ranks(self.seconds)
        for split, acc in sums.items():
            n = max(acc["prompts"], 1.0)
            means = [acc[name] / n for name in ("avg", "pass", "length", "truncated", *(["greedy"] if self.greedy else []))]
            metrics = dict(zip(self.metric_names([split], stage), [*means, seconds.get(split, 0.0)]))
            if log_summary:
                summary = ", ".join(f"{name.split('/')[-1]} {value:.3f}" for name, value in metrics.items())
                log.info("step %d %s [%s] on %d prompts: %s", step, "test" if stage == "test" else "validation",
                         split, int(n), summary)
            out[split] = metrics
        return out
