import glob
import os

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers import tiny_data, tiny_module, tiny_trainer


def _lora_state(module):
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


def test_checkpoint_holds_only_trainable_weights_and_resumes(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    data = tiny_data()
    ckpt_dir = tmp_path / "ckpt"
    trainer = tiny_trainer(tmp_path, max_steps=2, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(module, datamodule=data)
    after_two = _lora_state(module)
    (path,) = glob.glob(str(ckpt_dir / "*.ckpt"))
    checkpoint = torch.load(path, weights_only=False)
    assert set(checkpoint["state_dict"]) == {f"runner.policy.{n}" for n in after_two}
    assert checkpoint["PromptDataModule"]["batches_consumed"] == 2
    assert checkpoint["PromptDataModule"]["verified_buffer"] == data.verified_buffer.state_dict()
    assert data.batches_consumed == 2

    resumed_module, resumed_data = tiny_module(tiny_model_dir), tiny_data()
    resumed = tiny_trainer(tmp_path / "b", max_steps=3)
    original_fit_start = resumed_module.on_fit_start
    seen = {}

    def capture():
        seen.update(_lora_state(resumed_module))
        original_fit_start()

    resumed_module.on_fit_start = capture
    resumed.fit(resumed_module, datamodule=resumed_data, ckpt_path=path)
    assert resumed.global_step == 3
    assert resumed_data.batches_consumed == 3  # the stream went on from where it stopped
    for name, value in after_two.items():
        assert torch.equal(seen[name], value), name


def test_adapter_export_loads_with_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, save_adapter_every_n_steps=1)
    trainer = tiny_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=tiny_data())
    folders = sorted(os.listdir(os.path.join(trainer.log_dir, "adapter")))
    assert folders == ["final", "step-1", "step-2"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(base, os.path.join(trainer.log_dir, "adapter", "final")).eval()
    ids = torch.randint(3, 200, (2, 7))
    module.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, module.policy(input_ids=ids).logits)


def test_four_steps_equal_two_steps_checkpoint_and_two_resumed_steps(tiny_model_dir, tmp_path):
    """Buffer, optimizer, RNG and data position are restored: the resumed run ends where the straight one does."""
    from lightning.pytorch import seed_everything

    from scgrpo.objectives import SCGRPO

    def run(root, max_steps, ckpt_path=None, save_every=None):
        seed_everything(0)
        module = tiny_module(tiny_model_dir, objective=SCGRPO())
        data = tiny_data()
        callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=save_every, save_top_k=-1)] if save_every else []
        trainer = tiny_trainer(root, max_steps=max_steps, enable_checkpointing=bool(save_every), callbacks=callbacks)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module, data

    straight, straight_data = run(tmp_path / "straight", 4)
    run(tmp_path / "first", 2, save_every=2)
    (ckpt,) = glob.glob(str(tmp_path / "first" / "ckpt" / "*.ckpt"))
    resumed, resumed_data = run(tmp_path / "resumed", 4, ckpt_path=ckpt)
    assert len(straight_data.verified_buffer) > 0
    assert resumed_data.verified_buffer.state_dict() == straight_data.verified_buffer.state_dict()
    assert resumed_data.batches_consumed == straight_data.batches_consumed == 4
    a, b = _lora_state(straight), _lora_state(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_checkpoints_are_written_beside_their_target_and_never_in_tmpdir(tiny_model_dir, tmp_path, monkeypatch):
    """Lightning's writer stages each save in a temporary file of $TMPDIR (fsspec), where a killed save leaves
    it; the module's writes ``.last.ckpt.tmp-<pid>`` beside the target and renames it into place. Interrupted,
    it leaves the old checkpoint whole and no temporary file; a killed save's leftover is removed by the next."""
    import subprocess
    import tempfile

    import pytest

    staged = []
    mkstemp = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda *args, **kwargs: staged.append(args) or mkstemp(*args, **kwargs))
    folder = tmp_path / "ckpt"
    trainer = tiny_trainer(tmp_path, max_steps=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)])
    trainer.fit(tiny_module(tiny_model_dir), datamodule=tiny_data())
    assert os.listdir(folder) == ["last.ckpt"] and not staged
    whole = (folder / "last.ckpt").read_bytes()

    def killed_midway(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    save = torch.save
    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(folder / "last.ckpt")
    assert os.listdir(folder) == ["last.ckpt"] and (folder / "last.ckpt").read_bytes() == whole
    monkeypatch.setattr(torch, "save", save)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (folder / f".last.ckpt.tmp-{gone.pid}").write_bytes(b"what a killed save left")
    trainer.save_checkpoint(folder / "last.ckpt")
    assert os.listdir(folder) == ["last.ckpt"] and not staged


def test_ctrl_c_saves_the_last_finished_step(tiny_model_dir, tmp_path):
    """A run interrupted before its first periodic checkpoint keeps what it trained."""
    import pytest
    from lightning.pytorch import Callback

    from scgrpo.callbacks import StepCheckpoint

    class CtrlC(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                raise KeyboardInterrupt

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    folder = tmp_path / "ckpt"
    trainer = tiny_trainer(tmp_path, max_steps=50, enable_checkpointing=True,
                           callbacks=[CtrlC(), StepCheckpoint(every_n_train_steps=50, dirpath=folder)])
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt
        trainer.fit(module, datamodule=tiny_data())
    checkpoint = torch.load(folder / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2 and checkpoint["PromptDataModule"]["batches_consumed"] == 2
    for name, p in module.policy.named_parameters():
        if p.requires_grad:
            assert torch.equal(checkpoint["state_dict"][f"runner.policy.{name}"], p), name


def test_ctrl_c_inside_a_step_saves_no_half_step(tiny_model_dir, tmp_path, monkeypatch):
    """Interrupted after the step's weight update but before its bookkeeping (logs, data position, buffer),
    the run saves no checkpoint that would hold the update without the rest (nor the rest without it)."""
    import pytest

    from scgrpo.callbacks import StepCheckpoint
    from scgrpo.module import RLVRModule

    logged = RLVRModule.log_step

    def interrupted(self, *args, **kwargs):
        if self.trainer.global_step == 2:  # step 2's update is done, its bookkeeping not
            raise KeyboardInterrupt
        return logged(self, *args, **kwargs)

    monkeypatch.setattr(RLVRModule, "log_step", interrupted)
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    folder = tmp_path / "ckpt"
    trainer = tiny_trainer(tmp_path, max_steps=50, enable_checkpointing=True,
                           callbacks=[StepCheckpoint(every_n_train_steps=1, dirpath=folder)])
    with pytest.raises(SystemExit):
        trainer.fit(module, datamodule=tiny_data())
    checkpoint = torch.load(folder / "last.ckpt", weights_only=False)  # the periodic one of step 1, whole
    assert checkpoint["global_step"] == 1 and checkpoint["PromptDataModule"]["batches_consumed"] == 1
