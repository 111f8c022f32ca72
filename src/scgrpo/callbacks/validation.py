"""Running the fit's validation loop outside Lightning's schedule (before the first step, or on resume), and logging
each evaluation's metrics."""

from __future__ import annotations

from lightning.pytorch import Callback

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


class EvaluationLogging(Callback):
    """Starts the module's :class:`~scgrpo.evaluation.Evaluation` at each validation or test epoch and logs its
    metrics at the end: ``<stage>/<split>/...`` of every split and ``<stage>/global_step`` (the optimiser steps behind
    the evaluated weights, which tells a resumed run's rows of metrics.csv apart), at the logger step
    ``evaluated_step`` (see ``RLVRModule.setup``)."""

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        pl_module.evaluation.start()

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._log(pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._log(pl_module, "test")

    @staticmethod
    def _log(pl_module, stage: str) -> None:
        step = pl_module.evaluated_step
        for metrics in pl_module.evaluation.metrics(step, pl_module.global_rank == 0, stage).values():
            pl_module.log_dict(metrics, on_step=False, on_epoch=True, add_dataloader_idx=False)
        pl_module.log(f"{stage}/global_step", float(step), on_step=False, on_epoch=True, add_dataloader_idx=False)
