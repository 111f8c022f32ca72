"""The compact rollout engine against Hugging Face: greedy tokens, LoRA unmerged, slots (refill, compaction),
the sampler's distribution and log-probabilities, and the fallback for other architectures (CPU, fp32)."""

from __future__ import annotations

import logging

import pytest
import torch

from scgrpo.rollout.compact import CompactDecoder
from scgrpo.rollout.engine import GenerationSettings, generate, sample_tokens
from scgrpo.rollout.model_parts import unsupported_reason
from scgrpo.rollout.slots import SlotDecoder
from tests.conftest import build_tokenizer

CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # 0.999 quantiles by dof
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # per-head q/k norms
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
}


def tiny(family: str, vocab: int, seed: int = 0, **overrides):
    import transformers

    config_name, model_name, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, config_name)(**{
        **dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               initializer_range=0.2),  # varied greedy continuations (the default 0.02 repeats one token)
        **extra, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def with_lora(model, seed: int = 1):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # a large update: merged and base models differ visibly
    return peft_model.eval()


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def batch(tok):
    texts = ["hello there", "a", "what is 2+2? answer:", "zzz", "The quick brown fox", "1 2 3 4 5 6 7 8"]
    return tok(texts, return_tensors="pt", padding=True)


def hf_greedy(model, batch, new: int, eos=None):
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=2, eos_token_id=eos)
    return out[:, batch["input_ids"].shape[1]:]


def compact_greedy(model, batch, new: int, eos=(), **kwargs):
    sampler = SlotDecoder(CompactDecoder(model), list(eos), 2, new, greedy=True, **kwargs)
    return sampler(batch["input_ids"], batch["attention_mask"])[0], sampler


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_greedy_equals_generate_for_each_family(family, tok, batch):
    model = tiny(family, len(tok))
    assert unsupported_reason(model, 100) is None
    ours, _ = compact_greedy(model, batch, 24)
    assert torch.equal(ours, hf_greedy(model, batch, 24))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_unmerged_lora_equals_the_merged_model(family, tok, batch):
    model = with_lora(tiny(family, len(tok)))
    ours, _ = compact_greedy(model, batch, 24)
    base = hf_greedy(tiny(family, len(tok)), batch, 24)
    merged = hf_greedy(model.merge_and_unload(), batch, 24)
    assert torch.equal(ours, merged)
    assert not torch.equal(merged, base)  # the adapters change the tokens: the test sees them


def test_adapter_updates_reach_the_next_rollout_in_place(tok, batch):
    """The concatenated weights are refreshed in place after the optimiser changes the adapters (recorded
    graphs keep valid pointers), and the tokens follow the new adapters."""
    model = with_lora(tiny("llama", len(tok)))
    decoder = CompactDecoder(model)
    sampler = SlotDecoder(decoder, [], 2, 16, greedy=True)
    qkv = decoder.layers[0].qkv
    pointer, version = qkv.weight.data_ptr(), decoder.version
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param))
    decoder.refresh()
    assert qkv.weight.data_ptr() == pointer and decoder.version == version
    ours = sampler(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(ours, hf_greedy(model.merge_and_unload(), batch, 16))


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 1.0, 3),
                                                      (0.9, 0.9, 4)])
def test_first_token_distribution_matches_the_filtered_softmax(temperature, top_p, top_k):
    """Chi-square goodness of fit of 40,000 draws against softmax(logits / T) after top-k and top-p."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, generator=gen) * 2
    draws = 40_000
    torch.manual_seed(1)
    tokens, logprob, entropy = sample_tokens(logits.expand(draws, 8), torch.rand(draws, 1), temperature, top_p, top_k)
    probs = torch.softmax(logits[0] / temperature, -1)
    expected = probs.clone()
    if top_k:
        expected[probs < probs.topk(top_k).values[-1]] = 0
    if top_p < 1:
        order = expected.argsort(descending=True)
        before = expected[order].cumsum(0) - expected[order]
        expected[order[before > top_p * expected.sum()]] = 0
    expected = expected / expected.sum()
    counts = torch.bincount(tokens, minlength=8).double()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # filtered tokens are never drawn
    observed, wanted = counts[keep], expected[keep].double() * draws
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(keep.sum()) - 1
    assert dof >= 1  # the case keeps several tokens: the test has something to compare
    assert statistic < CHI2_999[dof]  # P(chi2 > CHI2_999[dof]) = 0.001 under the null
    # log-probability under the distribution drawn from (filtered, renormalised); entropy of the unfiltered one
    assert torch.allclose(logprob, torch.log(expected)[tokens].float(), atol=1e-5)
    assert torch.allclose(entropy[0], -(probs * probs.log()).sum(), atol=1e-6)


def test_sampler_logprobs_equal_the_trainers(tiny_model_dir):
    from tests.helpers import sampler_vs_trainer, tiny_module

    module = tiny_module(tiny_model_dir, dtype="float32",
                         generation=GenerationSettings(num_generations=3, max_new_tokens=12, temperature=0.8))
    module.configure_model()
    torch.manual_seed(0)
    generated = module.actor.sample(module.actor.format_prompts(["What is 1 + 1?", "Add 12 and 30."]), 3)
    assert generated.stats["rollout/slots"] == 6  # the compact engine sampled
    diff, mask = sampler_vs_trainer(module, generated)
    assert float(diff[mask].max()) < 1e-4
    assert bool((generated.sampler_logprobs[~mask] == 0).all())


def test_adapters_the_compact_forward_does_not_run_are_named(tok):
    from peft import LoraConfig, get_peft_model

    def adapted(**lora):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **lora)
        return get_peft_model(tiny("llama", len(tok)), config)

    assert unsupported_reason(adapted(), 100) is None
    assert unsupported_reason(adapted(use_dora=True), 100) == "DoRA adapters"
    assert unsupported_reason(adapted(lora_bias=True), 100) == "LoRA with biases"
    sharded = adapted()

    class FullyShardedDataParallel(torch.nn.Module):  # (a class of that name anywhere in the model)
        pass

    sharded.base_model.model.model.layers[0].add_module("wrap", FullyShardedDataParallel())
    assert unsupported_reason(sharded, 100) == "sharded (FSDP) weights"


def test_other_architectures_fall_back_to_the_hugging_face_forward(tok, batch, caplog):
    model = tiny("llama", len(tok), hidden_act="gelu")
    assert "activation" in unsupported_reason(model, 100)
    window = tiny("mistral", len(tok), sliding_window=16)
    assert "sliding-window" in unsupported_reason(window, 100) and unsupported_reason(window, 16) is None

    class Tokenizer:  # the bits of a tokenizer generate() uses, around the shared byte-level one
        pad_token_id, eos_token_id = 2, 2

        def __call__(self, texts, **kwargs):
            return tok(texts, **kwargs)

        def batch_decode(self, ids, **kwargs):
            return tok.batch_decode(ids, **kwargs)

    from scgrpo.rollout.backends import CompactSampler

    settings, backend = GenerationSettings(num_generations=2, max_new_tokens=10), CompactSampler()
    with caplog.at_level(logging.INFO, logger="scgrpo.rollout.backends.compact"):
        out = generate(model, Tokenizer(), ["hello", "a b"], 1, settings, torch.device("cpu"), greedy=True,
                       sampler=backend)
        generate(model, Tokenizer(), ["hello", "a b"], 1, settings, torch.device("cpu"), greedy=True, sampler=backend)
    assert caplog.text.count("compact decode forward not used (activation 'gelu')") == 1  # logged once a backend
    assert torch.equal(out.completion_ids[:, :10], hf_greedy(model, tok(["hello", "a b"], return_tensors="pt",
                                                                        padding=True), 10, 2)[:, : out.completion_ids.shape[1]])
    assert out.stats == {}


def test_generation_settings_reject_unknown_engine_options():
    with pytest.raises(ValueError, match="decode_forward"):
        GenerationSettings(decode_forward="fast")
    with pytest.raises(ValueError, match="compile"):
        GenerationSettings(compile="yes")
    with pytest.raises(ValueError, match="max_slots"):
        GenerationSettings(max_slots=-1)


def test_refresh_follows_adapter_switches_trainable_biases_and_data_updates(tok, batch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("qwen2", len(tok)), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                bias="all", lora_dropout=0.0), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], lora_dropout=0.0))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.eval()
    decoder = CompactDecoder(model)
    sampler = SlotDecoder(decoder, [], 2, 12, greedy=True)

    def check():
        decoder.refresh()
        ours = sampler(batch["input_ids"], batch["attention_mask"])[0]
        assert torch.equal(ours, hf_greedy(model, batch, 12))

    check()
    model.set_adapter("b")  # same rank, another projection: the old adapter's block must not linger
    check()
    with torch.no_grad():  # biases train under bias="all" while base weights stay frozen
        model.base_model.model.model.layers[0].self_attn.k_proj.bias.add_(3.0)
    check()
    weight = model.base_model.model.model.layers[1].mlp.up_proj.weight
    weight.data.mul_(-2.0)  # a frozen base weight edited behind autograd's back: no version counter moves
    check()
    weight.requires_grad_(True)  # and a trained one
    weight.data.mul_(0.5)
    check()


def test_quantised_weights_are_not_read_as_plain_floats(tok):
    from scgrpo.rollout.model_parts import is_plain

    class Params4bit(torch.nn.Parameter):  # bitsandbytes packs 4-bit weights in (possibly bf16) storage
        pass

    packed = Params4bit(torch.zeros(16, 1, dtype=torch.bfloat16), requires_grad=False)
    assert not is_plain(packed) and is_plain(torch.nn.Parameter(torch.zeros(2, 2)))
    model = tiny("llama", len(tok))
    model.model.layers[0].self_attn.q_proj.weight = packed
    decoder = CompactDecoder(model)
    assert not decoder.layers[0].qkv.fused and not decoder.fused  # runs the layers' own forwards


def test_a_kept_workspace_serves_later_calls_of_other_shapes(tok):
    model = tiny("llama", len(tok))
    sampler = SlotDecoder(CompactDecoder(model), [5, 9], 2, 14, greedy=True, max_slots=4)
    for texts in (["a", "bb bb", "c"], ["a longer prompt than before", "x"], ["a", "bb bb", "c"],
                  [f"p{i}" for i in range(7)]):
        enc = tok(texts, return_tensors="pt", padding=True)
        fresh = SlotDecoder(CompactDecoder(model), [5, 9], 2, 14, greedy=True, max_slots=4)
        expected = fresh(enc["input_ids"], enc["attention_mask"])[0]
        assert torch.equal(sampler(enc["input_ids"], enc["attention_mask"])[0], expected)
    assert len(sampler._states) <= 3  # the full-size state and its compactions, not one per call


def test_a_zero_draw_never_picks_a_filtered_token():
    logits = torch.tensor([[-3.0, 2.0, 1.0, 0.5, -1.0]]).expand(4, 5)
    for top_p, top_k in ((1.0, 2), (0.5, 0), (0.9, 3)):
        tokens, logprob, _ = sample_tokens(logits, torch.zeros(4, 1), 1.0, top_p, top_k)
        assert bool((tokens == 1).all()) and bool(torch.isfinite(logprob).all())  # the first kept token


def test_the_two_level_cdf_inversion_equals_a_full_scan():
    """Block sums then one block's scan pick the same token as searching the whole cumulative sum (float64, so
    rounding cannot move a boundary), including zero-mass tokens and blocks, draws of 0 and near 1, and a
    vocabulary that is not a multiple of the block."""
    from scgrpo.rollout.sampling import invert_cdf

    torch.manual_seed(0)
    probs = torch.rand(6, 37, dtype=torch.float64)
    probs[:, 8:16] = 0.0  # a whole block without mass
    probs[:, ::5] = 0.0
    probs[2, :36] = 0.0  # all mass on the last token
    uniform = torch.rand(6, 200, dtype=torch.float64)
    uniform[:, 0], uniform[:, 1] = 0.0, 1.0 - 1e-12
    for j in range(uniform.shape[1]):
        u = uniform[:, j : j + 1]
        token, total = invert_cdf(probs, u, block=8)
        cdf = probs.cumsum(-1)
        expected = torch.searchsorted(cdf, (u * cdf[:, -1:]).clamp(min=1e-300)).squeeze(1)
        assert torch.equal(token, expected)
        assert bool((probs.gather(1, token[:, None]) > 0).all())
        assert torch.allclose(total, probs.sum(-1))


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "gate_proj", "down_proj"]])
def test_unrolled_low_rank_terms_add_each_layers_own_ranks(tok, targets):
    """The compiled engine's form of LoRA (multiply-adds over each output block's own ranks) equals the matmul
    form, whichever layers carry adapters."""
    from peft import LoraConfig, get_peft_model

    from scgrpo.rollout.layers import ProjectionArgs, step_functions

    model = get_peft_model(tiny("llama", len(tok)), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(3)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    decoder = CompactDecoder(model)
    spans = decoder._block_layout()
    qkv = spans["qkv"]  # (start, end, ranks) per q, k, v
    assert [end - start for start, end, _ in qkv] == [32, 16, 16]
    assert [len(ranks) for _, _, ranks in qkv] == ([4, 4, 4] if targets == "all-linear" else [4, 0, 4])
    shapes = (decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.eps)
    plain, blockwise = step_functions(*shapes), step_functions(*shapes, unrolled=True, blocks=spans)
    dense = step_functions(*shapes, unrolled=True)  # every rank over every column (zeros off the blocks)
    x, attn = torch.randn(5, 32), torch.randn(5, 2, 2, 8)
    cos, sin = decoder.rope_tables(16)
    cos, sin = cos[:5], sin[:5]
    args0, args1 = decoder.layers[0].args(), decoder.layers[1].args()
    with torch.no_grad():
        expected = plain[1](x, attn, *args0.attention_out, cos, sin, *args1.attention_in)
        for funcs in (blockwise, dense):
            got = funcs[1](x, attn, *args0.attention_out, cos, sin, *args1.attention_in)
            for e, g in zip([expected[0], *expected[1]], [got[0], *got[1]]):
                assert torch.allclose(g, e, atol=1e-5, rtol=1e-5)
        head = ProjectionArgs.of(decoder.head)
        logits, states = plain[2](x, attn, *args1.attention_out, decoder.norm, *head)
        got_logits, got_states = blockwise[2](x, attn, *args1.attention_out, decoder.norm, *head)
        assert torch.allclose(got_logits, logits, atol=1e-5, rtol=1e-5)
        assert torch.allclose(got_states, states, atol=1e-5, rtol=1e-5)


def test_auto_counts_the_allocators_unused_reserve_as_memory_left(monkeypatch):
    """Without a budget, the memory left is the card's free memory plus what PyTorch's caching allocator holds
    reserved but unused: after an update that filled the cache, a copy that fits in the two is made resident,
    and the KV cache gets the slots that fit in a quarter of the two."""
    from types import SimpleNamespace

    from scgrpo.rollout import compact

    mib = 2**20
    linears = [SimpleNamespace(weight=SimpleNamespace(device=torch.device("cuda", 0))) for _ in range(4)]
    monkeypatch.setattr(compact, "four_bit_state", lambda w: SimpleNamespace(shape=(4096, 4096), dtype=torch.bfloat16))
    reserved = {"value": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * mib, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000 * mib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1000 * mib + reserved["value"])
    mode = lambda kept=False: CompactDecoder._four_bit_mode("auto", linears, None, kept)  # noqa: E731
    assert compact.memory_free(torch.device("cuda", 0)) == 100 * mib
    assert mode() == "streamed"  # a 128 MiB copy, 100 MiB free, nothing cached
    reserved["value"] = 200 * mib
    assert compact.memory_free(torch.device("cuda", 0)) == 300 * mib
    assert mode() == "resident" and mode(kept=True) == "streamed"  # half of 300 MiB holds it, a quarter does not
    # a budget counts what is allocated against it, whatever the allocator caches
    assert CompactDecoder._four_bit_mode("auto", linears, 1000 * mib + 200 * mib, False) == "streamed"
    assert CompactDecoder._four_bit_mode("auto", linears, 1000 * mib + 300 * mib, False) == "resident"
    # slots: a quarter of the memory left over 10 MiB of KV cache a row (the fp32 logits count only with a budget)
    slots = SimpleNamespace(max_slots=0, device=torch.device("cuda", 0), memory_budget=None,
                            decoder=SimpleNamespace(cache_bytes_per_row=lambda length: 10 * mib, embed=torch.empty(8, 1)))
    assert SlotDecoder.slot_budget(slots, rows=64, cache_len=1024) == 7  # 0.25 * 300 MiB / 10 MiB
    reserved["value"] = 0
    assert SlotDecoder.slot_budget(slots, rows=64, cache_len=1024) == 2  # 0.25 * 100 MiB / 10 MiB
    # a budget that holds fewer rows at the bucketed length (1,280 entries for 1,090) than at 1,152: the tighter one
    slots = SimpleNamespace(max_slots=0, refill=True, device=torch.device("cuda", 0), memory_budget=1000 * mib + 100 * mib,
                            decoder=SimpleNamespace(cache_bytes_per_row=lambda length: length * mib // 128,
                                                    embed=torch.empty(8, 1)))
    slots.slot_budget = lambda rows, length, prompt_tokens=0: SlotDecoder.slot_budget(slots, rows, length, prompt_tokens)
    assert slots.slot_budget(10, 1280) == 8 and slots.slot_budget(10, 1152) == 9  # 0.9 x 100 MiB over 10 and 9 MiB
    assert SlotDecoder.cache_length(slots, rows=10, positions=1090) == 1152
    assert SlotDecoder.cache_length(slots, rows=8, positions=1090) == 1280  # every row fits either way: the bucket
    assert SlotDecoder.cache_length(slots, rows=10, positions=1000) == 1024  # (the bucket is 64-wide below 1,024)
    # a prefill of the rows' prompts counts against the budget: 10 prompts of 200 tokens at 10 KiB a token
    slots.decoder.prefill_bytes = lambda tokens: tokens * 10 * 2**10
    assert slots.slot_budget(10, 1152, prompt_tokens=200) == 8  # 0.9 x (100 - 19.5) MiB over 9 MiB
    slots.memory_budget = None
    assert SlotDecoder.cache_length(slots, rows=10, positions=1090) == 1280  # no budget: the bucket


@pytest.mark.parametrize("keep_workspace", [True, False])
def test_one_model_state_checks_and_refreshes_once_for_calls_within_the_reserve(tok, monkeypatch, keep_workspace):
    """The turns of an episode batch (calls of growing prompts, one reserve) walk the model for the support check
    and refresh the adapters' copies at the first call only; outside the block every call does both. Without kept
    workspaces each call releases the weight copies, so each call inside the block refreshes them again."""
    from scgrpo.rollout import model_parts
    from scgrpo.rollout.backends import CompactSampler
    from scgrpo.rollout.engine import GenerationSettings, generate_ids

    model = with_lora(tiny("llama", len(tok)))
    counts = {"check": 0, "refresh": 0}
    check, refresh = model_parts.unsupported_reason, CompactDecoder.refresh

    def counted_check(*args):
        counts["check"] += 1
        return check(*args)

    def counted_refresh(self):
        counts["refresh"] += 1
        return refresh(self)

    monkeypatch.setattr(model_parts, "unsupported_reason", counted_check)
    monkeypatch.setattr(CompactDecoder, "refresh", counted_refresh)
    settings = GenerationSettings(num_generations=2, max_new_tokens=4, keep_workspace=keep_workspace)
    prompts = [torch.randint(3, 50, (3, width)) for width in (5, 9, 14)]

    sampler = CompactSampler()

    def turns():
        return [generate_ids(model, tok, ids, torch.ones_like(ids), settings, greedy=True, reserve=(3, 40),
                             texts=False, sampler=sampler) for ids in prompts]

    with sampler.one_model_state():
        inside = turns()
    assert counts == ({"check": 1, "refresh": 1} if keep_workspace else {"check": 3, "refresh": 3})
    assert all(out.completions == [] for out in inside)
    counts.update(check=0, refresh=0)
    outside = turns()
    assert counts == {"check": 3, "refresh": 3}
    assert all(torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(inside, outside))
    with sampler.one_model_state():  # a call longer than the reserve checked before is checked again
        generate_ids(model, tok, prompts[0], torch.ones_like(prompts[0]), settings, greedy=True, reserve=(3, 40),
                     sampler=sampler)
        counts.update(check=0, refresh=0)
        longer = torch.randint(3, 50, (3, 60))
        generate_ids(model, tok, longer, torch.ones_like(longer), settings, greedy=True, sampler=sampler)
    assert counts["check"] == 1
    sampler.release()


def _forward_states(model, batch, tokens):
    """``[N, C, H]`` a plain forward's final hidden states before each of ``tokens`` ``[N, C]`` after the prompts."""
    full = torch.cat([batch["input_ids"], tokens], 1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(tokens)], 1)
    with torch.no_grad():
        hidden = model(input_ids=full, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    tp = batch["input_ids"].shape[1]
    return hidden[:, tp - 1 : -1]


