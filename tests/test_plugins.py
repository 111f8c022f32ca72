"""Parts a user adds in a file of their own (``tests/plugins``), outside the package, plugged in by YAML: each
trains, and the package reads what it declares."""

import csv
import glob
import os

import torch

from scgrpo.cli import main
from tests.plugins import kl_penalised
from tests.test_cli_configs import BASE, _tiny_args


def _metrics(tmp_path) -> list[dict]:
    (run,) = glob.glob(str(tmp_path / "runs" / "*" / "version_*"))
    with open(os.path.join(run, "metrics.csv")) as f:
        return [row for row in csv.DictReader(f) if row.get("train/reward")]


def test_an_objective_in_a_file_of_its_own_gets_the_passes_it_declares_and_trains(tiny_model_dir, tmp_path, monkeypatch):
    """``KLPenalisedGRPO`` declares the scoring pass under the sampling weights and the reference, read by its credit:
    the step runs both (old and reference log-probs differ once the adapters have moved; the reference ones are the
    base model's) and hands them over; nothing else in the package is told about it."""
    monkeypatch.chdir(tmp_path)
    kl_penalised.SEEN.clear()
    main(["fit", f"--config={BASE}", *_tiny_args(tiny_model_dir), "--model.validate_before_training=false",
          "--model.objective=tests.plugins.kl_penalised.KLPenalisedGRPO", "--model.objective.init_args.kl_coef=2.0",
          "--model.lora.init_args.extra={init_lora_weights: false}", "--trainer.max_steps=2"])
    assert len(kl_penalised.SEEN) == 2
    for inputs in kl_penalised.SEEN:
        assert inputs.old_logprobs is not None and inputs.ref_logprobs is not None
        assert inputs.old_logprobs.shape == inputs.mask.shape
        assert not torch.equal(inputs.old_logprobs * inputs.mask, inputs.ref_logprobs * inputs.mask)  # LoRA is on
    rows = _metrics(tmp_path)
    assert len(rows) == 2 and all(float(r["time/scoring_s"]) > 0 for r in rows)  # the scoring pass ran each step
    # the sequence KL tells the rows of a group apart where the verifier does not: every step has a gradient
    assert all(float(r["train/rows_in_loss"]) > 0 and float(r["train/grad_norm"]) > 0 for r in rows)


def test_a_rollout_backend_in_a_file_of_its_own_samples_every_rollout_and_trains(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """``NaiveSampler`` (no KV cache: a full forward per token) named by ``generation.engine``: every training and
    evaluation rollout is its draw; its log-probabilities are the trainer's (the sampler-trainer mismatch is that of
    LoRA's dropout alone, near 0), and the run trains."""
    from tests.plugins import naive_sampler

    monkeypatch.chdir(tmp_path)
    naive_sampler.DRAWS.clear()
    main(["fit", f"--config={BASE}", *_tiny_args(tiny_model_dir), "--model.validate_before_training=false",
          "--model.generation.engine=tests.plugins.naive_sampler.NaiveSampler", "--trainer.max_steps=2",
          "--model.lora.init_args.dropout=0.0", "--model.generation.num_generations=4"])
    assert naive_sampler.DRAWS[:2] == [2 * 4, 2 * 4]  # the two training steps' rollouts (2 prompts x G), then evaluation
    assert len(naive_sampler.DRAWS) > 2
    rows = _metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert float(row["rollout/logprob_mismatch_mean"]) < 1e-4  # the draw's log-probs are the trainer's
        assert float(row["train/completion_length"]) > 0
    assert any(float(r["train/grad_norm"]) > 0 for r in rows)
