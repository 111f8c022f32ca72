"""GPU-only checks: the CUDA-graph decode loop and QLoRA (4-bit base) with the self-teacher and reference views.
Skipped without a GPU (and, for QLoRA, without bitsandbytes)."""

from __future__ import annotations

import logging

import pytest
import torch

from scgrpo.rollout.engine import GenerationSettings, decode_loop, eos_token_ids
from tests.helpers import tiny_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _prompts(module):
    return module.actor.format_prompts(["What is 1 + 1?", "Add 12 and 30, then tell me the sum please."])


def test_cuda_graph_decode_equals_plain_decode_and_generate(tiny_model_dir, caplog):
    module = tiny_module(tiny_model_dir, dtype="float32", lora=None)
    module.configure_model()
    module.to("cuda")
    tok = module.tokenizer
    enc = tok(_prompts(module), return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
    eos = eos_token_ids(module.policy, tok)
    args = (module.policy, enc["input_ids"], enc["attention_mask"], 24, eos, tok.pad_token_id)
    module.policy.eval()
    with caplog.at_level(logging.WARNING):
        graphed = decode_loop(*args, greedy=True, cuda_graphs=True)[0]
    assert "CUDA graph recording" not in caplog.text
    plain = decode_loop(*args, greedy=True, cuda_graphs=False)[0]
    assert torch.equal(graphed, plain)
    with torch.no_grad():
        reference = module.policy.generate(**enc, max_new_tokens=24, do_sample=False, eos_token_id=eos,
                                           pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
    width = min(reference.shape[1], graphed.shape[1])
    assert torch.equal(graphed[:, :width], reference[:, :width])


def test_cuda_graph_sampling_is_reproducible_and_fills_lengths(tiny_model_dir):
    module = tiny_module(tiny_model_dir, dtype="bfloat16",
                         generation=GenerationSettings(num_generations=4, max_new_tokens=16, min_new_tokens=16))
    module.configure_model()
    module.to("cuda")
    torch.manual_seed(3)
    a = module.actor.sample(_prompts(module), 4)
    torch.manual_seed(3)
    b = module.actor.sample(_prompts(module), 4)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.completion_ids.shape == (8, 16) and bool((a.completion_mask.sum(1) == 16).all())


def test_qlora_step_with_teacher_and_reference_views(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    from scgrpo.objectives import SCGRPO

    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, dtype="bfloat16", quantization="nf4", objective=SCGRPO(beta=0.04),
                         gradient_checkpointing=True)
    module.configure_model()
    module.to("cuda")
    quantized = [m for m in module.policy.modules() if type(m).__name__ == "Linear4bit"]
    assert quantized and all(m.weight.dtype == torch.bfloat16 for m in quantized)  # bf16 storage words
    assert not any(p.requires_grad for n, p in module.policy.named_parameters() if "lora_" not in n)
    prompts = ["What is 1 + 1?", "What is 2 + 3?"]
    g = module.actor.sample(module.actor.format_prompts(prompts), 4)
    from scgrpo.rollout.types import RolloutBatch
    from scgrpo.update import StepSums

    rollouts = RolloutBatch(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.truncated, 4,
                            ["a"] * 4 + ["b"] * 4, [prompts[0]] * 4 + [prompts[1]] * 4, [2] * 4 + [5] * 4,
                            g.completions, rewards=torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1], device="cuda"))
    module.manual_backward = lambda loss: loss.backward()
    module.actor.score(rollouts, module.objective.needs.old_logprobs, module.objective.needs.ref_logprobs)  # the reference view: adapters off on the 4-bit base
    assert rollouts.ref_logprobs is not None and torch.isfinite(rollouts.ref_logprobs).all()
    signal = module.run_self_teacher(rollouts)
    update = module.policy_update()
    plan = update.plan(rollouts, signal)
    sums = StepSums()
    update.accumulate(rollouts, plan, sums)
    assert sums["nonfinite"] == 0 and torch.isfinite(torch.tensor(sums["loss"]))
    divergences = signal.divergence[signal.has_teacher]
    assert signal.has_teacher.any() and (divergences >= 0).all() and divergences.sum() > 0  # the teacher saw references
    grads = [p.grad for n, p in module.policy.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)


@pytest.mark.parametrize("dtype,slots", [("float32", 0), ("bfloat16", 0), ("float32", 3)])
def test_kept_states_through_cuda_graphs_give_the_forwards_divergences(tiny_model_dir, dtype, slots, monkeypatch):
    """The sampler's states, written by recorded decode steps (and prefills) into the stage and emptied through
    pinned buffers while the next steps run, are the forward pass's final states: the self-teacher's D from them
    equals D from its student forward (fp32: to rounding; bf16: to the kernels' rounding, far below D itself). With
    3 slots for 8 rows and a stage of one burst, rows are admitted as others end and the stage is emptied often."""
    from scgrpo.objectives import SCGRPO
    from scgrpo.rollout import slots as slots_module
    from scgrpo.rollout.types import PromptBatch

    if slots:
        monkeypatch.setattr(slots_module, "STAGE_STEPS", 1)  # (at least one burst: 8 steps)
    module = tiny_module(tiny_model_dir, dtype=dtype, objective=SCGRPO(),
                         generation=GenerationSettings(num_generations=4, max_new_tokens=24, max_slots=slots,
                                                       student_states="rollout"))
    module.configure_model()
    module.to("cuda")
    module.setup("fit")
    with torch.no_grad():  # sharper distributions: KLs of ~0.1-1
        module.policy.get_base_model().model.norm.weight.mul_(8.0)
    assert module.rollout_stage.states
    torch.manual_seed(0)
    rollouts = module.rollout_stage.sample(PromptBatch(ids=["a", "b"], questions=["What is 1 + 1?", "Add 12 and 30."],
                                                   answers=[2, 42]))
    assert rollouts.stats.sampler["rollout/graphs_recorded"] >= 1
    if slots:
        assert rollouts.stats.sampler["rollout/prefills"] > 1
    states = rollouts.student_states
    assert states.device.type == "cpu" and states.shape[:2] == rollouts.completion_ids.shape
    rollouts.rewards = torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0], device="cuda")
    kept = module.run_self_teacher(rollouts)
    rollouts.student_states = None  # (as the step drops them: the student's forward pass next)
    forward = module.run_self_teacher(rollouts)
    active = rollouts.completion_mask.bool() & kept.has_teacher.unsqueeze(1)
    assert active.sum() > 50 and forward.divergence[active].mean() > 0.05
    diff = (kept.divergence - forward.divergence)[active].abs()
    if dtype == "float32":
        assert diff.max() < 1e-3
    else:
        assert diff.mean() < 0.1 * forward.divergence[active].mean()
