"""The private parts of Lightning that scgrpo reaches (``scgrpo.lightning_internals``) do what the package expects of
them in the installed Lightning; the resume tests cover the fit loop's (``validation_due``, ``after_fit_loop_run``)."""

import os
from types import SimpleNamespace

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from scgrpo import lightning_internals as internals


def test_local_paths_are_told_from_remote_ones():
    assert internals.is_local_path("/tmp/run/last.ckpt") and internals.is_local_path("file:///tmp/last.ckpt")
    assert not internals.is_local_path("s3://bucket/last.ckpt")


def test_a_tqdm_bars_count_is_set():
    with open(os.devnull, "w") as devnull:
        bar = Tqdm(total=10, file=devnull)
        internals.set_tqdm_count(bar, 3)
        assert bar.n == 3
        bar.close()


def test_a_model_checkpoints_settings_and_writes_are_its_own():
    callback = ModelCheckpoint(every_n_train_steps=3, monitor="val/x")
    assert internals.every_n_train_steps(callback) == 3
    # (the key StepCheckpoint's state is saved under: another would not be found in the run's earlier checkpoints)
    assert internals.checkpoint_state_key(callback, monitor="val/x", every_n_train_steps=3) == \
        "ModelCheckpoint{'monitor': 'val/x', 'every_n_train_steps': 3}"
    written = []
    callback._monitor_candidates = lambda trainer: {"step": trainer.global_step}
    callback._save_last_checkpoint = lambda trainer, candidates: written.append(("last", candidates))
    callback._save_topk_checkpoint = lambda trainer, candidates: written.append(("top_k", candidates))
    trainer = SimpleNamespace(global_step=4)
    internals.save_last(callback, trainer)
    internals.save_top_k(callback, trainer)
    assert written == [("last", {"step": 4}), ("top_k", {"step": 4})]


def test_the_fit_loop_runs_then_the_follower_until_restored():
    calls = []

    class FitLoop:
        def run(self):
            calls.append("run")

    trainer = SimpleNamespace(fit_loop=FitLoop())
    internals.after_fit_loop_run(trainer, lambda: calls.append("then"))
    internals.after_fit_loop_run(trainer, lambda: calls.append("then again"))  # (a later fit: replaces the first)
    trainer.fit_loop.run()
    assert calls == ["run", "then again"]
    internals.restore_fit_loop_run(trainer)
    trainer.fit_loop.run()
    assert calls == ["run", "then again", "run"]


def test_the_loggers_first_iteration_mark_is_put_back():
    trainer = SimpleNamespace(_logger_connector=SimpleNamespace(_first_loop_iter=True))
    with internals.logger_first_iteration_kept(trainer):
        trainer._logger_connector._first_loop_iter = None  # as a validation run leaves it
    assert trainer._logger_connector._first_loop_iter is True


def test_the_installed_lightning_has_every_private_name_the_package_reaches():
    """What each helper of ``scgrpo.lightning_internals`` reads or calls exists under that name in this Lightning
    (a rename in a new release fails here, not in the middle of a run)."""
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.callbacks.progress import tqdm_progress
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    assert callable(cloud_io._is_local_file_protocol) and callable(tqdm_progress._update_n)
    for name in ("_save_last_checkpoint", "_save_topk_checkpoint", "_monitor_candidates", "_generate_state_key"):
        assert callable(getattr(ModelCheckpoint, name)), name
    assert ModelCheckpoint(every_n_train_steps=2)._every_n_train_steps == 2
    assert callable(RichProgressBar._update) and callable(RichProgressBar._get_train_description)
    assert callable(ExperimentWriter._check_log_dir_exists)
    assert callable(LightningCLI._run_subcommand)  # (cli.py's ScgrpoCLI wraps it)
    logger = CSVLogger(save_dir="/tmp/scgrpo-internals-test")
    assert hasattr(logger, "_fs") and hasattr(logger, "_experiment")
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    assert hasattr(trainer._logger_connector, "_first_loop_iter")
    fit_loop = trainer.fit_loop
    assert callable(fit_loop.run) and hasattr(fit_loop, "_data_fetcher")
    assert callable(fit_loop.epoch_loop._should_check_val_fx)
