"""Running the fit's validation loop outside Lightning's schedule (before the first step, or on resume)."""

from __future__ import annotations

from scgrpo import lightning_internals as internals


def run_validation(trainer) -> None:
    """One pass of the fit's validation loop now, logged as the validation after ``trainer.global_step`` steps
    (at that logger step, as every validation: ``RLVRModule.setup``). Call from ``on_train_start``."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    with internals.logger_first_iteration_kept(trainer):
        loop.restarting = False  # a loop restored from a checkpoint would count the batches of its last run as done
        trainer.validating = True
        try:
            loop.run()
        finally:
            trainer.training = True
