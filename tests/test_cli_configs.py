"""Every shipped YAML parses and runs 2 steps with the tiny model; CLI plug-ins and error messages."""

import glob
import os

import pytest

from scgrpo.cli import main

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


def _tiny_args(tiny_model_dir):
    return [
        f"--model.model={tiny_model_dir}",
        "--model.dtype=float32",
        "--model.generation.max_new_tokens=6",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.enable_progress_bar=false",
        "--data.max_eval_prompts=4",
        "--data.batch_size=2",
    ]


def test_there_are_configs():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"quickstart.yaml", "grpo_arith_gpu.yaml"} | {f"{n}_arith.yaml" for n in ("scgrpo", "grpo", "drgrpo", "dapo", "selfdistill")} <= names
    assert {"qlora_scgrpo_arith.yaml", "qlora_grpo_arith.yaml", "fsdp_scgrpo_arith.yaml", "fsdp_grpo_arith.yaml"} <= names


SINGLE_PROCESS = [c for c in CONFIGS if not os.path.basename(c).startswith("fsdp_")]  # fsdp: tests/distributed


@pytest.mark.parametrize("config", SINGLE_PROCESS, ids=os.path.basename)
def test_config_runs_two_steps_with_the_tiny_model(config, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = ["--model.quantization=null"] if os.path.basename(config).startswith("qlora_") else []  # 4-bit: GPU only
    main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir), *extra])
    versions = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    assert versions, "no run folder written"
    run = versions[0]
    with open(os.path.join(run, "metrics.csv")) as f:
        header = f.readline()
    assert "train/reward" in header and "val/" in header
    assert os.path.isfile(os.path.join(run, "adapter", "final", "adapter_config.json"))
    assert glob.glob(os.path.join(run, "checkpoints", "*.ckpt"))


def test_custom_verifier_by_class_path(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
    main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir),
          "--model.verifier=tests.verifiers.helpers.ParityVerifier", "--model.verifier.offset=1"])
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    import yaml

    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert saved["model"]["verifier"]["class_path"] == "tests.verifiers.helpers.ParityVerifier"
    assert saved["model"]["verifier"]["init_args"]["offset"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data.source=arithmetik"], "unknown task 'arithmetik'"),
        (["--model.generation.num_generations=1"], "num_generations"),
        (["--model.model=/does/not/exist"], "does not exist"),
        (["--model.objective.init_args.aggregation=sum"], "aggregation"),
        (["--model.quantization=int3"], "quantization='int3'"),
        (["--model.quantization=nf4", "--model.lora=null"], "cannot be trained"),
    ],
)
def test_bad_config_values_end_in_one_clear_message(args, message, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
    with pytest.raises((SystemExit, ValueError, FileNotFoundError)) as info:
        main(["fit", f"--config={config}", *_tiny_args(tiny_model_dir), *args])
    text = str(info.value) + capsys.readouterr().err
    assert message in text


def test_arith_configs_differ_only_in_the_objective_block():
    import yaml

    folder = os.path.join(os.path.dirname(__file__), "..", "configs")
    loaded = {n: yaml.safe_load(open(os.path.join(folder, f"{n}_arith.yaml"))) for n in
              ("scgrpo", "grpo", "drgrpo", "dapo", "selfdistill")}
    for config in loaded.values():
        config["model"].pop("objective")
    first = loaded.pop("scgrpo")
    assert all(config == first for config in loaded.values())
