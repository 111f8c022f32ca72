
"""The objectives inside the training loop: SC-GRPO's reduction to GRPO, DAPO's sampling, the baselines."""

import os

import pytest
import torch

from scgrpo.objectives import DAPO, GRPO, OPSD, SCGRPO, HighEntropyGRPO, REINFORCEPlusPlus, SelfDistillation
from scgrpo.objectives.dapo import overlong_penalty
from scgrpo.rollout.engine import GenerationSettings, generate
from scgrpo.rollout.types import RolloutBatch
from scgrpo.update import StepSums
from tests.helpers import load_script, tiny_data, tiny_module, tiny_trainer
from tests.test_completions_table import STEP_OUTPUTS, step_numbers


def _rollouts(module, rewards, group_size=4):
    prompts = module.actor.format_prompts(["What is 1 + 1?", "What is 2 + 3?"])
    g = generate(module.policy, module.tokenizer, prompts, group_size, GenerationSettings(max_new_tokens=6), module.device)
    return RolloutBatch(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.truncated, group_size,
                        ["a"] * 4 + ["b"] * 4, ["What is 1 + 1?"] * 4 + ["What is 2 + 3?"] * 4, [2] * 4 + [5] * 4,
                        g.completions, rewards=torch.tensor(rewards))


def _gradients(module, rollouts):
    """Loss and LoRA gradients of one training step's math, without the optimizer."""
    module.manual_backward = lambda loss: loss.backward()
    update = module.policy_update()
    plan = update.plan(rollouts, module.run_self_teacher(rollouts))  # credit, rows in the loss, denominators
    params = [p for p in module.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    sums = StepSums()
    update.accumulate(rollouts, plan, sums)
    return torch.tensor(sums["loss"]), [p.grad.clone() for p in params], plan


def test_single_and_all_correct_groups_give_exactly_grpo(tiny_model_dir):
    """n_c = 1 and n_c = G groups are plain GRPO: loss and every gradient equal GRPO's with the same
    aggregation, bit for bit."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(aggregation="seq-mean-token-mean"))
    module.configure_model()
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # n_c = 1, then n_c = G
    grpo_loss, grpo_grads, _ = _gradients(module, rollouts)
    module.objective = SCGRPO()
    sc_loss, sc_grads, plan = _gradients(module, rollouts)
    assert not plan.signal.has_teacher.any()
    assert torch.equal(sc_loss, grpo_loss)
    for a, b in zip(sc_grads, grpo_grads):
        assert torch.equal(a, b)
    rollouts.rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # a partial-solve group: not GRPO
    module.objective = GRPO(aggregation="seq-mean-token-mean")
    _, grpo_grads, _ = _gradients(module, rollouts)
    module.objective = SCGRPO()
    _, sc_grads, _ = _gradients(module, rollouts)
    assert any(not torch.allclose(a, b) for a, b in zip(sc_grads, grpo_grads))


def test_one_step_equals_the_hand_written_weighted_surrogate(tiny_model_dir):
    """The module's LoRA gradients for a partial-solve and a solve-none group equal those of the paper's
    objective written out by hand on a plain full forward: weights f = D / (D + c) with c = P75 of the active
    divergences (torch.quantile), -(1/N) sum_i 1/|o_i| sum_t f_it A_i rho_it, rho = exp(logp - logp.detach())."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO())
    module.configure_model()
    with torch.no_grad():
        module.policy.get_base_model().model.norm.weight.mul_(8.0)
    rollouts = _rollouts(module, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    loss, grads, plan = _gradients(module, rollouts)
    signal = plan.signal
    mask = rollouts.completion_mask
    active = mask.bool() & signal.has_teacher.unsqueeze(1)
    c = max(float(torch.quantile(signal.divergence[active], 0.75)), 1e-4)
    f = torch.where(signal.has_teacher.unsqueeze(1), signal.divergence / (signal.divergence + c), torch.ones_like(mask))
    advantages = plan.credit.advantages
    std = torch.tensor([1.0, 1.0, 0.0, 0.0]).std()
    torch.testing.assert_close(advantages[:4], torch.tensor([0.5, 0.5, -0.5, -0.5]) / (std + 1e-4))  # Eq. 1 by hand
    assert (advantages[4:] != 0).any()  # the solve-none group carries the diversity advantage (tested by hand apart)
    c_len = rollouts.completion_ids.shape[1]
    params = [p for p in module.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    logits = module.policy(input_ids=rollouts.input_ids, attention_mask=rollouts.attention_mask,
                           position_ids=(rollouts.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, -c_len - 1 : -1].float(), -1).gather(-1, rollouts.completion_ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    per_row = (f * advantages.unsqueeze(1) * ratio * mask).sum(1) / mask.sum(1)
    hand_loss = -(per_row.sum() / mask.shape[0])
    hand_loss.backward()
    assert loss.item() == pytest.approx(hand_loss.item(), abs=1e-6)
    for ours, hand in zip(grads, [p.grad for p in params]):
        torch.testing.assert_close(ours, hand, atol=1e-6, rtol=1e-4)


def test_batch_scope_c_does_not_change_with_micro_batch_size(tiny_model_dir, monkeypatch):
    from scgrpo.policy import PassOptions

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=SCGRPO())
    module.configure_model()
    module.actor.passes = PassOptions(packing=False)  # (packed rows differ with the micro-batches, and so rounding)
    rollouts = _rollouts(module, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    whole_loss, whole, _ = _gradients(module, rollouts)
    module.micro_batch_size = 3
    micro_loss, micro, _ = _gradients(module, rollouts)
    assert micro_loss.item() == pytest.approx(whole_loss.item(), abs=1e-7)
    for a, b in zip(whole, micro):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    module.objective = SCGRPO(c_scope="micro_batch")  # the paper's literal scope does change
    _, literal, _ = _gradients(module, rollouts)
    assert any(not torch.allclose(a, b, atol=1e-7, rtol=1e-5) for a, b in zip(whole, literal))


def test_self_distillation_without_any_reference_is_grpo_not_nan(tiny_model_dir):
    """No row has a verified reference (rewards below the threshold but not equal): the distillation term is
    0 and the loss is GRPO's, not 0/0."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=GRPO(aggregation="seq-mean-token-mean"))
    module.configure_model()
    rollouts = _rollouts(module, [0.5, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0])
    grpo_loss, grpo_grads, _ = _gradients(module, rollouts)
    module.objective = SelfDistillation()
    loss, grads, plan = _gradients(module, rollouts)
    assert not plan.signal.has_teacher.any()
    assert torch.isfinite(loss) and torch.equal(loss, grpo_loss)
    for a, b in zip(grads, grpo_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("objective", [SelfDistillation(), OPSD(teacher="policy")], ids=["additive", "opsd"])
def test_distillation_with_full_fine_tuning_trains_the_head_through_the_distillation_term(objective, tiny_model_dir):
    """All-correct groups with distinct completions: GRPO's advantage is 0 everywhere, so any gradient on the
    output head (tied to the embeddings here) comes from the distillation term alone."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=objective, lora=None)
    module.configure_model()
    rollouts = _rollouts(module, [1.0] * 8)
    loss, grads, plan = _gradients(module, rollouts)
    assert (plan.credit.advantages == 0).all() and plan.signal.has_teacher.all() and loss != 0
    head = module.actor.lm_head().weight
    index = [i for i, p in enumerate(p for p in module.policy.parameters() if p.requires_grad) if p is head]
    assert index and grads[index[0]].abs().sum() > 0


def test_additive_distillation_coefficient_warms_up_linearly():
    objective = SelfDistillation(distill_coef=0.1, distill_coef_start=0.03, warmup_steps=10)
    assert [round(objective.coefficient(s), 6) for s in (0, 5, 10, 20)] == [0.03, 0.065, 0.1, 0.1]
    assert SelfDistillation().coefficient(0) == 0.1


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


@pytest.mark.parametrize("objective", [SCGRPO(), SelfDistillation(), SelfDistillation(divergence="bidirectional"), OPSD(),
                                       HighEntropyGRPO(), DAPO(overlong_buffer=2)],
                         ids=["scgrpo", "selfdistill", "selfdistill-bidirectional", "opsd", "high_entropy", "dapo"])
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
        assert "<span title=\"f=" in page
        _check_token_log(trainer.log_dir, module)
        assert step_numbers(trainer.log_dir) == {name: [0, 1, 2] for name in STEP_OUTPUTS}


def _check_token_log(log_dir, module):
    """credit_tokens.jsonl holds every rollout of each logged step; the last step's weights are the credit's."""
    import json

    with open(os.path.join(log_dir, "credit_tokens.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    steps = sorted({line["step"] for line in lines})
    assert len(steps) == 3 and len(lines) == 3 * 16  # 4 prompts x G = 4, every step
    last = [line for line in lines if line["step"] == steps[-1]]
    weights = module.last_plan.credit.token_weights
    for line in last:
        n = len(line["tokens"])
        assert line["f"] == [round(w, 4) for w in weights[line["row"]][:n].tolist()]
        assert len(line["model"]) == n and all(m in (0, 1) for m in line["model"])
        if not line["has_teacher"]:
            assert all(f == 1.0 for f, m in zip(line["f"], line["model"]) if m)
    result = load_script("weight_shares").weight_shares(lines, "arith")
    taught = sum(len(line["tokens"]) for line in lines if line["has_teacher"])
    assert result["overall"]["pooled"]["tokens"] == taught  # every model token of every row with a teacher


def test_reinforce_pp_step_equals_the_hand_written_kl_shaped_return(tiny_model_dir):
    """One REINFORCE++ step through the module (its scoring pass, credit and update) against the objective
    written out on plain full forwards: k1 KL = log pi(y_t) - log pi_ref(y_t) (adapters off), r_t = -0.1 KL_t with
    R on the last token, G_t the reverse cumulative sum, A = whitened G, loss = -sum A rho / tokens."""
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=REINFORCEPlusPlus(kl_coef=0.1))
    module.configure_model()
    with torch.no_grad():  # adapters away from zero, so that the policy and the reference differ
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    rollouts = _rollouts(module, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    module.actor.score(rollouts, module.objective.needs.old_logprobs, module.objective.needs.ref_logprobs)
    assert rollouts.ref_logprobs is not None and rollouts.old_logprobs is not None
    loss, grads, plan = _gradients(module, rollouts)
    mask = rollouts.completion_mask
    c_len = rollouts.completion_ids.shape[1]
    position_ids = (rollouts.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def logprobs_of(model):
        logits = model(input_ids=rollouts.input_ids, attention_mask=rollouts.attention_mask,
                       position_ids=position_ids).logits
        return torch.log_softmax(logits[:, -c_len - 1 : -1].float(), -1).gather(
            -1, rollouts.completion_ids.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad(), module.policy.disable_adapter():
        ref = logprobs_of(module.policy)
    params = [p for p in module.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    logp = logprobs_of(module.policy)
    token_rewards = -0.1 * (logp.detach() - ref) * mask
    last = (mask * torch.arange(1, c_len + 1)).argmax(1)
    token_rewards[torch.arange(len(last)), last] += rollouts.rewards
    returns = token_rewards.flip(1).cumsum(1).flip(1)
    values = returns[mask.bool()]
    advantages = (returns - values.mean()) / torch.sqrt(values.var() + 1e-8) * mask
    torch.testing.assert_close(plan.credit.token_advantages, advantages, atol=1e-5, rtol=1e-4)
    hand_loss = -(advantages * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
    hand_loss.backward()
    assert loss.item() == pytest.approx(hand_loss.item(), abs=1e-5)
    for ours, hand in zip(grads, [p.grad for p in params]):
        torch.testing.assert_close(ours, hand, atol=1e-5, rtol=1e-3)

