"""The rollout stage: a step's rollouts, from its prompts to their rewards. :meth:`RolloutStage.collect` samples G
completions (or, with an environment, G episodes) of each prompt, scores them with the run's verifier, resamples
DAPO's equal-reward groups and counts the steps whose every reward failed, and returns a :class:`RolloutBatch`
with its :class:`RolloutStats`. :class:`~scgrpo.callbacks.RolloutCallback` runs it before each training step."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable, ContextManager, Optional, Union

import torch
import torch.nn.functional as F

from scgrpo.budget import PeakTracker
from scgrpo.distributed import all_reduce
from scgrpo.envs.base import EpisodeSettings
from scgrpo.errors import InputError
from scgrpo.guard import nonfinite_inputs
from scgrpo.objectives.functional import group_mixed
from scgrpo.rollout.types import PromptBatch, RolloutBatch, RolloutStats, has_no_reward, token_lists
from scgrpo.selfteacher import keeps_sampler_states
from scgrpo.step_log import phase_peak

log = logging.getLogger(__name__)

EPISODE_COUNTERS = ("episode/env_errors", "episode/env_timeouts", "episode/env_time_s")
"""Episode statistics that add up over DAPO's sampling rounds (the means are the first round's)"""


class RewardsFailed(InputError):
    """Every reward of ``max_reward_failure_steps`` steps in a row failed: the run stops with one line."""


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts sampled, for at most
    ``max_rounds`` extra rounds, until the batch holds as many groups as it started with."""

    max_rounds: int


class RolloutStage:
    """A step's rollouts, sampled and verified.

    Args:
        policy: the :class:`~scgrpo.policy.Policy` that samples (``format_prompts``, ``sample``, ``sync``,
            ``tokenizer``).
        num_generations: G, the rollouts of each prompt.
        verifier_runner: scores single completions (:class:`~scgrpo.verifiers.VerifierRunner`).
        episode_runner: with an environment, plays episodes in place of single completions; the environment
            rewards them and the verifier does not run.
        dynamic_sampling: DAPO's resampling of equal-reward groups (None: off).
        max_reward_failure_steps: :meth:`collect` raises :class:`RewardsFailed` at this many steps in a row whose
            every reward failed (0: never).
        states: keep the sampler's final hidden states (the self-teacher's student side) where the engine has them (a
            function: asked at each rollout).
        device: where the rewards go; the ranks' counts are reduced over it.
        peaks: the rollout phase's memory peak is read from it (the run's memory budget's :attr:`peaks`).
        guard: a context each round's sampling runs in (the run's: a GPU out of memory as one error of the rollout
            phase).
        on_fault: ``"exclude"``: a rollout without a reward (its environment raised, hung or returned junk; every
            reward function failed on it, or the verifier raised) leaves its group's statistics and the loss
            (:attr:`RolloutBatch.excluded`), and a group left with fewer than 2 rollouts is skipped; ``"zero"``: it
            is trained on with reward 0.
    """

    def __init__(self, policy, num_generations: int, verifier_runner, episode_runner=None,
                 dynamic_sampling: Optional[DynamicSampling] = None, max_reward_failure_steps: int = 3,
                 states: Union[bool, Callable[[], bool]] = False, device: torch.device = torch.device("cpu"),
                 peaks: Optional[PeakTracker] = None,
                 guard: Callable[[], ContextManager] = contextlib.nullcontext, on_fault: str = "exclude") -> None:
        self.on_fault = EpisodeSettings(on_fault=on_fault).on_fault  # (checks the value)
        self.policy, self.num_generations, self.verifier_runner = policy, num_generations, verifier_runner
        self.episode_runner, self.dynamic_sampling, self._states = episode_runner, dynamic_sampling, states
        self.guard = guard  # around each round's sampling: the run's out-of-memory error for the rollout phase
        self.max_reward_failure_steps, self.device = max_reward_failure_steps, device
        self.peaks = peaks if peaks is not None else PeakTracker()  # (the memory budget's, in a run)
        self.reward_failure_steps = 0  # steps in a row up to now whose every reward failed
        self._said_no_states = False  # (the missing sampler states were logged)

    @classmethod
    def for_run(cls, policy, generation, verifier_runner, episode_runner, objective, max_reward_failure_steps: int,
                device: torch.device, peaks: Optional[PeakTracker] = None,
                guard: Callable[[], ContextManager] = contextlib.nullcontext,
                on_fault: str = "exclude") -> "RolloutStage":
        """The stage of a run: G from ``generation``, dynamic sampling where the ``objective`` resamples, the
        sampler's states kept where its self-teacher reads them (:func:`~scgrpo.selfteacher.keeps_sampler_states`)."""
        needs = objective.needs
        dapo = DynamicSampling(needs.resample_rounds) if needs.resample_rounds is not None else None

        def states() -> bool:  # (asked at each rollout: the policy's pass options may change after setup)
            return keeps_sampler_states(objective.needs.teacher, generation, device, episode_runner is not None,
                                        policy.passes.shared_teacher_passes)

        return cls(policy, generation.num_generations, verifier_runner, episode_runner, dapo, max_reward_failure_steps,
                   states, device, peaks, guard, on_fault)

    @property
    def states(self) -> bool:
        """Whether this rollout keeps the sampler's final hidden states."""
        return self._states() if callable(self._states) else self._states

    def collect(self, batch: PromptBatch, more: Optional[Callable[[], PromptBatch]] = None) -> RolloutBatch:
        """The rollouts of ``batch``, verified; under dynamic sampling, ``more()`` gives each extra round's prompts
        (None: no extra rounds). Raises :class:`RewardsFailed` when every reward has failed too many steps in a row."""
        phase_peak({}, self.peaks, self.device, "before")  # starts the rollout phase's peak
        start = time.perf_counter()
        with self.guard():
            rollouts = self.sample(batch)
            self.policy.sync()
        generation_s = time.perf_counter() - start
        phase_peak(rollouts.stats.memory, self.peaks, self.device, "rollout")
        stats, failed = self.verify(rollouts)
        rollouts.stats = dataclasses.replace(stats, generation_s=generation_s)
        self.count_reward_failures(failed, rollouts.infos)
        if self.dynamic_sampling is not None:
            rollouts = self.resample_equal_groups(rollouts, more)
        phase_peak(rollouts.stats.memory, self.peaks, self.device, "rollout")  # (verification, extra rounds)
        return rollouts

    def sample(self, batch: PromptBatch) -> RolloutBatch:
        """G completions of each prompt of ``batch`` under the current policy; with an environment, G episodes of
        each row instead, rewarded by the environment."""
        g = self.num_generations
        if self.episode_runner is not None:
            generated = self.episode_runner.run(self.policy, batch.rows(), g)
            questions = generated.questions  # each episode's first message
            extra = dict(env_mask=generated.env_mask, rewards=generated.rewards, infos=generated.infos,
                         turn_rewards=getattr(generated, "turn_rewards", None),
                         turn_index=getattr(generated, "turn_index", None))
        else:
            states = self.states
            generated = self.policy.sample(self.policy.format_prompts(batch.questions), g, states=states)
            if states and getattr(generated, "states", None) is None and not self._said_no_states:
                log.info("self-teacher: these rollouts carry no sampler states (the Hugging Face forward sampled "
                         "them: engine hf, a sharded policy, or a model or length the compact forward does not run); "
                         "the student's forward pass runs instead (generation.student_states)")
                self._said_no_states = True
            questions, extra = [q for q in batch.questions for _ in range(g)], {}
        return RolloutBatch(
            prompt_ids=generated.prompt_ids,
            prompt_mask=generated.prompt_mask,
            completion_ids=generated.completion_ids,
            completion_mask=generated.completion_mask,
            truncated=generated.truncated,
            group_size=g,
            sample_ids=[i for i in batch.ids for _ in range(g)],
            questions=questions,
            answers=[a for a in batch.answers for _ in range(g)],
            columns=[c for c in batch.row_columns() for _ in range(g)],
            completions=generated.completions,
            entropy_sum=generated.entropy_sum,
            sampler_logprobs=generated.sampler_logprobs,
            student_states=getattr(generated, "states", None),
            stats=RolloutStats(sampled=float(len(generated.completions)), sampler=dict(generated.stats)),
            **extra,
        )

    def score(self, rollouts: RolloutBatch) -> None:
        """Sets ``rollouts.rewards`` and ``infos`` with the run's verifier (its failures score 0); episodes come
        rewarded by their environment. With ``on_fault: exclude``, marks the rows without a reward
        (:attr:`RolloutBatch.excluded`)."""
        if rollouts.rewards is None:
            results = self.verifier_runner(rollouts.completions, rollouts.answers, rollouts.questions,
                                           rollouts.sample_ids, rollouts.columns,
                                           token_lists(rollouts.completion_ids, rollouts.completion_mask))
            rollouts.rewards = torch.tensor([r.score for r in results], dtype=torch.float32, device=self.device)
            rollouts.infos = [r.info for r in results]
        if self.on_fault == "exclude":
            rollouts.excluded = excluded_rows(rollouts.infos, rollouts.group_size, rollouts.rewards.device)

    def verify(self, rollouts: RolloutBatch) -> tuple[RolloutStats, bool]:
        """Scores ``rollouts`` (:meth:`score`); returns their stats with the verification's, and whether every
        reward of the step failed, on all ranks."""
        start = time.perf_counter()
        runner = self.verifier_runner
        errors, timeouts = runner.errors, runner.timeouts
        per_function = getattr(runner.verifier, "failed_rows", None)
        before = dict(per_function) if per_function is not None else None
        self.score(rollouts)
        failed_rows = {k: v - before[k] for k, v in per_function.items()} if before is not None else None
        stats = dataclasses.replace(
            rollouts.stats, verification_s=time.perf_counter() - start, verifier_errors=float(runner.errors - errors),
            verifier_timeouts=float(runner.timeouts - timeouts),
            rewards=reward_metrics(runner.verifier, rollouts.infos, failed_rows), **exclusion_stats(rollouts))
        failed = sum(has_no_reward(info) for info in rollouts.infos or [])  # (an episode's fault, a verifier's)
        failed, rows = all_reduce([float(failed), float(len(rollouts.completions))], "sum", self.device)
        return stats, failed >= rows > 0

    def count_reward_failures(self, all_failed: bool, infos: Optional[list[dict]]) -> None:
        """Counts the steps in a row whose every reward failed; at ``max_reward_failure_steps`` of them raises
        :class:`RewardsFailed` (before the step changes any weight)."""
        self.reward_failure_steps = self.reward_failure_steps + 1 if all_failed else 0
        limit = self.max_reward_failure_steps
        if not limit or self.reward_failure_steps < limit:
            return
        why = next((info.get("error") or _episode_fault(info) for info in infos or [] if has_no_reward(info)),
                   "no reward")
        if self.episode_runner is not None:
            culprit = f"{type(self.episode_runner.environment).__name__} (model.environment)"
        else:
            culprit = f"{type(self.verifier_runner.verifier).__name__} (model.verifier or model.reward_funcs)"
        raise RewardsFailed(
            f"every reward of the last {self.reward_failure_steps} steps failed (the first of this step: {why}); "
            f"the run is stopped before this step's update. Fix the {culprit} or raise "
            "model.max_reward_failure_steps (0: never stop)")

    def resample_equal_groups(self, rollouts: RolloutBatch, more: Optional[Callable[[], PromptBatch]]) -> RolloutBatch:
        """DAPO's dynamic sampling: the mixed groups of ``rollouts``, topped up with those of extra rounds (logs
        ``dapo/extra_rounds`` and ``dapo/kept_groups``)."""
        diverged = float(nonfinite_inputs(rollouts) is not None)
        if all_reduce([diverged], "max", self.device)[0] > 0:  # on any rank: all ranks sample as many rounds
            return rollouts  # a diverged sampler's groups all look alike: kept for the guard to see and skip
        target = rollouts.num_groups
        kept = [rollouts.select(mixed_groups(rollouts))]
        kept[0].stats = rollouts.stats
        have, rounds = kept[0].num_groups, 0

        def more_needed() -> bool:  # sharded generation gathers weights: ranks sample the same number of rounds
            return all_reduce([float(have < target and more is not None)], "max", self.device)[0] > 0

        while rounds < self.dynamic_sampling.max_rounds and more_needed():
            rounds += 1
            start = time.perf_counter()
            with self.guard():
                extra = self.sample(more())
            self.score(extra)
            counted = {k: v for k, v in extra.stats.sampler.items() if k in EPISODE_COUNTERS}  # every round's faults
            sampled = extra.stats.sampled
            extra = extra.select(mixed_groups(extra)[: max(target - have, 0) * extra.group_size])
            extra.stats = RolloutStats(sampled=sampled, generation_s=time.perf_counter() - start, sampler=counted)
            kept.append(extra)
            have += extra.num_groups
        merged = concat_rollouts(kept, self.policy.tokenizer.pad_token_id) if len(kept) > 1 else kept[0]
        merged.stats = dataclasses.replace(merged.stats, extra_rounds=float(rounds), kept_groups=float(have),
                                           **exclusion_stats(merged))  # (those of the batch trained on)
        if have < target:
            log.debug("dynamic sampling stopped at %d of %d groups after %d extra rounds", have, target, rounds)
        return merged

    def verified_rows(self, rollouts: RolloutBatch, success_threshold: float) -> list[tuple[str, list[int], str, float]]:
        """(prompt id, completion tokens, text, reward) of each rollout at or above ``success_threshold``: what the
        verified-trajectory buffer stores after the step."""
        rows, infos = [], rollouts.infos or [{}] * len(rollouts.completions)
        for i, reward in enumerate(rollouts.rewards.tolist()):
            if reward >= success_threshold and not has_no_reward(infos[i]):  # (a fault's 0 is no reward)
                tokens = rollouts.completion_ids[i][rollouts.completion_mask[i].bool()].tolist()
                rows.append((rollouts.sample_ids[i], tokens, rollouts.completions[i], reward))
        return rows


def verified_rollouts(batch: PromptBatch) -> RolloutBatch:
    """The batch's rollouts, sampled and verified by the rollout stage before the step."""
    rollouts = batch.rollouts
    if rollouts is None or rollouts.rewards is None:
        raise RuntimeError("the batch has no verified rollouts; RolloutCallback must run before the training step")
    return rollouts


def reward_metrics(verifier, infos: Optional[list[dict]], failed_rows: Optional[dict[str, int]] = None) -> dict[str, float]:
    """``reward/<name>/mean`` and ``/std`` of each named part of ``verifier`` (a :class:`RewardFunctions`' functions,
    a :class:`WeightedVerifier`'s verifiers: its ``names``) over the rows it scored (NaN where none), and, from
    ``failed_rows``, ``reward/<name>/errors``: the rows each function raised or timed out on. Nothing for other
    verifiers. Under DAPO's dynamic sampling, those of the first round (as ``verifier/errors``)."""
    names = getattr(verifier, "names", None)
    if not names:
        return {}
    out = {}
    for name in names:
        values = torch.tensor([info["rewards"][name] for info in infos or []
                               if (info.get("rewards") or {}).get(name) is not None], dtype=torch.float64)
        out[f"reward/{name}/mean"] = float(values.mean()) if len(values) else float("nan")
        out[f"reward/{name}/std"] = float(values.std(unbiased=False)) if len(values) else float("nan")
        if failed_rows is not None:
            out[f"reward/{name}/errors"] = float(failed_rows.get(name, 0))
    return out


def _episode_fault(info: dict) -> str:
    errors = [step["env_error"] for step in info.get("env", []) if isinstance(step, dict) and "env_error" in step]
    return errors[0] if errors else str(info.get("fault"))


def excluded_rows(infos: Optional[list[dict]], group_size: int, device: torch.device) -> torch.Tensor:
    """``[N]`` bool: the rows without a reward (:func:`has_no_reward`), and every row of a group left with fewer than
    2."""
    faults = torch.tensor([has_no_reward(info) for info in infos or []], dtype=torch.bool, device=device)
    if not len(faults):
        return faults
    kept = (~faults).view(-1, group_size).sum(1) >= 2  # [P]
    return faults | ~kept.repeat_interleave(group_size)


def exclusion_stats(rollouts: RolloutBatch) -> dict[str, float]:
    """``excluded`` (rows without a reward) and ``skipped_groups`` (groups left with fewer than 2 rows) of a scored
    batch, for :class:`RolloutStats`; nothing when faults are not excluded."""
    if rollouts.excluded is None:
        return {}
    faults = sum(has_no_reward(info) for info in rollouts.infos or [])
    skipped = rollouts.excluded.view(-1, rollouts.group_size).all(1).sum()
    return {"excluded": float(faults), "skipped_groups": float(skipped)}


def mixed_groups(rollouts: RolloutBatch) -> torch.Tensor:
    """Row indices of the groups whose rewards are not all equal (over the rows with a reward)."""
    keep = group_mixed(rollouts.rewards, rollouts.group_size, rollouts.valid)  # [P]
    return torch.nonzero(keep.repeat_interleave(rollouts.group_size)).squeeze(1)


def concat_rollouts(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch from several: prompts re-padded on the left, completions on the right; stats added up
    (:meth:`RolloutStats.plus`)."""
    tp = max(p.prompt_ids.shape[1] for p in parts)
    c = max(p.completion_ids.shape[1] for p in parts)

    def left(x, width, value):
        return F.pad(x, (width - x.shape[1], 0), value=value)

    def right(x, width, value):
        return F.pad(x, (0, width - x.shape[1]), value=value)

    def cat(name, pad=None):
        values = [getattr(p, name) for p in parts]
        if any(v is None for v in values):
            return None
        return torch.cat(values if pad is None else [pad(v) for v in values])

    stats = parts[0].stats
    for p in parts[1:]:
        stats = stats.plus(p.stats)
    return RolloutBatch(
        prompt_ids=torch.cat([left(p.prompt_ids, tp, pad_id) for p in parts]),
        prompt_mask=torch.cat([left(p.prompt_mask, tp, 0) for p in parts]),
        completion_ids=torch.cat([right(p.completion_ids, c, pad_id) for p in parts]),
        completion_mask=torch.cat([right(p.completion_mask, c, 0.0) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        group_size=parts[0].group_size,
        sample_ids=sum((p.sample_ids for p in parts), []),
        questions=sum((p.questions for p in parts), []),
        answers=sum((p.answers for p in parts), []),
        completions=sum((p.completions for p in parts), []),
        rewards=cat("rewards"),
        infos=sum((p.infos or [{}] * len(p.completions) for p in parts), []),
        entropy_sum=cat("entropy_sum"),
        sampler_logprobs=cat("sampler_logprobs", lambda x: right(x, c, 0.0)),
        env_mask=cat("env_mask", lambda x: right(x, c, 0.0)),
        columns=(sum((p.columns for p in parts), []) if all(p.columns is not None for p in parts) else None),
        student_states=cat("student_states", lambda x: F.pad(x, (0, 0, 0, c - x.shape[1]))),
        excluded=cat("excluded"),
        turn_rewards=cat("turn_rewards"),
        turn_index=cat("turn_index", lambda x: right(x, c, -1)),
        stats=stats,
    )


def completion_lengths(episode_runner, max_new_tokens: int) -> tuple[int, int]:
    """(the longest completion a rollout may have, the positions after its first prompt that sampling may fill): with
    episodes (``episode_runner``), the episode's token budget and that plus a turn (the last turn may sample past the
    budget before it is cut); else ``max_new_tokens`` twice."""
    if episode_runner is None:
        return max_new_tokens, max_new_tokens
    budget = episode_runner.settings.max_episode_tokens
    return budget, budget + max_new_tokens


def check_reward_failure_steps(limit: int) -> None:
    if limit < 0:
        raise ValueError(f"max_reward_failure_steps must be >= 0 (0 = never stop), got {limit}")


def run_environment(environment, datamodule):
    """The run's environment: ``environment`` (``model.environment``), else the data source's own, else None."""
    source = getattr(datamodule, "source", None)
    if environment is None and callable(getattr(source, "default_environment", None)):
        return source.default_environment()
    return environment


def run_verifier(verifier, datamodule, environment: Optional[str], privileged: bool):
    """The run's verifier, ``verifier`` or the data module's default, once it is known to fit the data: a verifier
    that scores against answers (or a teacher shown them: ``privileged``) needs an answer column; reward functions
    score single completions and their arguments' names are not the dataset's columns. Episodes (in the environment
    named ``environment``; None: single completions) are rewarded by their environment, not by the verifier."""
    from scgrpo.verifiers import RewardFunctions

    if verifier is None:
        if datamodule is None or not hasattr(datamodule, "default_verifier"):
            raise ValueError("no verifier given and the data module offers no default; set model.verifier")
        verifier = datamodule.default_verifier()
    episodes = environment is not None
    if episodes and isinstance(verifier, RewardFunctions):
        raise InputError(f"model.reward_funcs score single completions, and this run's rollouts are episodes in "
                         f"{environment}, which rewards them itself; drop reward_funcs, or score in the environment's "
                         "step")
    source = getattr(datamodule, "source", None)
    if source is None:
        return verifier
    if (getattr(verifier, "needs_answers", True) and not episodes) or privileged:
        no_answers = source.answer_fault() if hasattr(source, "answer_fault") else None
        if no_answers:
            reader = "the objective's teacher reads them" if privileged else f"{type(verifier).__name__} scores against them"
            raise InputError(f"{no_answers} ({reader})")
    if isinstance(verifier, RewardFunctions):
        rows = source.rows(source.splits()[0])
        verifier.check_columns(rows[0].get("columns", {}) if rows else {})
    return verifier
