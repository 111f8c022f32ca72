"""Running the fit's validation loop outside Lightning's schedule (before the first step, or on resume), and logging
each evaluation's metrics."""

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


def logged_step(module) -> int:
    """The logger step of an evaluation: the training steps behind the evaluated weights, as ``metrics.csv`` numbers
    its train rows (:func:`~scgrpo.lightning_internals.train_step`): N after N steps, each of
    ``objective.num_iterations`` optimiser steps (``module.evaluated_step`` counts those)."""
    return module.evaluated_step // max(module.objective.num_iterations, 1)


def log_evaluation(module, stage: str) -> None:
    """The module's evaluation metrics (its :class:`~scgrpo.evaluation.Evaluation`'s, every split's
    ``<stage>/<split>/...``) and ``<stage>/global_step`` (the optimiser steps behind the evaluated weights, which tells a
    resumed run's rows of metrics.csv apart), logged at the logger step :func:`logged_step` (``RLVRModule.setup``).
    Every rank must call it."""
    step = module.evaluated_step
    for metrics in module.evaluation.metrics(step, module.global_rank == 0, stage).values():
        module.log_dict(metrics, on_step=False, on_epoch=True, add_dataloader_idx=False)
    module.log(f"{stage}/global_step", float(step), on_step=False, on_epoch=True, add_dataloader_idx=False)
