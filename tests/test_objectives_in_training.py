from collections import defaultdict

"""The objectives inside the training loop: SC-GRPO's reduction to GRPO, DAPO's sampling, the baselines."""

import os

import pytest
import torch

from scgrpo.callbacks.rollout import DynamicSamplingCallback, concat_rollouts, mixed_groups
from scgrpo.objectives import DAPO, GRPO, SCGRPO, HighEntropyGRPO, SelfDistillation
from scgrpo.objectives.dapo import overlong_penalty
from scgrpo.rollout.engine import GenerationSettings, generate
from scgrpo.rollout.types import PromptBatch, RolloutBatch
from tests.helpers import tiny_data, tiny_module, tiny_trainer


def _rollouts(module, rewards, group_size=4):
    prompts = module.format_prompts(["What is 1 + 1?", "What is 2 + 3?"])
    g = generate(module.policy, module.tokenizer, prompts, group_size, GenerationSettings(max_new_tokens=6), module.device)
    return RolloutBatch(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.truncated, group_size,
                        ["a"] * 4 + ["b"] * 4, ["What is 1 + 1?"] * 4 + ["What is 2 + 3?"] * 4, [2] * 4 + [5] * 4,
                        g.completions, rewards=torch.tensor(rewards))


def _gradients(module, rollouts):
    """Loss and LoRA gradients of one training step's math, without the optimizer."""
    module.manual_backward = lambda loss: loss.backward()
    plan = module.plan_step(rollouts)  # rows with non-zero advantage, references, global denominators
    params = [p for p in module.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    sums = defaultdict(float)
    module.accumulate_gradients(rollouts, plan, sums)
    return torch.tensor(sums["loss"]), [p.grad.clone() for p in params], plan["teacher"]


def test_scgrpo_without_references_equals_grpo_exactly(tiny_model_dir):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(), success_threshold=2.0)  # nothing counts as verified
    module.configure_model()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    grpo_loss, grpo_grads, _ = _gradients(module, rollouts)
    module.objective = SCGRPO()
    sc_loss, sc_grads, teacher = _gradients(module, rollouts)
    assert not teacher["has_reference"].any()
    assert torch.equal(sc_loss, grpo_loss)
    for a, b in zip(sc_grads, grpo_grads):
        assert torch.equal(a, b)


def test_scgrpo_with_references_reweights_tokens(tiny_model_dir):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO())
    module.configure_model()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    grpo_loss, grpo_grads, _ = _gradients(module, rollouts)
    module.objective = SCGRPO()
    sc_loss, sc_grads, teacher = _gradients(module, rollouts)
    assert teacher["has_reference"].all()  # every group has two successes
    assert any(not torch.allclose(a, b) for a, b in zip(sc_grads, grpo_grads))
    weights = module._credit_record(rollouts, module.objective.advantages(rollouts.rewards, 4), teacher)["weights"]
    mask = rollouts.completion_mask
    row_means = (weights * mask).sum(1) / mask.sum(1)
    assert (weights[mask.bool()] != 1).any() and (row_means <= 1 + 1e-5).all()


def test_teacher_base_differs_from_teacher_policy(tiny_model_dir):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO(teacher="policy"))
    module.configure_model()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    _, policy_grads, _ = _gradients(module, rollouts)
    module.objective = SCGRPO(teacher="base")
    _, base_grads, _ = _gradients(module, rollouts)
    assert any(not torch.allclose(a, b) for a, b in zip(policy_grads, base_grads))


def test_overlong_shaping_matches_the_formula_at_the_boundaries():
    lengths = torch.tensor([10, 12, 13, 14, 16])  # L_max 16, L_buf 4: free up to 12, then -(len - 12) / 4
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    shaped = DAPO(overlong_buffer=4).shape_rewards(torch.ones(5), lengths, 16)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 1.0, 0.75, 0.5, 0.0]))
    assert torch.equal(DAPO().shape_rewards(torch.ones(5), lengths, 16), torch.ones(5))


class _ScriptedData:
    """Extra batches whose groups come out mixed or uniform as scripted (via the ParityVerifier offset)."""

    def __init__(self):
        self.calls = 0

    def extra_batch(self):
        self.calls += 1
        return PromptBatch(ids=[f"e{self.calls}"], questions=["x"], answers=[0])


def test_dynamic_sampling_keeps_only_mixed_groups_and_stops_at_its_cap(tiny_model_dir, monkeypatch):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=DAPO(max_sampling_rounds=2))
    module.configure_model()
    module.verifier_runner = None
    batch = PromptBatch(ids=["a", "b"], questions=["q"] * 2, answers=[0, 0])
    batch.rollouts = _rollouts(module, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # group b is uniform
    calls = []

    def fake_verify(pl_module, rollouts):  # extra groups are always uniform: the loop must stop at its cap
        calls.append(1)
        rollouts.rewards = torch.ones(len(rollouts.completions))

    monkeypatch.setattr("scgrpo.callbacks.rollout.verify_rollouts", fake_verify)
    trainer = type("T", (), {"datamodule": _ScriptedData()})()
    DynamicSamplingCallback().on_train_batch_start(trainer, module, batch, 0)
    assert batch.rollouts.num_groups == 1 and batch.rollouts.sample_ids == ["a"] * 4
    assert batch.rollouts.stats["dapo/extra_rounds"] == 2 and len(calls) == 2

    batch.rollouts = _rollouts(module, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def mixed_verify(pl_module, rollouts):
        rollouts.rewards = torch.tensor([float(i % 2) for i in range(len(rollouts.completions))])

    monkeypatch.setattr("scgrpo.callbacks.rollout.verify_rollouts", mixed_verify)
    DynamicSamplingCallback().on_train_batch_start(trainer, module, batch, 0)
    assert batch.rollouts.num_groups == 2 and batch.rollouts.stats["dapo/extra_rounds"] == 1
    assert len(mixed_groups(batch.rollouts)) == 8  # every kept group has mixed rewards


def test_concat_rollouts_repads_prompts_left_and_completions_right(tiny_model_dir):
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    a = _rollouts(module, [1.0] * 8)
    b = a.select(torch.arange(4))
    b.prompt_ids, b.prompt_mask = b.prompt_ids[:, 2:], b.prompt_mask[:, 2:]
    b.completion_ids, b.completion_mask = b.completion_ids[:, :2], b.completion_mask[:, :2]
    merged = concat_rollouts([a, b], pad_id=2)
    assert merged.prompt_ids.shape == (12, a.prompt_ids.shape[1])
    assert merged.completion_ids.shape == (12, a.completion_ids.shape[1])
    assert torch.equal(merged.prompt_ids[8:, 2:], b.prompt_ids) and (merged.prompt_mask[8:, :2] == 0).all()
    assert torch.equal(merged.completion_ids[8:, :2], b.completion_ids) and (merged.completion_mask[8:, 2:] == 0).all()


@pytest.mark.parametrize("objective", [SCGRPO(), SelfDistillation(), SelfDistillation(grpo_coef=1.0),
                                       HighEntropyGRPO(), DAPO(overlong_buffer=2)],
                         ids=["scgrpo", "selfdistill", "selfdistill+grpo", "high_entropy", "dapo"])
def test_each_objective_trains_the_adapters(objective, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=objective, log_completions_every_n_steps=1)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    trainer = tiny_trainer(tmp_path, max_steps=3)
    data = tiny_data()
    trainer.fit(module, datamodule=data)
    changed = [n for n, p in module.policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed
    assert len(data.verified_buffer) > 0  # verified rollouts were stored for later steps
    if isinstance(objective, SCGRPO):
        page = open(os.path.join(trainer.log_dir, "credit_heatmap.html")).read()
        assert "<span title=\"w=" in page


def test_high_entropy_mask_keeps_the_top_share():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.8, 0.2, 0.7, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    kept = HighEntropyGRPO(rho=0.3).token_mask(entropy, mask)  # 7 tokens; the top 30%: 0.9, 0.8 (and 0.7 at the edge)
    assert kept[0].tolist() == [0.0, 1.0, 0.0, 0.0] and kept[1, 0] == 1.0 and kept[1, 1] == 0.0
