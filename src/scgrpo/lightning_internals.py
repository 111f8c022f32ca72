"""The private parts of Lightning that scgrpo relies on, in one place: what to check when Lightning is upgraded.

Checked against Lightning 2.6.6 (``lightning.__version__``; the package asks for >= 2.4). Each function names the
private attribute or function it reaches; the rest of the package calls these and uses Lightning's public API,
except for the private hooks that its subclasses override, whose names cannot move:
``RichProgressBar._get_train_description`` (``callbacks/progress.py``), ``ExperimentWriter._check_log_dir_exists``
(``runs.py``), ``LightningCLI._run_subcommand`` (``cli.py``: a failed run's empty folder removed); and
``module.py`` reads ``LightningModule._trainer`` (whether the module is attached to a trainer: ``self.trainer``
raises when it is not).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n


# ------------------------------------------------------------------------------------ files and loggers
def is_local_path(path: str) -> bool:
    """Whether ``path`` is on the local file system (``_is_local_file_protocol``)."""
    return _is_local_file_protocol(path)


def filesystem(logger_or_writer) -> Any:
    """The fsspec file system of a ``CSVLogger`` or its ``ExperimentWriter`` (their ``_fs``)."""
    return logger_or_writer._fs


def csv_experiment(logger, make: Callable[[], Any]) -> Any:
    """``CSVLogger.experiment`` with the writer ``make()`` in place of Lightning's own ``ExperimentWriter``: made
    once, after the logger's root folder (its ``_experiment`` and ``_fs``)."""
    if logger._experiment is None:
        logger._fs.makedirs(logger.root_dir, exist_ok=True)
        logger._experiment = make()
    return logger._experiment


def rank_zero_logger() -> logging.Logger:
    """The logger of Lightning's ``rank_zero_info`` ("GPU available: ...", its tips): ``lightning_utilities``'
    ``rank_zero.log``, which ``lightning.pytorch.utilities.rank_zero`` sets to its own logger on import."""
    import lightning.pytorch  # noqa: F401  (which sets it)
    from lightning_utilities.core import rank_zero

    return rank_zero.log


# ------------------------------------------------------------------------------------ progress bars
def set_tqdm_count(bar, n: int) -> None:
    """Sets a tqdm bar's count to ``n`` and redraws it (``tqdm_progress._update_n``)."""
    _update_n(bar, n)


def set_rich_count(progress_bar, bar_id, n: int) -> None:
    """Sets the count of the bar ``bar_id`` of a ``RichProgressBar`` to ``n`` (its ``_update``)."""
    progress_bar._update(bar_id, n)


# ------------------------------------------------------------------------------------ ModelCheckpoint
def every_n_train_steps(callback) -> int:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` (0: not by step), as it keeps it (``_every_n_train_steps``)."""
    return callback._every_n_train_steps


def checkpoint_state_key(callback, **key: Any) -> str:
    """A ``ModelCheckpoint``'s state key for the settings ``key`` (``_generate_state_key``)."""
    return callback._generate_state_key(**key)


def save_last(callback, trainer) -> None:
    """A ``ModelCheckpoint`` writes its ``last`` checkpoint now (``_save_last_checkpoint`` with
    ``_monitor_candidates``)."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def save_top_k(callback, trainer) -> None:
    """A ``ModelCheckpoint`` writes its best-so-far checkpoint now if the monitored value earns it
    (``_save_topk_checkpoint`` with ``_monitor_candidates``)."""
    callback._save_topk_checkpoint(trainer, callback._monitor_candidates(trainer))


# ------------------------------------------------------------------------------------ the fit loop
def validation_due(trainer) -> bool:
    """Lightning's own test of whether a validation follows the step the fit loop's state is at
    (``epoch_loop._should_check_val_fx`` on the fit loop's ``_data_fetcher``)."""
    fit_loop = trainer.fit_loop
    return bool(fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher))


def after_fit_loop_run(trainer, then: Callable[[], None]) -> None:
    """Makes the fit loop call ``then()`` after its ``run`` returns, also when Lightning skipped training (at
    ``max_steps``, where no training hook runs), until :func:`restore_fit_loop_run`."""
    fit_loop = trainer.fit_loop
    vars(fit_loop).pop("run", None)  # a wrapper left by an earlier fit of this trainer
    run = fit_loop.run

    def run_then() -> None:
        run()
        then()

    fit_loop.run = run_then


def restore_fit_loop_run(trainer) -> None:
    """Undoes :func:`after_fit_loop_run`."""
    vars(trainer.fit_loop).pop("run", None)


def run_train_start_and_end(trainer) -> None:
    """The fit loop's ``on_train_start`` hooks, then its ``on_train_end`` hooks, with no step between (its
    ``on_run_start`` and ``on_run_end``)."""
    trainer.fit_loop.on_run_start()
    trainer.fit_loop.on_run_end()


def evaluations_logged_at_global_step(trainer, step=None) -> None:
    """Makes the trainer log each validation's and test's metrics at the optimiser steps done before it (``step()``,
    default ``trainer.global_step``: the step-0 baseline at 0, the validation after N steps at N), where Lightning
    logs them at its logger step: N - 1 in a fit's validation after N steps (its ``_batches_that_stepped`` counts the
    step when the validation is over), whatever the checkpoint held in ``validate`` and ``test``. Replaces the logger
    connector's ``log_eval_end_metrics`` (its ``_logger_connector``), once per trainer."""
    connector = trainer._logger_connector
    if "log_eval_end_metrics" in vars(connector):
        return

    def log_eval_end_metrics(metrics) -> None:
        if not trainer.sanity_checking:
            connector.log_metrics(metrics, step=step() if step is not None else trainer.global_step)

    connector.log_eval_end_metrics = log_eval_end_metrics


@contextlib.contextmanager
def logger_first_iteration_kept(trainer) -> Iterator[None]:
    """Puts back the logger connector's mark of the training loop's first iteration after a validation run off
    Lightning's schedule, as its epoch loop does around its own (``_logger_connector._first_loop_iter``)."""
    connector = trainer._logger_connector
    first_iter = connector._first_loop_iter
    try:
        yield
    finally:
        connector._first_loop_iter = first_iter


def train_step(trainer) -> int:
    """The number of the training step in progress (in a training hook), as ``metrics.csv`` numbers its train
    rows: the training steps done before it, 0 for a run's first, also across epochs and in a resumed run. Every
    output of a step numbers its rows by it (``completions.jsonl``, ``credit_tokens.jsonl``, the headings of
    ``credit_heatmap.html``, TensorBoard's completions table), so that they join with the step's row of
    ``metrics.csv``. (A validation is logged at the optimiser steps before it, ``val/global_step``: N after N
    steps of one optimiser step each.)

    A training step is one rollout batch. ``trainer.global_step`` counts optimiser steps instead: at the step's end
    it is one ahead, ``objective.num_iterations`` ahead where a batch takes several. Read from the fit loop's count
    of finished batches (``batch_progress.total.completed``, public), which is Lightning's logger step for the
    batch (its ``_batches_that_stepped``) from ``on_train_batch_start`` to ``on_train_batch_end``: manual
    optimisation accumulates no batches."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.completed)
