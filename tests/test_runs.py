"""A run's folder through the CLI: where it is, what a short run leaves in it, and a resumed run going on in it."""

import csv
import glob
import os
import warnings

import pytest
import torch

from scgrpo.cli import main
from scgrpo.verifiers import VerificationResult, Verifier, VerifierSetupError

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_arith.yaml")


def _args(tiny_model_dir, steps):
    return [
        "fit", f"--config={CONFIG}",  # validation every 30 steps
        f"--model.model={tiny_model_dir}", "--model.dtype=float32", "--model.generation.num_generations=2",
        "--model.generation.max_new_tokens=4", "--model.validate_before_training=false",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
        "--data.batch_size=2", f"--trainer.max_steps={steps}",
    ]


def _steps(run):
    with open(os.path.join(run, "metrics.csv")) as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")]


def test_six_step_run_writes_a_checkpoint_under_default_root_dir(tiny_model_dir, tmp_path, monkeypatch):
    """Shorter than the validation interval, it still leaves a resumable checkpoint, without Lightning's
    manual-optimisation warning; every output lies in <default_root_dir>/<logger name>/version_0."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*_args(tiny_model_dir, 6), "--trainer.default_root_dir=out", "--trainer.logger.init_args.name=mine"])
    assert not [w for w in caught if "manual optimization" in str(w.message)]
    assert not os.path.exists(tmp_path / "runs")
    assert [os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "out" / "*" / "*"))] == ["out/mine/version_0"]
    run = tmp_path / "out" / "mine" / "version_0"
    assert glob.glob(str(run / "events.out.tfevents.*")) and _steps(run) == list(range(6))  # CSV and TensorBoard
    assert os.path.isfile(run / "adapter" / "final" / "adapter_config.json") and os.path.isfile(run / "config.yaml")
    assert sorted(os.listdir(run / "checkpoints")) == ["last.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


def test_resume_goes_on_in_the_run_folder_and_appends_to_its_metrics(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(_args(tiny_model_dir, 2))
    run = tmp_path / "runs" / "scgrpo" / "version_0"
    with open(run / "metrics.csv", "a") as f:  # a row the first run logged after its checkpoint, then crashed
        f.write(",".join("2" if key == "step" else "9" for key in open(run / "metrics.csv").readline().strip().split(",")) + "\n")
    main([*_args(tiny_model_dir, 3), "--ckpt_path=runs/scgrpo/version_0/checkpoints/last.ckpt"])
    assert os.listdir(tmp_path / "runs" / "scgrpo") == ["version_0"]
    assert _steps(run) == [0, 1, 2]  # the stale step-2 row replaced by the resumed run's
    assert len(glob.glob(str(run / "events.out.tfevents.*"))) == 2
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3



def test_a_run_resumed_from_an_earlier_checkpoint_branches_and_last_holds_the_best(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """last.ckpt written at a validation step carries the best score (a resume goes on tracking it); resuming
    from best-step=N.ckpt rather than last.ckpt starts a new folder and leaves the run's own alone (its
    last.ckpt, adapter and metrics: here of the same step, in general of later ones)."""
    monkeypatch.chdir(tmp_path)
    validating = ["--trainer.val_check_interval=4", "--checkpoint.every_n_train_steps=2"]  # one validation: step 4
    main([*_args(tiny_model_dir, 4), *validating])
    run = tmp_path / "runs" / "scgrpo" / "version_0"
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    (state,) = [s for k, s in last["callbacks"].items() if k.startswith("StepCheckpoint")]
    assert last["global_step"] == 4 and state["best_model_score"] is not None and state["best_model_path"]
    best = os.path.relpath(state["best_model_path"], tmp_path)
    main([*_args(tiny_model_dir, 6), *validating, f"--ckpt_path={best}"])
    assert sorted(os.listdir(tmp_path / "runs" / "scgrpo")) == ["version_0", "version_1"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    assert _steps(run) == [0, 1, 2, 3]
    assert torch.load(tmp_path / "runs" / "scgrpo" / "version_1" / "checkpoints" / "last.ckpt",
                      weights_only=False)["global_step"] == 6


class ScorerGone(Verifier):
    """Scores 1 for its first ``calls`` completions, then cannot score anything (its service went away)."""

    def __init__(self, calls: int = 0) -> None:
        self.calls = calls

    def verify(self, completion, answer, question=""):
        self.calls -= 1
        if self.calls < 0:
            raise VerifierSetupError("the scorer's service is gone")
        return VerificationResult(1.0)


def test_a_run_that_fails_before_its_first_step_takes_its_empty_folder_away(tiny_model_dir, tmp_path, monkeypatch):
    """The loggers made version_N and wrote config.yaml and TensorBoard's first events into it before the verifier
    failed on the first rollouts (or a bad value was met at setup): the failed run takes that folder away, and the
    folders it made for it, never an earlier run's beside it, even one that holds nothing but its config."""
    monkeypatch.chdir(tmp_path)
    gone = ["--model.verifier=tests.test_runs.ScorerGone", "--model.validate_before_training=true"]
    with pytest.raises(VerifierSetupError):
        main([*_args(tiny_model_dir, 2), *gone])
    assert os.listdir(tmp_path) == []
    earlier = tmp_path / "runs" / "scgrpo" / "version_0"
    earlier.mkdir(parents=True)
    (earlier / "config.yaml").write_text("model: {}\n")
    with pytest.raises(VerifierSetupError):
        main([*_args(tiny_model_dir, 2), *gone, "--model.validate_before_training=false"])
    with pytest.raises(SystemExit):  # a checkpoint monitor the run never logs: refused at setup
        main([*_args(tiny_model_dir, 2), "--checkpoint.monitor=val/id/nothing"])
    assert os.listdir(tmp_path / "runs" / "scgrpo") == ["version_0"] and os.listdir(earlier) == ["config.yaml"]


def test_a_failed_run_keeps_its_folder_once_it_holds_a_checkpoint_and_a_resumed_one_keeps_its_own(
        tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first_step_only = ["--model.verifier=tests.test_runs.ScorerGone", "--model.verifier.calls=4",  # 2 prompts x G=2
                       "--checkpoint.every_n_train_steps=1"]
    with pytest.raises(VerifierSetupError):
        main([*_args(tiny_model_dir, 3), *first_step_only])
    run = tmp_path / "runs" / "scgrpo" / "version_0"
    assert _steps(run) == [0] and os.listdir(run / "checkpoints") == ["last.ckpt"]
    with pytest.raises(VerifierSetupError):
        main([*_args(tiny_model_dir, 3), "--model.verifier=tests.test_runs.ScorerGone",
              "--ckpt_path=runs/scgrpo/version_0/checkpoints/last.ckpt"])
    assert os.listdir(tmp_path / "runs" / "scgrpo") == ["version_0"]
    assert _steps(run) == [0] and os.listdir(run / "checkpoints") == ["last.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1

