"""``scgrpo validate|test --model.model <adapter folder>``: the adapter's own LoRA settings and weights on the base
its adapter_config.json names, or on ``--model.base_model``; one clear line when either cannot be loaded."""

import csv
import glob
import json
import os
import shutil

import pytest
import torch

from scgrpo import models
from scgrpo.cli import main
from scgrpo.errors import InputError
from scgrpo.module import RLVRModule
from tests.helpers import tiny_data, tiny_module, tiny_trainer
from tests.test_adapter_export import embedded_model, tiny_fit_args  # noqa: F401 - (a fixture)


def _test_args(adapter: str, *extra: str) -> list[str]:
    return ["test", f"--model.model={adapter}", "--model.dtype=float32", "--model.generation.max_new_tokens=4",
            "--model.eval_samples=2", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.enable_progress_bar=false", "--data.eval_splits=[id]", "--data.max_eval_prompts=4",
            "--data.eval_batch_size=4", *extra]


def _export(model: str, root, steps: int = 1) -> str:
    """Trains ``steps`` steps with random (non-zero) adapter weights from the start and returns adapter/final."""
    torch.manual_seed(0)
    trainer = tiny_trainer(root, max_steps=steps)
    trainer.fit(tiny_module(model), datamodule=tiny_data())
    return os.path.join(trainer.log_dir, "adapter", "final")


def _logits(module: RLVRModule) -> torch.Tensor:
    module.configure_model()
    module.policy.eval()
    with torch.no_grad():
        return module.policy(input_ids=torch.arange(3, 12).view(1, -1)).logits


def _one_line_error(capsys, args) -> str:
    capsys.readouterr()  # (what the test printed before)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scgrpo: error: "), err
    return err[0]


def test_an_exported_adapter_copied_elsewhere_is_tested_with_a_fresh_cache(tiny_model_dir, tmp_path, monkeypatch,
                                                                           caplog):
    main(tiny_fit_args(tiny_model_dir, tmp_path / "trained"))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "trained" / "scgrpo" / "version_0" / "adapter" / "final", elsewhere / "adapter")
    monkeypatch.setenv("SCGRPO_CACHE", str(elsewhere / "cache"))
    monkeypatch.chdir(elsewhere)
    with caplog.at_level("INFO", logger="scgrpo.evaluation"):
        main(_test_args("adapter"))
    (run,) = glob.glob(str(elsewhere / "runs" / "scgrpo" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        (row,) = list(csv.DictReader(f))
    logged = {key for key, value in row.items() if value}
    assert {"test/id/avg@2", "test/id/pass@2", "test/id/greedy", "test/global_step"} <= logged
    assert not [key for key in logged if key.startswith("val/")] and row["step"] == "0"
    assert "step 0 test [id] on 4 prompts" in caplog.text and "validation" not in caplog.text


def test_the_adapter_s_own_lora_settings_and_weights_are_loaded_on_its_base(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = _export(tiny_model_dir, tmp_path)  # r=4, alpha=8, random B
    module = RLVRModule(model=adapter)  # (default LoRA settings: r=16; the adapter's own win)
    assert module.adapter.base == tiny_model_dir
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
    with torch.no_grad():
        reference = expected(input_ids=torch.arange(3, 12).view(1, -1)).logits
    base = _logits(RLVRModule(model=tiny_model_dir, lora=None))
    assert not torch.allclose(base, reference, atol=1e-4)  # (the adapter changes the output)
    torch.testing.assert_close(_logits(module), reference)
    assert module.policy.peft_config["default"].r == 4


def test_base_model_loads_the_adapter_on_another_base_than_its_config_names(tiny_model_dir, tmp_path, capsys):
    adapter = _export(tiny_model_dir, tmp_path)
    reference = _logits(RLVRModule(model=adapter))
    config_file = os.path.join(adapter, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = str(tmp_path / "on-another-machine" / "tiny")
    with open(config_file, "w") as f:
        json.dump(config, f)
    line = _one_line_error(capsys, _test_args(adapter))
    assert "on-another-machine/tiny" in line and "set model.base_model" in line
    module = RLVRModule(model=adapter, base_model=tiny_model_dir)
    torch.testing.assert_close(_logits(module), reference)
    assert module.base_model_name == tiny_model_dir


def test_an_adapter_on_the_embedded_model_is_resolved_again_in_a_fresh_cache(embedded_model, tmp_path, monkeypatch):
    adapter = _export("smollm2", tmp_path / "trained")
    monkeypatch.setenv("SCGRPO_CACHE", str(tmp_path / "fresh-cache"))
    module = RLVRModule(model=adapter)
    _logits(module)
    assert module.adapter.base == "smollm2"
    assert str(embedded_model[-1]).startswith(str(tmp_path / "fresh-cache"))  # converted again, on this "machine"


def test_folders_that_are_neither_model_nor_adapter_and_a_stray_base_model_are_one_line(tiny_model_dir, tmp_path,
                                                                                       capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_line_error(capsys, _test_args(str(empty)))
    assert "has no config.json" in line and "adapter_config.json" in line
    line = _one_line_error(capsys, _test_args(tiny_model_dir, f"--model.base_model={tiny_model_dir}"))
    assert "model.base_model" in line and "no adapter folder" in line
    with pytest.raises(InputError, match="no adapter_model.safetensors"):
        (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        RLVRModule(model=str(empty))
    (empty / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match="names no base model.*set model.base_model"):
        RLVRModule(model=str(empty))


def test_an_adapter_of_another_shape_does_not_fit(tiny_model_dir, tmp_path):
    from tests.conftest import build_tiny_llama, build_tokenizer

    tokenizer = build_tokenizer()
    wider = build_tiny_llama(len(tokenizer))
    wider.config.hidden_size = 64
    other = tmp_path / "other-base"
    type(wider)(wider.config).save_pretrained(other)
    tokenizer.save_pretrained(other)
    adapter = _export(tiny_model_dir, tmp_path)
    module = RLVRModule(model=adapter, base_model=str(other))
    with pytest.raises(InputError, match="does not fit the base model"):
        module.configure_model()
    assert models.is_adapter_folder(adapter) and not models.is_adapter_folder(tiny_model_dir)


@pytest.mark.parametrize("fault, message", [
    ("targets", "does not fit the base model"), ("weights", "its weights cannot be read"),
    ("pissa", "init_lora_weights='pissa' before conversion")])
def test_an_adapter_that_cannot_go_on_its_base_is_one_error(fault, message, tiny_model_dir, tmp_path):
    adapter = _export(tiny_model_dir, tmp_path)
    config_file = os.path.join(adapter, "adapter_config.json")
    config = json.loads(open(config_file).read())
    if fault == "targets":  # another architecture's layer names (GPT-2's)
        config["target_modules"] = ["c_attn"]
    if fault == "pissa":  # saved before its conversion to a plain LoRA adapter
        config["init_lora_weights"] = "pissa"
    open(config_file, "w").write(json.dumps(config))
    if fault == "weights":  # a copy cut short
        weights = os.path.join(adapter, "adapter_model.safetensors")
        data = open(weights, "rb").read()
        open(weights, "wb").write(data[: len(data) // 3])
    with pytest.raises(InputError, match=message):
        RLVRModule(model=adapter, dtype="float32").configure_model()


def test_an_adapter_is_loaded_as_it_was_trained_not_initialised_again(tiny_model_dir, tmp_path):
    adapter = _export(tiny_model_dir, tmp_path)
    settings = models.AdapterFolder.read(adapter).lora_settings()
    assert settings.extra["init_lora_weights"] is False


def test_a_file_that_is_not_gguf_is_refused_when_the_run_is_configured(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>not found</html>")
    with pytest.raises(InputError, match="is not a GGUF file"):
        models.check_model_name(str(fake))
