"""The callback that runs the rollout stage (:mod:`scgrpo.stage`) before each training step and, after it, stores
the verified rollouts in the data module's buffer."""

from __future__ import annotations

from typing import Optional

from lightning.pytorch import Callback

from scgrpo.rollout.types import PromptBatch


class RolloutCallback(Callback):
    """In ``on_train_batch_start`` (outside the training forward: eval mode, no grad, KV cache on), the module's
    :class:`~scgrpo.stage.RolloutStage` samples G completions (or episodes) of each prompt, verifies them and, for
    DAPO, resamples equal-reward groups from the data module's ``extra_batch``; the batch carries the result as
    ``batch.rollouts``. After the step the rollouts at or above the success threshold go to the data module's
    verified-trajectory buffer, where later steps' self-teachers find references.

    A step stopped by an exception (Ctrl-C, the GPU out of memory) puts the extra prompts' stream back where it
    stood at the step's start, so the checkpoint written on the exception holds the last whole step's position."""

    def __init__(self) -> None:
        self._extra_consumed: Optional[int] = None  # the extra stream's position at the start of the step under way

    def on_train_batch_start(self, trainer, pl_module, batch: PromptBatch, batch_idx: int) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        self._extra_consumed = getattr(datamodule, "extra_consumed", None)
        more = datamodule.extra_batch if hasattr(datamodule, "extra_batch") else None
        batch.rollouts = pl_module.rollout_stage.collect(batch, more)  # (its sampling under the run's OOM error)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: PromptBatch, batch_idx: int) -> None:
        self._extra_consumed = None  # (the step is done)
        buffer = getattr(getattr(trainer, "datamodule", None), "verified_buffer", None)
        rollouts = batch.rollouts
        if buffer is None or rollouts is None or rollouts.rewards is None:
            return
        if pl_module.guard.last_step_skipped:  # sampled from non-finite logits: not the policy's own
            return
        for row in pl_module.rollout_stage.verified_rows(rollouts, pl_module.success_threshold):
            buffer.add(*row, trainer.global_step)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # before StepCheckpoint's on_exception writes last.ckpt (Lightning runs checkpoint callbacks last)
        datamodule = getattr(trainer, "datamodule", None)
        if self._extra_consumed is not None and hasattr(datamodule, "extra_consumed"):
            datamodule.extra_consumed = self._extra_consumed
            self._extra_consumed = None
