"""A list of loggers through the CLI: a logger that cannot start is named in one line with its cause, and the file
loggers of a list share the run folder whatever else the list holds."""

import csv
import glob
import os

import pytest
from lightning.pytorch.loggers import Logger

from scgrpo.cli import main

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


def _args(tiny_model_dir, steps=1):
    return [
        "fit", f"--config={QUICKSTART}", f"--model.model={tiny_model_dir}", "--model.dtype=float32",
        "--model.generation.num_generations=2", "--model.generation.max_new_tokens=4",
        "--model.validate_before_training=false", "--model.log_completions_every_n_steps=1",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
        "--data.batch_size=2", f"--trainer.max_steps={steps}",
    ]


def _the_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("scgrpo: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


class RemoteLogger(Logger):
    """A logger with no folder of its own, as W&B or MLflow: it receives the metrics and writes nothing here."""

    received: list[dict] = []

    @property
    def name(self):
        return "remote"

    @property
    def version(self):
        return "r1"

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        RemoteLogger.received.append(dict(metrics))


def test_a_logger_list_whose_package_is_missing_names_the_package_in_one_line(tiny_model_dir, tmp_path, monkeypatch,
                                                                               capsys):
    """CSV + W&B without wandb: jsonargparse tried the list as one Logger, then each member, and the message (the
    list's repr, the forms a logger may take, then the cause) hid the cause at its end."""
    from lightning.pytorch.loggers import wandb
    from lightning_utilities.core.imports import RequirementCache

    monkeypatch.setattr(wandb, "_WANDB_AVAILABLE", RequirementCache("wandb>=99999"))  # missing, installed or not
    monkeypatch.chdir(tmp_path)
    loggers = ("[{class_path: CSVLogger, init_args: {save_dir: logs}}, "
               "{class_path: WandbLogger, init_args: {project: p}}]")
    with pytest.raises(SystemExit) as info:
        main([*_args(tiny_model_dir), f"--trainer.logger={loggers}"])
    assert info.value.code == 2
    assert _the_error_line(capsys.readouterr().err) == (
        "scgrpo: error: lightning.pytorch.loggers.WandbLogger needs wandb>=99999, which is not installed: "
        "pip install 'wandb>=99999'")
    assert not os.path.exists(tmp_path / "logs")


@pytest.mark.parametrize(
    "arg, cause",
    [
        ("--trainer.logger=[{class_path: CSVLogger, init_args: {save_dir: logs}}, "
         "{class_path: TensorBoardLogger, init_args: {save_dir: logs, bogus: 1}}]",
         "'lightning.pytorch.loggers.TensorBoardLogger': Option 'bogus' is not accepted"),
        ("--trainer.logger+=CSVLogger",  # appended to the default list, without its save_dir
         "'lightning.pytorch.loggers.CSVLogger': the following arguments are required: save_dir"),
    ],
)
def test_a_bad_logger_in_a_list_is_named_without_the_list(arg, cause, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main([*_args(tiny_model_dir), arg])
    assert info.value.code == 2
    assert _the_error_line(capsys.readouterr().err) == (
        f"scgrpo: error: Parser key \"trainer.logger\": Problem with given class_path {cause}")


def test_csv_and_tensorboard_given_as_a_list_write_one_run_folder(tiny_model_dir, tmp_path, monkeypatch):
    """A logger without a folder listed first (W&B, MLflow) would have been Lightning's run folder: config.yaml and
    checkpoints under ./remote/r1 and the completions in the working folder. The file loggers go first."""
    monkeypatch.chdir(tmp_path)
    RemoteLogger.received.clear()
    loggers = ("[{class_path: tests.test_loggers.RemoteLogger}, {class_path: CSVLogger, init_args: {save_dir: logs}}, "
               "{class_path: TensorBoardLogger, init_args: {save_dir: logs}}]")
    main([*_args(tiny_model_dir, steps=2), f"--trainer.logger={loggers}"])
    assert sorted(os.listdir(tmp_path)) == ["logs"]
    run = tmp_path / "logs" / "lightning_logs" / "version_0"  # (Lightning's name: the list sets none)
    assert [os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "logs" / "*" / "*"))] == [
        "logs/lightning_logs/version_0"]
    with open(run / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")] == [0, 1]
    assert glob.glob(str(run / "events.out.tfevents.*"))
    for written in ("config.yaml", "completions.jsonl", "checkpoints/last.ckpt", "adapter/final/adapter_config.json"):
        assert os.path.isfile(run / written), written
    assert sum("train/reward" in m for m in RemoteLogger.received) == 2  # and the remote one had every step
