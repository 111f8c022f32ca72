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
