import pytest
import torch

from scgrpo.models import LoraSettings, load_policy
from scgrpo.rollout.engine import (
    GenerationSettings,
    completion_mask_from_eos,
    decode_loop,
    generate,
    merged_adapters,
    sample_from_logits,
)


def test_completion_mask_from_eos():
    ids = torch.tensor([[5, 6, 2, 7, 8], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    mask, truncated = completion_mask_from_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_sampling_matches_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(20000, -1).clone()
    counts = torch.bincount(sample_from_logits(logits), minlength=5).float() / 20000
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)
    assert counts[4] == 0


def test_sampling_temperature_top_k_top_p_and_greedy():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, -1).clone()
    assert set(sample_from_logits(logits, top_k=2).tolist()) == {0, 1}
    # probs at T=1: .644 .237 .087 .032 -> top_p 0.7 keeps tokens 0 and 1 (mass before token 1 is .644 < .7)
    assert set(sample_from_logits(logits, top_p=0.7).tolist()) == {0, 1}
    cold = torch.bincount(sample_from_logits(logits, temperature=0.25), minlength=4).float() / 20000
    expected = torch.softmax(logits[0] / 0.25, -1)
    torch.testing.assert_close(cold, expected, atol=0.01, rtol=0)
    assert sample_from_logits(logits[:3], greedy=True).tolist() == [0, 0, 0]


def test_greedy_decode_loop_equals_hf_generate(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir, torch.float32, None)
    prompts = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "What is 1 + 1?"]
    settings = GenerationSettings(max_new_tokens=12)
    ours = generate(model, tokenizer, prompts, 1, settings, torch.device("cpu"), greedy=True)
    hf = generate(model, tokenizer, prompts, 1, GenerationSettings(max_new_tokens=12, engine="hf"), torch.device("cpu"),
                  greedy=True)
    assert torch.equal(ours.completion_ids, hf.completion_ids[:, : ours.completion_ids.shape[1]])
    assert ours.completions == hf.completions


def test_decode_loop_stops_when_all_rows_end_and_pads_after_eos(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir, torch.float32, None)
    enc = tokenizer(["abc", "a"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = decode_loop(model, enc.input_ids, enc.attention_mask, 6, [2], 2, min_new_tokens=6)[0]
    assert out.shape == (2, 6) and not (out == 2).any()  # eos forbidden for min_new_tokens
    # a head that always prefers eos ends every row after one step
    def prefer_eos(module, inputs, output):
        output = output.clone()
        output[..., 2] = 1e4
        return output

    hook = model.get_output_embeddings().register_forward_hook(prefer_eos)
    try:
        with torch.no_grad():
            out = decode_loop(model, enc.input_ids, enc.attention_mask, 6, [2], 2, greedy=True)[0]
    finally:
        hook.remove()
    assert out.tolist() == [[2], [2]]


def test_sampling_entropy_equals_the_entropy_of_a_full_forward_on_the_sampled_tokens(tiny_model_dir):
    """policy/entropy's source: the sampler's per-row sum of H(softmax(logits / T)) over each completion's
    tokens equals the same sum from one teacher-forced forward over prompt + completion, padding excluded."""
    model, tokenizer = load_policy(tiny_model_dir, torch.float32, None)
    with torch.no_grad():  # sharper distributions than a random init: entropies well away from log V
        model.model.norm.weight.mul_(4.0)
    torch.manual_seed(0)
    out = generate(model, tokenizer, ["What is 1 + 1?", "hi"], 2, GenerationSettings(max_new_tokens=7, temperature=0.7),
                   torch.device("cpu"))
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    c = out.completion_ids.shape[1]
    logp = torch.log_softmax(logits[:, -c - 1 : -1].double() / 0.7, -1)
    expected = (-(logp.exp() * logp).sum(-1) * out.completion_mask).sum(1)  # [N]
    torch.testing.assert_close(out.entropy_sum.double(), expected, atol=1e-4, rtol=1e-4)
    assert generate(model, tokenizer, ["hi"], 1, GenerationSettings(max_new_tokens=3), torch.device("cpu"),
                    greedy=True).entropy_sum is None


def test_merged_adapters_match_adapter_forward_and_restore_weights_exactly(tiny_model_dir):
    policy, _ = load_policy(tiny_model_dir, torch.float32, LoraSettings(r=4, alpha=8, extra={"init_lora_weights": False}))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        with_adapters = policy(input_ids=ids).logits
        with merged_adapters(policy) as merged:
            merged_logits = policy(input_ids=ids).logits
        with policy.disable_adapter():
            base = policy(input_ids=ids).logits
    assert merged
    torch.testing.assert_close(merged_logits, with_adapters, atol=1e-5, rtol=1e-5)
    assert (with_adapters - base).abs().max() > 1e-3  # the adapters do something
    for name, p in policy.named_parameters():
        assert torch.equal(p, before[name]), name


def test_generation_settings_reject_bad_values():
    with pytest.raises(ValueError, match="G"):
        GenerationSettings(num_generations=1)
    with pytest.raises(ValueError, match="temperature"):
        GenerationSettings(temperature=0)
    with pytest.raises(ValueError, match="engine"):
        GenerationSettings(engine="vllm")


@pytest.mark.parametrize("dtype, policy, merges", [
    (torch.float32, "auto", True), (torch.bfloat16, "auto", False), (torch.bfloat16, "always", True),
    (torch.float32, "never", False),
])
def test_merge_policy(tiny_model_dir, dtype, policy, merges):
    """bf16 weights are not merged by default: rounding W + BA to bf16 would drop small adapter updates."""
    policy_model, _ = load_policy(tiny_model_dir, dtype, LoraSettings(r=2, alpha=4))
    with merged_adapters(policy_model, policy) as merged:
        assert merged == merges
