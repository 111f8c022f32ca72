"""Rollout generation, verification and DAPO's dynamic sampling, run before each training step."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback

from scgrpo.distributed import all_reduce
from scgrpo.errors import InputError
from scgrpo.guard import nonfinite_inputs
from scgrpo.oom import out_of_memory_as_error
from scgrpo.rollout.types import PromptBatch, RolloutBatch, token_lists
from scgrpo.step_log import phase_peak

log = logging.getLogger(__name__)


class RewardsFailed(InputError):
    """Every reward of ``max_reward_failure_steps`` steps in a row failed: the run stops with one line."""


def sample_rollouts(pl_module, batch: PromptBatch) -> RolloutBatch:
    """G completions of each prompt of ``batch`` under the current policy; with an environment, G episodes of each
    row instead, rewarded by the environment (no verifier runs)."""
    g = pl_module.generation.num_generations
    runner = getattr(pl_module, "episode_runner", None)
    if runner is not None:
        generated = runner.run(pl_module.actor, batch.rows(), g)
        questions = generated.questions  # each episode's first message
        extra = dict(env_mask=generated.env_mask, rewards=generated.rewards, infos=generated.infos)
    else:
        states = getattr(pl_module, "rollout_states", False)
        generated = pl_module.sample(pl_module.format_prompts(batch.questions), g, states=states)
        if states and getattr(generated, "states", None) is None and not getattr(pl_module, "_said_no_states", True):
            log.info("self-teacher: these rollouts carry no sampler states (the Hugging Face forward sampled them: "
                     "engine hf, a sharded policy, or a model or length the compact forward does not run); the "
                     "student's forward pass runs instead (generation.student_states)")
            pl_module._said_no_states = True
        questions, extra = [q for q in batch.questions for _ in range(g)], {}
    rollouts = RolloutBatch(
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
        **extra,
    )
    rollouts.stats.update(generated.stats)
    rollouts.stats["rollout/sampled"] = float(len(generated.completions))  # rollouts drawn (DAPO: summed over rounds)
    return rollouts


def verify_rollouts(pl_module, rollouts: RolloutBatch) -> None:
    """Sets ``rollouts.rewards`` and ``rollouts.infos`` with the run's verifier (failures score 0); episodes come
    rewarded by their environment and are left as they are."""
    if rollouts.rewards is not None:
        return
    results = pl_module.verifier_runner(rollouts.completions, rollouts.answers, rollouts.questions, rollouts.sample_ids,
                                        rollouts.columns, token_lists(rollouts.completion_ids, rollouts.completion_mask))
    rollouts.rewards = torch.tensor([r.score for r in results], dtype=torch.float32, device=pl_module.device)
    rollouts.infos = [r.info for r in results]


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


def check_reward_failures(pl_module, all_failed: bool, infos: Optional[list[dict]]) -> None:
    """Counts the steps in a row whose every reward failed; at ``max_reward_failure_steps`` of them the run ends
    with :class:`RewardsFailed` (before the step changes any weight)."""
    pl_module.reward_failure_steps = pl_module.reward_failure_steps + 1 if all_failed else 0
    limit = pl_module.max_reward_failure_steps
    if not limit or pl_module.reward_failure_steps < limit:
        return
    why = next((info["error"] for info in infos or [] if info.get("error")), "no reward")
    raise RewardsFailed(
        f"every reward of the last {pl_module.reward_failure_steps} steps failed (the first of this step: {why}); "
        f"the run is stopped before this step's update. Fix the {type(pl_module.verifier_runner.verifier).__name__} "
        "(model.verifier or model.reward_funcs) or raise model.max_reward_failure_steps (0: never stop)")


def concat_rollouts(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch from several: prompts re-padded on the left, completions on the right."""
    tp = max(p.prompt_ids.shape[1] for p in parts)
    c = max(p.completion_ids.shape[1] for p in parts)

    def left(x, width, value):
        return F.pad(x, (width - x.shape[1], 0), value=value)

    def right(x, width, value):
        return F.pad(x, (0, width - x.shape[1]), value=value)

    merged = RolloutBatch(
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
        rewards=torch.cat([p.rewards for p in parts]) if all(p.rewards is not None for p in parts) else None,
        infos=sum((p.infos or [{}] * len(p.completions) for p in parts), []),
        entropy_sum=torch.cat([p.entropy_sum for p in parts]) if all(p.entropy_sum is not None for p in parts) else None,
        sampler_logprobs=(torch.cat([right(p.sampler_logprobs, c, 0.0) for p in parts])
                          if all(p.sampler_logprobs is not None for p in parts) else None),
        env_mask=(torch.cat([right(p.env_mask, c, 0.0) for p in parts])
                  if all(p.env_mask is not None for p in parts) else None),
        columns=(sum((p.columns for p in parts), []) if all(p.columns is not None for p in parts) else None),
        student_states=(torch.cat([F.pad(p.student_states, (0, 0, 0, c - p.student_states.shape[1])) for p in parts])
                        if all(p.student_states is not None for p in parts) else None),
    )
    for p in parts:
        for key, value in p.stats.items():
            merged.stats[key] = merged.stats.get(key, 0.0) + value
    return merged


EPISODE_COUNTERS = ("episode/env_errors", "episode/env_timeouts", "episode/env_time_s")
"""Episode statistics that add up over DAPO's sampling rounds (the means are the first round's)"""


def mixed_groups(rollouts: RolloutBatch) -> torch.Tensor:
    """Row indices of the groups whose rewards are not all equal."""
    grouped = rollouts.rewards.view(-1, rollouts.group_size)
    keep = grouped.max(1).values != grouped.min(1).values  # [P]
    return torch.nonzero(keep.repeat_interleave(rollouts.group_size)).squeeze(1)


class RolloutCallback(Callback):
    """Samples G completions per prompt in ``on_train_batch_start`` (outside the training forward, eval mode,
    no grad, KV cache on) and attaches them to the batch as a :class:`RolloutBatch`. When the objective
    needs them it also scores the samples under the sampling policy and the reference (``needs_old_logprobs``,
    ``needs_ref_logprobs``: mu > 1, a KL term or a KL-shaped reward)."""

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        stats: dict = {}
        phase_peak(stats, pl_module.device, "before")  # starts the sampling phase's peak
        start = time.perf_counter()
        with out_of_memory_as_error("rollout", pl_module):
            rollouts = sample_rollouts(pl_module, batch)
            pl_module.actor.sync()
        rollouts.stats["time/generation_s"] = time.perf_counter() - start
        phase_peak(rollouts.stats, pl_module.device, "rollout")
        batch.rollouts = rollouts


class VerificationCallback(Callback):
    """Scores each rollout with the run's verifier (failures of the verifier give 0 and are counted), and
    after the step stores the verified rollouts in the data module's verified-trajectory buffer, so the
    self-teacher of later steps can be shown them. Runs after :class:`RolloutCallback`."""

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        rollouts = batch.rollouts
        if rollouts is None:
            raise RuntimeError("VerificationCallback found no rollouts: RolloutCallback must run before it")
        start = time.perf_counter()
        runner = pl_module.verifier_runner
        errors, timeouts = runner.errors, runner.timeouts
        per_function = getattr(runner.verifier, "failed_rows", None)
        before = dict(per_function) if per_function is not None else None
        verified = rollouts.rewards is None  # (episodes come rewarded by their environment)
        verify_rollouts(pl_module, rollouts)
        rollouts.stats["time/verification_s"] = time.perf_counter() - start
        rollouts.stats["verifier/errors"] = float(runner.errors - errors)
        rollouts.stats["verifier/timeouts"] = float(runner.timeouts - timeouts)
        failed_rows = {k: v - before[k] for k, v in per_function.items()} if before is not None else None
        rollouts.stats.update(reward_metrics(runner.verifier, rollouts.infos, failed_rows))
        failed = sum(1 for info in rollouts.infos or [] if info.get("error")) if verified else 0
        failed, rows = all_reduce([float(failed), float(len(rollouts.completions))], "sum", pl_module.device)
        check_reward_failures(pl_module, failed >= rows > 0, rollouts.infos)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: PromptBatch, batch_idx: int) -> None:
        buffer = getattr(getattr(trainer, "datamodule", None), "verified_buffer", None)
        rollouts = batch.rollouts
        if buffer is None or rollouts is None or rollouts.rewards is None:
            return
        if getattr(pl_module, "last_step_skipped", False):  # sampled from non-finite logits: not the policy's own
            return
        for i, reward in enumerate(rollouts.rewards.tolist()):
            if reward >= pl_module.success_threshold:
                tokens = rollouts.completion_ids[i][rollouts.completion_mask[i].bool()].tolist()
                buffer.add(rollouts.sample_ids[i], tokens, rollouts.completions[i], reward, trainer.global_step)


class DynamicSamplingCallback(Callback):
    """DAPO's dynamic sampling: drops the groups whose rewards are all equal and samples more prompts until
    the batch again holds as many groups as it started with, for at most ``objective.max_sampling_rounds``
    extra rounds. Logs ``dapo/extra_rounds`` and ``dapo/kept_groups``. Runs after verification and only for
    objectives with ``dynamic_sampling``.

    A step stopped by an exception (Ctrl-C, the GPU out of memory) puts the extra prompts' stream back where it
    stood at the step's start, so the checkpoint written on the exception holds the last whole step's position."""

    def __init__(self) -> None:
        self._extra_consumed: Optional[int] = None  # the extra stream's position at the start of the step under way

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        self._extra_consumed = getattr(getattr(trainer, "datamodule", None), "extra_consumed", None)
        objective = pl_module.objective
        if not getattr(objective, "dynamic_sampling", False) or batch.rollouts is None:
            return
        diverged = float(nonfinite_inputs(batch.rollouts) is not None)
        if all_reduce([diverged], "max", pl_module.device)[0] > 0:  # on any rank: all ranks sample as many rounds
            return  # a diverged sampler's groups all look alike: keep them for the module's guard to see and skip
        target = batch.rollouts.num_groups
        kept = [batch.rollouts.select(mixed_groups(batch.rollouts))]
        kept[0].stats = dict(batch.rollouts.stats)
        have, rounds = kept[0].num_groups, 0
        datamodule = getattr(trainer, "datamodule", None)
        can_sample = hasattr(datamodule, "extra_batch")

        def more_needed() -> bool:  # sharded generation gathers weights: ranks sample the same number of rounds
            return all_reduce([float(have < target and can_sample)], "max", pl_module.device)[0] > 0

        while rounds < objective.max_sampling_rounds and more_needed():
            rounds += 1
            start = time.perf_counter()
            with out_of_memory_as_error("rollout", pl_module):
                extra = sample_rollouts(pl_module, datamodule.extra_batch())
            verify_rollouts(pl_module, extra)
            sampled = extra.stats["rollout/sampled"]
            counted = {k: v for k, v in extra.stats.items() if k in EPISODE_COUNTERS}  # faults of every round
            extra = extra.select(mixed_groups(extra)[: max(target - have, 0) * extra.group_size])
            extra.stats = {"time/generation_s": time.perf_counter() - start, "rollout/sampled": sampled, **counted}
            kept.append(extra)
            have += extra.num_groups
        batch.rollouts = concat_rollouts(kept, pl_module.tokenizer.pad_token_id) if len(kept) > 1 else kept[0]
        batch.rollouts.stats["dapo/extra_rounds"] = float(rounds)
        batch.rollouts.stats["dapo/kept_groups"] = float(have)
        if have < target:
            log.debug("dynamic sampling stopped at %d of %d groups after %d extra rounds", have, target, rounds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: PromptBatch, batch_idx: int) -> None:
        self._extra_consumed = None  # (the step is done)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # before StepCheckpoint's on_exception writes last.ckpt (Lightning runs checkpoint callbacks last)
        datamodule = getattr(trainer, "datamodule", None)
        if self._extra_consumed is not None and hasattr(datamodule, "extra_consumed"):
            datamodule.extra_consumed = self._extra_consumed
            self._extra_consumed = None
