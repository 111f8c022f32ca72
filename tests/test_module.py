import csv
import dataclasses
import math
import os

import pytest
import torch

from scgrpo import GRPO
from scgrpo.rollout.engine import GenerationSettings, generate
from scgrpo.rollout.types import RolloutBatch
from scgrpo.update import MismatchMeter, StepSums, sampler_correction
from tests.helpers import tiny_data, tiny_module, tiny_trainer
from tests.verifiers.helpers import AlwaysRight, RaisingVerifier


def _metrics(trainer):
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_one_step_changes_every_lora_parameter_and_no_base_parameter(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(module, datamodule=tiny_data())
    rows = [r for r in _metrics(trainer) if r.get("train/mixed_groups")]
    assert float(rows[0]["train/mixed_groups"]) > 0  # there was a learning signal
    lora = [n for n in before if "lora_" in n]
    assert lora and all(p.requires_grad == ("lora_" in n) for n, p in module.policy.named_parameters())
    for name, p in module.policy.named_parameters():
        if "lora_" in name:
            assert not torch.equal(p, before[name]), f"{name} did not change"
        else:
            assert torch.equal(p, before[name]), f"base weight {name} changed"


def test_full_finetuning_changes_base_weights(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, lora=None)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_data())
    changed = [n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)


def _rollouts(module, rewards):
    prompts = module.actor.format_prompts(["What is 1 + 1?", "What is 2 + 3?"])
    g = generate(module.policy, module.tokenizer, prompts, 4, GenerationSettings(max_new_tokens=6), module.device)
    n = g.completion_ids.shape[0]
    return RolloutBatch(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.truncated, 4,
                        ["a"] * n, ["q"] * n, [0] * n, g.completions, rewards=torch.tensor(rewards))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_leaving_out_zero_advantage_rows_gives_the_full_batch_gradient(tiny_model_dir, aggregation):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(aggregation=aggregation))
    module.configure_model()
    module.manual_backward = lambda loss: loss.backward()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # second group: zero advantage
    advantages = module.objective.advantages(rollouts.rewards, 4)
    assert torch.equal(torch.nonzero(advantages != 0).squeeze(1), torch.arange(4))  # the subset below
    n_tok, n_rows = float(rollouts.completion_mask.sum()), 8.0
    params = [p for p in module.policy.parameters() if p.requires_grad]

    def grads(rows):
        for p in params:
            p.grad = None
        update = module.policy_update()
        plan = update.plan(rollouts)
        assert plan.norms.num_tokens == n_tok and plan.norms.num_rows == n_rows  # every row counts
        update.accumulate(rollouts, dataclasses.replace(plan, rows=rows, chunks=[rows], num_chunks=1), StepSums())
        return [p.grad.clone() for p in params]

    full = grads(torch.arange(8))
    subset = grads(torch.arange(4))
    for a, b in zip(full, subset):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(g.abs().max() > 0 for g in full)


def test_validation_reports_avg_pass_and_greedy(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, verifier=AlwaysRight(), eval_samples=3)
    trainer = tiny_trainer(tmp_path, limit_val_batches=None)
    metrics = trainer.validate(module, datamodule=tiny_data(max_eval_prompts=5))[0]
    assert metrics["val/id/avg@3"] == 1.0 and metrics["val/id/pass@3"] == 1.0 and metrics["val/id/greedy"] == 1.0
    module = tiny_module(tiny_model_dir, verifier=RaisingVerifier(), eval_samples=3)
    metrics = tiny_trainer(tmp_path, limit_val_batches=None).validate(module, datamodule=tiny_data(max_eval_prompts=5))[0]
    assert metrics["val/id/avg@3"] == 0.0 and metrics["val/id/pass@3"] == 0.0
    assert module.verifier_runner.errors == 5 * 3 + 5


def test_training_logs_the_step_statistics(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, validate_before_training=True, log_completions_every_n_steps=1)
    trainer = tiny_trainer(tmp_path, max_steps=2, limit_val_batches=None, val_check_interval=2)
    trainer.fit(module, datamodule=tiny_data())
    rows = _metrics(trainer)
    keys = set().union(*[{k for k, v in r.items() if v != ""} for r in rows])
    for key in ["train/reward", "train/accuracy", "train/mixed_groups", "train/completion_length", "train/truncated",
                "train/clip_fraction", "train/entropy", "time/generation_s", "time/verification_s", "time/train_s",
                "val/id/avg@2", "val/id/pass@2", "val/id/greedy", "verifier/errors", "rollout/logprob_mismatch_mean",
                "rollout/logprob_mismatch_max", "rollout/mismatch_kl", "rollout/slots", "rollout/decode_steps"]:
        assert key in keys, key
    mismatch = [float(r["rollout/logprob_mismatch_max"]) for r in rows if r.get("rollout/logprob_mismatch_max")]
    assert any(m == m for m in mismatch) and all(m < 1e-4 for m in mismatch if m == m)  # fp32: the same numbers
    val_steps = [r["step"] for r in rows if r.get("val/id/avg@2")]
    assert len(val_steps) == 2  # before training and after step 2
    assert [float(r["val/global_step"]) for r in rows if r.get("val/id/avg@2")] == [0.0, 2.0]  # optimiser steps done
    with open(os.path.join(trainer.logger.log_dir, "completions.jsonl")) as f:
        lines = f.readlines()
    assert len(lines) == 2 * 2 * 4  # 2 steps x 2 groups x G


@pytest.mark.parametrize("max_grad_norm", [1e-6, 0.0])
def test_grad_norm_is_logged_before_clipping_also_with_clipping_off(max_grad_norm, tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    clip = torch.nn.utils.clip_grad_norm_
    seen = []  # (norm of the gradients as clipping finds them, as it leaves them)

    def measured_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        grads = [p.grad.detach().double().flatten() for p in parameters if p.grad is not None]
        before = float(torch.linalg.vector_norm(torch.cat(grads)))
        result = clip(parameters, max_norm, *args, **kwargs)
        after = float(torch.linalg.vector_norm(torch.cat([p.grad.detach().double().flatten() for p in parameters
                                                          if p.grad is not None])))
        seen.append((before, after))
        return result

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", measured_clip)
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, max_grad_norm=max_grad_norm)
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(module, datamodule=tiny_data())
    (row,) = [r for r in _metrics(trainer) if r.get("train/grad_norm")]
    logged = float(row["train/grad_norm"])
    assert len(seen) == 1 and seen[0][0] > 1e-4  # one update, with a real gradient
    assert logged == pytest.approx(seen[0][0], rel=1e-4)  # the norm before clipping
    if max_grad_norm:
        assert seen[0][1] <= 2e-6  # clipped, and still the unclipped norm logged
    else:
        assert seen[0][1] == pytest.approx(seen[0][0], rel=1e-6)  # off: measured, not clipped


def test_nonfinite_loss_skips_the_update(tiny_model_dir, tmp_path, caplog):
    class NaNObjective(GRPO):
        def loss(self, logprobs, inputs):
            out = super().loss(logprobs, inputs)
            out.loss = out.loss * float("nan")
            return out

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=NaNObjective())
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    tiny_trainer(tmp_path, max_steps=2).fit(module, datamodule=tiny_data())
    assert module.guard.nonfinite_skips > 0 and "non-finite loss" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in module.policy.named_parameters())


def test_several_iterations_reuse_old_logprobs_and_step_each_time(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(num_iterations=3))
    trainer = tiny_trainer(tmp_path, max_steps=3)
    data = tiny_data()
    trainer.fit(module, datamodule=data)
    assert data.batches_consumed == 1  # three optimizer steps on one rollout batch
    rows = [r for r in _metrics(trainer) if r.get("train/clip_fraction")]
    assert len(rows) == 1


def test_reference_logprobs_come_from_the_base_model(tiny_model_dir):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(beta=0.1, num_iterations=2))
    module.configure_model()
    rollouts = _rollouts(module, [1.0, 0.0] * 4)
    module.actor.score(rollouts, module.objective.needs.old_logprobs, module.objective.needs.ref_logprobs)
    c = rollouts.completion_ids.shape[1]
    with torch.no_grad():
        with module.policy.disable_adapter():
            base, _ = module.actor.token_logprobs(rollouts.input_ids, rollouts.attention_mask, c)
        policy, _ = module.actor.token_logprobs(rollouts.input_ids, rollouts.attention_mask, c)
    torch.testing.assert_close(rollouts.ref_logprobs, base)
    torch.testing.assert_close(rollouts.old_logprobs, policy)
    assert (base - policy).abs().max() > 1e-4  # the adapters change the distribution


def test_logprobs_of_left_padded_rows_match_the_unpadded_sequence(tiny_model_dir):
    """Positions count real tokens only, so a left-padded row scores its completion as the bare row would."""
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    module.policy.eval()
    row = torch.tensor([[5, 6, 7, 8, 9, 10]])
    padded = torch.tensor([[2, 2, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        bare, _ = module.actor.token_logprobs(row, torch.ones_like(row), 3)
        pad, _ = module.actor.token_logprobs(padded, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]), 3)
    torch.testing.assert_close(bare, pad, atol=1e-5, rtol=1e-5)


def test_sampler_mismatch_metrics_and_tis_weights_by_hand():
    meter = MismatchMeter()
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -4.0, -1.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    weights = sampler_correction(trainer, sampler, mask, torch.full((2, 3), 0.5), 2.0, meter)
    log_ratio = torch.tensor([[0.5, -1.0, 0.0], [0.0, -1.0, 8.0]])
    expected = 0.5 * torch.tensor([[1.6487213, 0.3678794, 0.0], [1.0, 0.3678794, 2.0]])  # min(ratio, 2), masked
    torch.testing.assert_close(weights, expected)
    metrics = meter.metrics()
    kept = log_ratio[mask.bool()]
    assert metrics["rollout/logprob_mismatch_mean"] == pytest.approx(float(kept.abs().mean()))
    assert metrics["rollout/logprob_mismatch_max"] == pytest.approx(8.0)
    assert metrics["rollout/mismatch_kl"] == pytest.approx(float((kept.exp() - 1 - kept).mean()), rel=1e-5)
    # tis_cap 0 (off): the weights pass through, the mismatch is still measured
    assert sampler_correction(trainer, sampler, mask, None, 0.0, meter) is None
    assert meter.tokens == 2 * float(mask.sum())
    assert all(math.isnan(v) for v in MismatchMeter().metrics().values())  # no token compared


def test_mismatch_is_booked_on_the_first_pass_of_real_rows_only(tiny_model_dir):
    """A rank's zero-weight pass (``book=False``) and the later optimisation passes leave the mismatch as it was."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    rollouts.sampler_logprobs = torch.full(rollouts.completion_mask.shape, -1.0) * rollouts.completion_mask
    update = module.policy_update()
    plan, rows = update.plan(rollouts), torch.tensor([0, 1])
    update.micro_batch_loss(rollouts, rows, plan, book=False)
    assert update.mismatch.tokens == 0
    update.micro_batch_loss(rollouts, rows, plan)
    assert update.mismatch.tokens == float(rollouts.completion_mask[rows].sum()) > 0
    booked = dataclasses.asdict(update.mismatch)
    update.first_pass = False
    update.micro_batch_loss(rollouts, torch.tensor([2, 3]), plan)
    assert dataclasses.asdict(update.mismatch) == booked


def test_tis_cap_below_one_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="tis_cap"):
        tiny_module(tiny_model_dir, tis_cap=0.5)


@pytest.mark.parametrize("gap,scale", [(1.5, 1.5), (3.0, 2.0)])
def test_tis_scales_each_tokens_gradient_by_the_capped_ratio(tiny_model_dir, gap, scale):
    """pi_trainer / pi_sampler = gap on every token: the gradient is min(gap, 2) times the uncorrected one."""
    import math

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    module.manual_backward = lambda loss: loss.backward()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    c = rollouts.completion_ids.shape[1]
    module.policy.eval()  # no dropout: the training forward gives the same log-probs
    with torch.no_grad():
        trainer = module.actor.token_logprobs(rollouts.input_ids, rollouts.attention_mask, c, entropy=False)[0]
    rollouts.sampler_logprobs = (trainer - math.log(gap)) * rollouts.completion_mask
    params = [p for p in module.policy.parameters() if p.requires_grad]

    def grads(cap):
        module.tis_cap = cap
        for p in params:
            p.grad = None
        update = module.policy_update()
        update.accumulate(rollouts, update.plan(rollouts), StepSums())
        return [p.grad.clone() for p in params]

    plain, corrected = grads(0.0), grads(2.0)
    assert any(g.abs().max() > 0 for g in plain)
    for a, b in zip(plain, corrected):
        torch.testing.assert_close(b, scale * a, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("objective", ["GRPO", "DAPO"])
def test_absurd_learning_rate_stops_the_run_and_keeps_a_finite_adapter(objective, tiny_model_dir, tmp_path, caplog):
    """lr 1e37: one update makes the logits NaN. The sampler still returns completions (all alike, so every
    advantage is 0 and no loss is computed; DAPO would drop every group); the guard sees the sampler's NaN
    log-probs, skips three steps in a row, stops with one message and puts back the weights from before the bad
    update, which the final adapter holds."""
    from safetensors.torch import load_file

    import scgrpo.objectives
    from scgrpo.callbacks import StepCheckpoint

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=getattr(scgrpo.objectives, objective)(),
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e37))
    module.configure_model()
    before = {n.replace(".default", ""): p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    checkpoints = StepCheckpoint(every_n_train_steps=1, dirpath=tmp_path / "ckpt")
    trainer = tiny_trainer(tmp_path, max_steps=20, enable_checkpointing=True, callbacks=[checkpoints])
    trainer.fit(module, datamodule=tiny_data())
    assert trainer.global_step == 4 and module.guard.diverged  # one update, then three skipped steps
    assert not os.path.exists(tmp_path / "ckpt" / "last.ckpt")  # the only candidate, after step 1, gives NaN
    assert caplog.text.count("training diverged") == 1 and "sampling log-probs" in caplog.text
    skips = [float(r["train/nonfinite_skips"]) for r in _metrics(trainer) if r.get("train/nonfinite_skips")]
    assert skips == [0.0, 1.0, 2.0, 3.0]
    saved = load_file(os.path.join(trainer.log_dir, "adapter", "final", "adapter_model.safetensors"))
    assert set(saved) == set(before)
    for name, value in saved.items():
        assert torch.equal(value, before[name]), name
    assert module.actor.is_finite()  # and its log-probs on a probe are finite
