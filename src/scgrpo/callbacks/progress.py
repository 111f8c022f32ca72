"""Progress bars that count optimiser steps of ``max_steps``.

The prompt stream is endless (one epoch, ``max_epochs=-1``), so Lightning's bars read "Epoch 0/-2", and their total
is the steps left when the epoch started while the count is the batch index: a run resumed at step 5 of 10 ends at
"10/5". These show "Step" and ``global_step / max_steps`` (optimiser steps, which ``max_steps`` counts).
"""

from __future__ import annotations

import math
from typing import Any, Union

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from scgrpo import lightning_internals as internals

DESCRIPTION = "Step"


def _total_steps(bar) -> Union[int, float, None]:
    """``max_steps`` when the stream is endless and it is set; None otherwise (Lightning's own total)."""
    trainer = bar.trainer
    if trainer.max_steps is not None and trainer.max_steps > 0 and math.isinf(trainer.num_training_batches):
        return trainer.max_steps
    return None


class StepRichProgressBar(RichProgressBar):
    """:class:`RichProgressBar` counting ``global_step / max_steps``."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        total = _total_steps(self)
        return total if total is not None else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if _total_steps(self) is None:
            return super()._get_train_description(current_epoch)
        return f"{DESCRIPTION:{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if _total_steps(self) is not None:
            internals.set_rich_count(self, self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the parent shows batch_idx + 1
        step = trainer.global_step - 1 if _total_steps(self) is not None else batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, step)


class StepTQDMProgressBar(TQDMProgressBar):
    """:class:`TQDMProgressBar` counting ``global_step / max_steps``."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        total = _total_steps(self)
        return total if total is not None else super().total_train_batches

    def _show_steps(self, trainer) -> None:
        total = _total_steps(self)
        if total is not None and self.train_progress_bar is not None:
            self.train_progress_bar.total = total
            self.train_progress_bar.set_description(DESCRIPTION)
            internals.set_tqdm_count(self.train_progress_bar, trainer.global_step)

    def on_train_start(self, trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._show_steps(trainer)  # a run resumed within its epoch does not start the epoch again

    def on_train_epoch_start(self, trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._show_steps(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step - 1 if _total_steps(self) is not None else batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, step)


STEP_BARS = {RichProgressBar: StepRichProgressBar, TQDMProgressBar: StepTQDMProgressBar}
"""Lightning's bar -> the one that counts steps"""


def count_steps(trainer) -> None:
    """Make the trainer's progress bar, if it is one of Lightning's own, count steps (its settings are kept: the
    subclasses add behaviour only)."""
    for callback in trainer.callbacks:
        step_bar = STEP_BARS.get(type(callback))
        if step_bar is not None:
            callback.__class__ = step_bar
