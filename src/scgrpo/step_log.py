"""The names and values of a training step's metrics (``train/*``, ``policy/*``, ``tokens/*``, ``time/*``,
``memory/*``, and the objective's, teacher's and rollouts' own), reduced over ranks.

Every key is logged on every step, NaN where undefined that step: Lightning's loggers would otherwise repeat
a stale value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from scgrpo.budget import PeakTracker
from scgrpo.distributed import all_reduce, mean_over_ranks
from scgrpo.objectives.functional import group_mixed, masked_mean
from scgrpo.rollout.types import RolloutBatch, RolloutStats
from scgrpo.update import StepPlan, StepSums

NAN = float("nan")


def phase_peak(peaks: dict[str, float], tracker: PeakTracker, device: torch.device, name: str) -> None:
    """On a GPU, records the peak memory allocated since the last call (GiB, from ``tracker``) as ``peaks[name]``
    (logged as ``memory/<name>_peak_gib``) and starts a new phase (the peaks of sampling, teacher pass and update are
    logged apart)."""
    if device.type == "cuda":
        peaks[name] = max(peaks.get(name, 0.0), tracker.phase_peak(device) / 2**30)


@dataclass
class StepPhases:
    """The phases of a training step after its rollout: the scoring pass's time and, on a GPU, each phase's peak
    allocated memory and the memory budget's choices."""

    device: torch.device
    tracker: PeakTracker = field(default_factory=PeakTracker)
    """The peaks across the passes a memory budget measured (the budget's own: :attr:`MemoryBudget.peaks`)"""
    scoring_s: Optional[float] = None
    """Seconds of the scoring pass (``time/scoring_s``; None: the objective needs none)"""
    train_s: float = 0.0
    """Seconds of the credit and the update (``time/train_s``, which :func:`step_metrics` logs)"""
    peaks: dict[str, float] = field(default_factory=dict)
    """GiB at each phase's peak (``memory/<phase>_peak_gib``)"""
    budget: dict[str, float] = field(default_factory=dict)
    """The memory budget's choices this step (``memory/*``; empty without an active budget)"""

    def peak(self, name: str) -> None:
        phase_peak(self.peaks, self.tracker, self.device, name)

    def note_budget(self, budget) -> None:
        """With an active memory budget (a GPU), its choices this step; its description is logged once."""
        if budget.active:
            self.budget = budget.metrics()
            budget.log_once()

    def metrics(self, rollout: RolloutStats) -> dict[str, float]:
        """The step's phase metrics, and with a budget the largest peak of every phase, ``rollout``'s included
        (``memory/peak_allocated_gib``)."""
        metrics = {} if self.scoring_s is None else {"time/scoring_s": self.scoring_s}
        metrics.update({f"memory/{name}_peak_gib": gib for name, gib in self.peaks.items()})
        if self.budget:
            metrics.update(self.budget)
            metrics["memory/peak_allocated_gib"] = max([*rollout.memory.values(), *self.peaks.values()], default=NAN)
        return metrics


def rewarded(rollouts: RolloutBatch, values: Tensor) -> Tensor:
    """``values`` (``[N]``) of the rows with a reward (all of them, unless faults are excluded: a fault's 0 is no
    reward): the logged reward, accuracy and their spread are theirs (NaN on a step where no row has one)."""
    held = rollouts.rewarded()
    return values if held is None else values[held]


def _local_metrics(rollouts: RolloutBatch, plan: StepPlan, sums: StepSums, passes: int, success_threshold: float,
                   train_time: float, nonfinite_skips: int) -> dict:
    """This rank's rewards, lengths, credit and the step's sums (means over the ``passes`` optimisation passes)."""
    mask, rewards, rows = rollouts.completion_mask, plan.rewards, plan.rows
    raw, shaped = rewarded(rollouts, rollouts.rewards), rewarded(rollouts, rewards)  # (the rows with a reward)
    metrics = {
        "train/loss": sums["loss"] / passes,
        "train/reward": raw.mean(),
        "train/shaped_reward": shaped.mean(),
        "train/reward_std": shaped.std() if shaped.numel() > 1 else torch.tensor(0.0),
        "train/accuracy": (raw >= success_threshold).float().mean(),
        "train/mixed_groups": group_mixed(rewards, rollouts.group_size, rollouts.valid).float().mean(),
        "train/completion_length": mask.sum(1).mean(),
        "train/truncated": rollouts.truncated.float().mean(),
        "train/rows_in_loss": float(len(rows)) / max(len(rewards), 1),
        "train/advantage_abs": (plan.credit.advantages.abs().mean() if plan.credit.token_advantages is None
                                else masked_mean(plan.credit.token_advantages.abs(), mask)),
        "train/nonfinite_skips": float(nonfinite_skips),
        "time/train_s": train_time,
        # mean token entropy of the sampled responses, from the sampler (NaN where the engine gives none)
        "policy/entropy": (float(rollouts.entropy_sum.sum()) / max(float(mask.sum()), 1.0)
                           if rollouts.entropy_sum is not None else NAN),
    }
    metrics["train/clip_fraction"] = sums.get("clip_fraction", 0.0) / passes if len(rows) else NAN
    metrics["train/entropy"] = sums["entropy"] / passes if len(rows) else NAN
    metrics["train/grad_norm"] = sums["grad_norm"] / passes if "grad_norm" in sums else NAN
    return metrics


def step_metrics(rollouts: RolloutBatch, plan: StepPlan, sums: StepSums, mismatch: dict[str, float], *,
                 passes: int, success_threshold: float, log_kl: bool, train_time: float, nonfinite_skips: int,
                 lr: float, phases: Optional[StepPhases] = None, device: Optional[torch.device] = None,
                 ) -> dict[str, float]:
    """The step's metrics over the global batch: means over ranks, the largest rank's memory peaks, and
    ``mismatch`` (already global); ``train/kl`` every step when ``log_kl`` (the objective has a KL to the reference:
    NaN on a step whose loss reported none). Every rank must call it (it reduces over ranks)."""
    metrics = _local_metrics(rollouts, plan, sums, passes, success_threshold, train_time, nonfinite_skips)
    if log_kl or "kl" in sums:  # GRPO's KL term, REINFORCE++'s reward's
        metrics["train/kl"] = sums["kl"] / passes if "kl" in sums else NAN
    metrics.update({f"train/{name}": value / passes for name, value in sums.objective_stats().items()})
    for stats in (plan.signal.stats if plan.signal is not None else None, plan.credit.stats):
        if stats is not None:  # typed (metrics()) or, from a custom objective, a dict of logged names
            metrics.update(stats.metrics() if hasattr(stats, "metrics") else stats)
    metrics.update(rollouts.stats.metrics())
    metrics.update(phases.metrics(rollouts.stats) if phases is not None else {})
    metrics["tokens/completion"] = float(rollouts.completion_mask.sum())  # sampled tokens (without padding)
    metrics["tokens/train"] = float(len(plan.rows) * rollouts.input_ids.shape[1])  # rows in the loss x padded length
    metrics["time/step_s"] = sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/step_s")
    metrics["train/lr"] = lr
    memory = {k: float(v) for k, v in metrics.items() if k.startswith("memory/")}
    metrics = mean_over_ranks({k: float(v) for k, v in metrics.items()})  # rewards etc. of the global batch
    if memory:  # peaks: the largest rank's
        metrics.update(zip(memory, all_reduce(list(memory.values()), "max", device)))
    metrics.update(mismatch)
    return metrics


def skipped_step_metrics(rollouts: RolloutBatch, last_keys: list[str], *, success_threshold: float,
                         train_time: float, nonfinite_skips: int, lr: float,
                         phases: Optional[StepPhases] = None) -> dict[str, float]:
    """The metrics of a step skipped before its loss (non-finite sampling): rewards, the rollouts' own
    statistics and the skip count, and every other key of the last logged step (``last_keys``) as NaN. Every
    rank must call it."""
    metrics = {k: NAN for k in last_keys}
    metrics.update(rollouts.stats.metrics())
    metrics.update(phases.metrics(rollouts.stats) if phases is not None else {})
    raw = rewarded(rollouts, rollouts.rewards)
    metrics.update({
        "train/reward": float(raw.mean()),
        "train/accuracy": float((raw >= success_threshold).float().mean()),
        "train/nonfinite_skips": float(nonfinite_skips),
        "train/lr": lr,
        "time/train_s": train_time,
    })
    return mean_over_ranks(metrics)
