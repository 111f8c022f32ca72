"""A run stopped by Ctrl-C wherever it is, then resumed from its ``last.ckpt``, logs and validates as the run that
was never stopped: each step once under its own number, validations at the scheduled steps only, the one cut
short run on resume (also the final one, after ``max_steps``), the final checkpoint and adapter at the last step."""

import csv
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from safetensors.torch import load_file

from scgrpo.stage import RolloutStage
from scgrpo.callbacks import ReleaseHeldInterrupt, StepCheckpoint
from scgrpo.callbacks.interrupt import HeldInterrupt
from scgrpo.module import RLVRModule
from scgrpo.runs import RunCSVLogger, rows_before
from tests.helpers import tiny_data, tiny_module, tiny_trainer

STEPS, EVERY = 6, 2  # validation (and, unless said, last.ckpt) every 2 steps
CHECKPOINTS: list[StepCheckpoint] = []  # every one the tests made: none may be left holding a Ctrl-C


class CtrlCInValidation(Callback):
    """Ctrl-C in the validation after ``step`` steps, once its first batch is sampled (drawn from the RNG)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


@pytest.fixture(autouse=True)
def no_interrupt_left_held():
    yield
    assert not any(checkpoint.interrupt_hold.holding for checkpoint in CHECKPOINTS)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _fit(model_dir, root, ckpt_path=None, callbacks=(), checkpoint_every=EVERY, validate_first=True):
    seed_everything(0)
    CHECKPOINTS.append(StepCheckpoint(every_n_train_steps=checkpoint_every))
    trainer = tiny_trainer(root, max_steps=STEPS, logger=RunCSVLogger(str(root), name="run", version=0),
                           enable_checkpointing=True, limit_val_batches=1.0, val_check_interval=EVERY,
                           check_val_every_n_epoch=None, callbacks=[CHECKPOINTS[-1], *callbacks])
    trainer.fit(tiny_module(model_dir, validate_before_training=validate_first), datamodule=tiny_data(),
                ckpt_path=ckpt_path)
    return root / "run" / "version_0"


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The run never stopped."""
    root = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SCGRPO_CACHE", str(root / "cache"))
        return _fit(tiny_model_dir, root)


def _rows(run) -> list[dict]:
    with open(run / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _values(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and not k.endswith("time_s")}


def _lora(state: dict) -> dict:
    """The LoRA tensors of a checkpoint's state dict or an adapter file, by the adapter file's names."""
    return {k.removeprefix("runner.policy.").replace(".default.", "."): v for k, v in state.items()}


@pytest.mark.parametrize("where,checkpoint_every", [("rollout of step 4", EVERY), ("validation of step 4", EVERY),
                                                   ("validation of step 4", 3), ("validation of step 6", EVERY),
                                                   ("end of step 3", EVERY), ("checkpoint of step 4", EVERY),
                                                   ("logging of validation 4", 3)])
def test_a_run_stopped_and_resumed_is_the_run_never_stopped(tiny_model_dir, tmp_path, monkeypatch, straight, where,
                                                           checkpoint_every):
    """Stopped in step 4's rollout, the checkpoint is written at step 3 with the loop state of step 3's end
    (Lightning's own counts step 4 as begun: the resumed run's logger steps and validations were one ahead) and the
    RNG state of step 3's end (the resumed step 4 draws what the stopped one drew). Stopped in a validation (its
    step's last.ckpt written before it, or, every 3 steps, on Ctrl-C), the resumed run makes it; Lightning's
    went on training, or, at max_steps, ended at once. Every logged value and the final weights are the
    uninterrupted run's. A SIGINT at a step's end, after the module's last hook ("end of step 3", no periodic
    checkpoint there) or as the step's checkpoint is written ("checkpoint of step 4"), came before Lightning logged
    the step's row: the checkpoint of that step was left without it, and the resumed run never logged it. One in
    the module's end of a validation ("logging of validation 4", no periodic checkpoint there) came after the
    validation was marked done and before its row was logged: the checkpoint written on it skipped the validation
    on resume, and its row was lost."""
    stopped_at = 3 if where.startswith("rollout") else int(where[-1])
    with monkeypatch.context() as patch, pytest.raises(SystemExit):  # Lightning's exit after a KeyboardInterrupt
        stop = []
        if where.startswith("rollout"):
            sample, calls = RolloutStage.sample, []

            def stopped_in_rollout(stage, batch):
                rollouts = sample(stage, batch)  # (what it drew from the RNG is drawn)
                calls.append(1)
                if len(calls) == stopped_at + 1:  # (one rollout a step: the step after stopped_at whole ones)
                    raise KeyboardInterrupt
                return rollouts

            patch.setattr(RolloutStage, "sample", stopped_in_rollout)
        elif where.startswith("end"):
            end = RLVRModule.on_train_batch_end

            def signalled_at_end(self, *args):
                end(self, *args)
                if self.global_step == stopped_at:
                    os.kill(os.getpid(), signal.SIGINT)

            patch.setattr(RLVRModule, "on_train_batch_end", signalled_at_end)
        elif where.startswith("logging"):
            validation_end = RLVRModule.on_validation_epoch_end

            def signalled_before_logging(self):
                if self.global_step == stopped_at:
                    os.kill(os.getpid(), signal.SIGINT)
                validation_end(self)

            patch.setattr(RLVRModule, "on_validation_epoch_end", signalled_before_logging)
        elif where.startswith("checkpoint"):
            save = StepCheckpoint._save_last_checkpoint

            def signalled_after_writing(self, trainer, candidates):
                save(self, trainer, candidates)
                if trainer.global_step == stopped_at and not trainer.validating:
                    os.kill(os.getpid(), signal.SIGINT)

            patch.setattr(StepCheckpoint, "_save_last_checkpoint", signalled_after_writing)
        else:
            stop = [CtrlCInValidation(stopped_at)]
        _fit(tiny_model_dir, tmp_path, callbacks=stop, checkpoint_every=checkpoint_every)
    run = tmp_path / "run" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == stopped_at

    _fit(tiny_model_dir, tmp_path, ckpt_path=str(last), checkpoint_every=checkpoint_every)
    rows = _rows(run)
    assert [int(r["step"]) for r in rows if r["train/reward"]] == list(range(STEPS))
    # (logger step, optimiser steps): the validation after N steps is logged at step N
    assert [(int(r["step"]), int(float(r["val/global_step"]))) for r in rows if r["val/global_step"]] == \
        [(0, 0), (2, 2), (4, 4), (6, 6)]
    assert [_values(r) for r in rows] == [_values(r) for r in _rows(straight)]
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == STEPS
    (state,) = [s for k, s in checkpoint["callbacks"].items() if k.startswith("StepCheckpoint")]
    assert state["validated_step"] == STEPS
    final = load_file(run / "adapter" / "final" / "adapter_model.safetensors")
    expected = load_file(straight / "adapter" / "final" / "adapter_model.safetensors")
    for name, value in _lora(checkpoint["state_dict"]).items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0)
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_the_first_validation_cut_short_is_made_on_resume_without_a_validation_before_training(tiny_model_dir,
                                                                                            tmp_path):
    """No validation before training: the checkpoint still says that none was made yet, so the one of step 2 that
    Ctrl-C cut short is made on resume (a checkpoint of an older version, without the record, would skip it)."""
    with pytest.raises(SystemExit):
        _fit(tiny_model_dir, tmp_path, callbacks=[CtrlCInValidation(2)], validate_first=False)
    run = tmp_path / "run" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    (state,) = [s for k, s in torch.load(last, weights_only=False)["callbacks"].items() if k.startswith("StepCheckpoint")]
    assert state["validated_step"] == -1
    _fit(tiny_model_dir, tmp_path, ckpt_path=str(last), validate_first=False)
    rows = _rows(run)
    assert [int(float(r["val/global_step"])) for r in rows if r["val/global_step"]] == [2, 4, 6]
    assert [int(r["step"]) for r in rows if r["train/reward"]] == list(range(STEPS))


def test_a_resumed_metrics_file_keeps_the_rows_logged_before_the_checkpoint():
    """A validation shares its logger step with the training row of the next step: the resumed run's first row
    replaces the old one of the same step and kind and every row logged after it, not the rows before."""
    rows = [{"step": "0", "val/global_step": "0"}, {"step": "0", "val/global_step": ""},
            {"step": "1", "val/global_step": ""}, {"step": "2", "val/global_step": "2"},
            {"step": "2", "val/global_step": ""}]
    # resumed at step 2 with its validation to make: the training row of step 2 stays
    assert rows_before(rows, {"step": 2, "val/global_step": 2.0}) == rows[:3]
    # resumed at step 2, validated: the next training row (logger step 2) is the first one replaced
    assert rows_before(rows, {"step": 2, "train/reward": 0.5}) == rows[:4]
    # resumed at step 1 (every step a validation): the validation of step 0 and the training row of step 1 stay
    one = [{"step": "0", "val/global_step": "0"}, {"step": "0", "val/global_step": ""},
           {"step": "1", "val/global_step": "1"}, {"step": "1", "val/global_step": ""}]
    assert rows_before(one, {"step": 1, "val/global_step": 1.0}) == one[:2]
    # the row to replace was never written (stopped during that validation): every row before its step stays
    assert rows_before(rows[:3], {"step": 2, "val/global_step": 2.0}) == rows[:3]


def test_a_held_ctrl_c_takes_effect_on_release_and_a_second_one_at_once():
    held = HeldInterrupt()
    before = signal.getsignal(signal.SIGINT)
    held.hold()
    os.kill(os.getpid(), signal.SIGINT)  # held: nothing raised here
    assert held.holding
    with pytest.raises(KeyboardInterrupt):
        held.release()
    assert signal.getsignal(signal.SIGINT) is before and not held.holding
    held.hold()
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # the second: at once
    assert signal.getsignal(signal.SIGINT) is before
    held.hold()
    os.kill(os.getpid(), signal.SIGINT)
    assert held.release(deliver=False)  # dropped (the run is ending anyway)
    assert not held.release() and signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ignored (a background job): left so
    try:
        held.hold()
        assert not held.holding and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_release_held_interrupt_built_without_arguments_releases_the_step_checkpoints_hold():
    """As the module and a YAML config build it, it finds the hold among the trainer's callbacks: a Ctrl-C held at
    a step's end takes effect at its next step's start."""
    checkpoint = StepCheckpoint()
    CHECKPOINTS.append(checkpoint)
    trainer = SimpleNamespace(callbacks=[ReleaseHeldInterrupt(), checkpoint], is_global_zero=True)
    checkpoint.interrupt_hold.hold()
    os.kill(os.getpid(), signal.SIGINT)  # held: nothing raised here
    assert checkpoint.interrupt_hold.holding
    with pytest.raises(KeyboardInterrupt):
        trainer.callbacks[0].on_train_batch_start(trainer, None, None, 0)
    assert not checkpoint.interrupt_hold.holding and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    checkpoint.interrupt_hold.hold()
    os.kill(os.getpid(), signal.SIGINT)
    trainer.callbacks[0].on_train_end(trainer, None)  # dropped: the run ends anyway
    assert not checkpoint.interrupt_hold.holding and signal.getsignal(signal.SIGINT) is signal.default_int_handler
