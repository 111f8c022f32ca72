"""Rollout generation and verification, run before each training step."""

from __future__ import annotations

import time


import torch
from lightning.pytorch import Callback

from scgrpo.rollout.engine import generate
from scgrpo.rollout.types import PromptBatch, RolloutBatch


class RolloutCallback(Callback):
    """Samples G completions per prompt in ``on_train_batch_start`` (outside the training forward, eval mode,
    no grad, KV cache on) and attaches them to the batch as a :class:`RolloutBatch`. When the objective
    needs them it also scores the samples under the sampling policy (mu > 1) and the reference (beta > 0)."""

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        start = time.perf_counter()
        settings = pl_module.generation
        generated = generate(
            pl_module.policy,
            pl_module.tokenizer,
            pl_module.format_prompts(batch.questions),
            settings.num_generations,
            settings,
            pl_module.device,
        )
        g = settings.num_generations
        rollouts = RolloutBatch(
            prompt_ids=generated.prompt_ids,
            prompt_mask=generated.prompt_mask,
            completion_ids=generated.completion_ids,
            completion_mask=generated.completion_mask,
            truncated=generated.truncated,
            group_size=g,
            sample_ids=[i for i in batch.ids for _ in range(g)],
            questions=[q for q in batch.questions for _ in range(g)],
            answers=[a for a in batch.answers for _ in range(g)],
            completions=generated.completions,
        )
        rollouts.stats["time/generation_s"] = time.perf_counter() - start
        start = time.perf_counter()
        pl_module.score_rollouts(rollouts)
        rollouts.stats["time/scoring_s"] = time.perf_counter() - start
        batch.rollouts = rollouts


class VerificationCallback(Callback):
    """Scores each rollout with the run's verifier (``reward``); failures of the verifier give 0 and are
    counted. Runs after :class:`RolloutCallback`."""

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        rollouts = batch.rollouts
        if rollouts is None:
            raise RuntimeError("VerificationCallback found no rollouts: RolloutCallback must run before it")
        start = time.perf_counter()
        runner = pl_module.verifier_runner
        errors, timeouts = runner.errors, runner.timeouts
        results = runner(rollouts.completions, rollouts.answers, rollouts.questions, rollouts.sample_ids)
        rollouts.rewards = torch.tensor([r.score for r in results], dtype=torch.float32, device=pl_module.device)
        rollouts.stats["time/verification_s"] = time.perf_counter() - start
        rollouts.stats["verifier/errors"] = float(runner.errors - errors)
        rollouts.stats["verifier/timeouts"] = float(runner.timeouts - timeouts)
        rollouts.stats["verifier/errors_total"] = float(runner.errors)
        rollouts.stats["verifier/timeouts_total"] = float(runner.timeouts)
        rollouts.infos = [r.info for r in results]


