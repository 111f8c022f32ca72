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
    assert set(checkpoint["state_dict"]) == {f"policy.{n}" for n in after_two}
    assert checkpoint["PromptDataModule"] == {"batches_consumed": 2}
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
