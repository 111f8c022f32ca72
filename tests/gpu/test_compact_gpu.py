"""GPU checks of the compact rollout engine: CUDA graphs, compiled code and the block kernels change no token (tiny model, fp32),
and on the real SmolLM2 (``SCGRPO_REAL_MODEL`` = its GGUF file or folder) greedy decoding equals
``generate`` for 64 chat prompts in fp32; the bf16 agreement and the sampler-vs-trainer log-probability gap
are measured and, with ``SCGRPO_GPU_REPORT`` set, written there as JSON. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from scgrpo.rollout.compact import CompactDecoder
from scgrpo.rollout.slots import SlotDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

QUESTIONS = [f"What is {a} + {b}? Answer with the number." for a, b in zip(range(11, 75), range(40, 104))]


def _report(key: str, value) -> None:
    path = os.environ.get("SCGRPO_GPU_REPORT")
    if not path:
        return
    data = json.load(open(path)) if os.path.exists(path) else {}
    data["card"] = torch.cuda.get_device_name()
    data["command"] = (f"SCGRPO_REAL_MODEL={os.environ.get('SCGRPO_REAL_MODEL', '')} SCGRPO_GPU_REPORT={path} "
                       "python -m pytest " + " ".join(sys.argv[1:]))
    data[key] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _tiny(tiny_model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).cuda().eval()
    return model, tok


def _encode(tok, texts):
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")


def test_graphs_compile_compaction_and_refill_change_no_token(tiny_model_dir):
    model, tok = _tiny(tiny_model_dir)
    enc = _encode(tok, [f"question {i}: " + "x" * (i % 7) for i in range(24)])
    outputs = {}
    for name, compiled, graphs, slots in [("eager", False, False, 0), ("graphs", False, True, 0),
                                          ("compiled", True, True, 0), ("refill", True, True, 5),
                                          ("blocks", True, True, 0), ("blocks_refill", True, True, 5)]:
        decoder = CompactDecoder(model, compile_layers=compiled, block_kernels=name.startswith("blocks"))
        sampler = SlotDecoder(decoder, [2], tok.pad_token_id, 40, greedy=True, cuda_graphs=graphs, max_slots=slots)
        outputs[name] = sampler(enc["input_ids"], enc["attention_mask"])[0]
        if name.endswith("refill"):
            assert sampler.stats["rollout/prefills"] > 1
        if compiled:
            assert not decoder.compile_failed
    with torch.no_grad():
        reference = model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=2,
                                   pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
    for name, tokens in outputs.items():
        width = min(tokens.shape[1], reference.shape[1])
        assert torch.equal(tokens[:, :width], reference[:, :width]), name


def test_lean_workspace_frees_caches_between_graphs_and_keeps_tokens():
    """Without kept workspaces, compaction drops the bigger cache and its graphs mid-rollout and the next graphs
    are recorded in a new pool; rollouts in a row give the kept-workspace tokens and hold no more memory."""
    from tests.conftest import build_tokenizer
    from tests.rollout.test_compact import tiny

    tok = build_tokenizer()
    tok.padding_side = "left"
    model = tiny("llama", len(tok)).cuda()  # varied greedy continuations: rows end at different steps
    enc = _encode(tok, [f"row {i} " + "ab" * (i % 5) for i in range(16)])
    decoder = CompactDecoder(model, compile_layers=True)

    def sampler(eos):
        return SlotDecoder(decoder, eos, 2, 30, greedy=True, check_every=1)

    free = sampler([])(enc["input_ids"], enc["attention_mask"])[0]
    eos = sorted({int(free[i, 2 + (i % 12)]) for i in range(16)})
    kept = sampler(eos)
    expected = kept(enc["input_ids"], enc["attention_mask"])[0]
    assert kept.stats["rollout/compactions"] >= 1
    lean = sampler(eos)
    lean.keep_workspace = False
    held = []
    for _ in range(3):
        tokens = lean(enc["input_ids"], enc["attention_mask"])[0]
        assert torch.equal(tokens, expected)
        assert lean.stats["rollout/compactions"] >= 1 and lean.stats["rollout/graphs_recorded"] >= 2
        assert lean._states == {} and lean.pool is None
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    # recording graphs again leaves nothing behind (one warm-up stream: cuBLAS keeps a workspace per stream)
    assert held[1] == held[2]


def test_sampling_in_graphs_is_reproducible(tiny_model_dir):
    model, tok = _tiny(tiny_model_dir, torch.bfloat16)
    enc = _encode(tok, ["a", "bb", "ccc", "dddd"] * 4)
    decoder = CompactDecoder(model, compile_layers=True)
    sampler = SlotDecoder(decoder, [2], tok.pad_token_id, 32, min_new_tokens=32)
    torch.manual_seed(5)
    a, lp_a, _ = sampler(enc["input_ids"], enc["attention_mask"])
    torch.manual_seed(5)
    b, lp_b, _ = sampler(enc["input_ids"], enc["attention_mask"])
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    assert a.shape == (16, 32) and bool((lp_a < 0).all())


@pytest.fixture(scope="module")
def smollm2():
    source = os.environ.get("SCGRPO_REAL_MODEL")
    if not source:
        pytest.skip("SCGRPO_REAL_MODEL (the SmolLM2 GGUF file or folder) not set")
    from scgrpo.models import load_tokenizer, resolve_model

    folder = resolve_model(source)
    tok = load_tokenizer(folder)
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    return folder, tok, prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_smollm2_greedy_equals_generate(smollm2, dtype):
    from transformers import AutoModelForCausalLM

    folder, tok, prompts = smollm2
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    enc = _encode(tok, prompts)
    eos = [tok.eos_token_id]
    decoder = CompactDecoder(model, compile_layers=True)
    ours = SlotDecoder(decoder, eos, tok.pad_token_id, 64, greedy=True)(enc["input_ids"], enc["attention_mask"])[0]
    with torch.no_grad():
        reference = model.generate(**enc, max_new_tokens=64, do_sample=False, eos_token_id=eos,
                                   pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
    width = min(ours.shape[1], reference.shape[1])
    same = (ours[:, :width] == reference[:, :width]).long().cumprod(1)
    agreement = float(same.sum()) / same.numel()
    rows_equal = float((same.sum(1) == width).float().mean())
    _report(f"smollm2_greedy_vs_generate_{str(dtype).split('.')[-1]}",
            {"token_agreement": agreement, "rows_identical": rows_equal, "prompts": len(prompts), "new_tokens": 64})
    if dtype == torch.float32:
        assert rows_equal == 1.0


def test_real_smollm2_sampler_logprobs_match_the_trainer(smollm2):
    """The sampler's log-probability of its own tokens against the training forward (the module's
    ``token_logprobs``): within 1e-3 in fp32 on the GPU (TF32 off), and the bf16 gap measured."""
    from scgrpo.rollout.engine import GenerationSettings
    from tests.helpers import sampler_vs_trainer, tiny_module

    folder, tok, prompts = smollm2
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {}
    for dtype in ("float32", "bfloat16"):
        module = tiny_module(folder, dtype=dtype, generation=GenerationSettings(num_generations=2, max_new_tokens=48))
        module.configure_model()
        module.to("cuda")
        torch.manual_seed(0)
        generated = module.actor.sample(prompts[:32], 2)
        diff, mask = sampler_vs_trainer(module, generated)
        diff = diff[mask]
        result[dtype] = {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(mask.sum())}
        if dtype == "float32":
            assert float(diff.max()) < 1e-3
    _report("smollm2_sampler_vs_trainer_logprob_abs_diff", result)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "gate_proj", "down_proj"]])
def test_compiled_unmerged_lora_equals_the_merged_model(targets, blocks):
    """The engine's LoRA terms, greedy in fp32, give the merged model's tokens: compiled (multiply-adds over each
    layer's own ranks, fused by the compiler) and in the block kernels (the default with adapters)."""
    from peft import LoraConfig, get_peft_model

    from tests.conftest import build_tokenizer
    from tests.rollout.test_compact import hf_greedy, tiny

    tok = build_tokenizer()
    tok.padding_side = "left"
    base = tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets)).cuda().eval()
    torch.manual_seed(4)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    enc = _encode(tok, [f"row {i} " + "ab" * (i % 5) for i in range(12)])
    decoder = CompactDecoder(model, compile_layers=True, block_kernels=None if blocks else False)
    tokens = SlotDecoder(decoder, [], 2, 16, greedy=True)(enc["input_ids"], enc["attention_mask"])[0]
    assert not decoder.compile_failed and decoder.block_kernels == blocks
    assert blocks or decoder._spans is not None
    assert torch.equal(tokens, hf_greedy(model.merge_and_unload(), enc, 16))


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_4bit_runs_are_bitsandbytes_own_dequantization_on_the_gpu(storage):
    bnb = pytest.importorskip("bitsandbytes")
    from scgrpo.rollout.four_bit import Dequantizer, chunk_plan

    torch.manual_seed(0)
    weight = bnb.nn.Params4bit(torch.randn(96, 320, dtype=torch.bfloat16), requires_grad=False,
                               compress_statistics=True, quant_type="nf4", quant_storage=storage).cuda()
    expected = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    d = Dequantizer(weight)
    out = torch.full_like(expected, float("nan"))
    for _, start, end, _ in chunk_plan([d], 7 * 320):  # runs of 6 rows (on whole 64-weight blocks)
        d.into(out[start:end], start, end)
    assert torch.equal(out, expected)


def _divergence_gaps(policy, enc, first: torch.Tensor, second: torch.Tensor) -> list[float]:
    """For each row where two greedy decodes differ: at the first differing position, the gap between the two
    chosen tokens' logits under ``policy`` (prompt and the common prefix, padding dropped), over the largest
    logit's magnitude there."""
    gaps = []
    differ = first != second  # [N, C]
    for i in differ.any(1).nonzero().flatten().tolist():
        p = int(differ[i].nonzero()[0])
        ids = torch.cat([enc["input_ids"][i][enc["attention_mask"][i].bool()], first[i, :p]])[None]
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, -1].float()
        gaps.append(float((logits[first[i, p]] - logits[second[i, p]]).abs() / logits.abs().max()))
    return gaps


def test_4bit_resident_and_streamed_decoding_in_graphs(tmp_path):
    """A QLoRA policy (nf4, bf16 compute, LoRA with non-zero B's) on the GPU: the resident copy is bitsandbytes'
    dequantization, and the streamed runs (block kernels, CUDA graphs) decode the same model: greedy tokens agree
    up to bf16's rounding in other matmul orders."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from scgrpo.models import LoraSettings, load_policy
    from tests.conftest import build_tokenizer
    from tests.rollout.test_compact import tiny

    tok = build_tokenizer()  # a Qwen2 block with heads of 32 (the attention and block kernels' smallest)
    tiny("qwen2", len(tok), hidden_size=128, num_attention_heads=4, intermediate_size=256).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy, tok = load_policy(str(tmp_path), torch.bfloat16, LoraSettings(r=4, alpha=8), "nf4", torch.device("cuda"))
    policy.eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    tok.padding_side = "left"
    enc = _encode(tok, [f"question {i}: " + "x" * (i % 7) for i in range(12)])
    resident = CompactDecoder(policy, compile_layers=True, four_bit="resident")
    streamed = CompactDecoder(policy, compile_layers=True, four_bit="streamed")
    assert streamed.block_kernels and {p.mode for p in streamed._projections} == {"streamed"}
    for proj in resident._projections:
        for target, base in zip(proj._targets, proj.bases):
            assert torch.equal(target, bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state))
    tokens = {}
    for name, decoder in (("resident", resident), ("streamed", streamed)):
        sampler = SlotDecoder(decoder, [], tok.pad_token_id, 24, greedy=True, cuda_graphs=True)
        tokens[name] = sampler(enc["input_ids"], enc["attention_mask"])[0]
        assert sampler.stats["rollout/graphs_recorded"] >= 1
    agree = (tokens["resident"] == tokens["streamed"]).float().mean().item()
    gaps = _divergence_gaps(policy, enc, tokens["resident"], tokens["streamed"])
    _report("qlora_tiny_streamed_vs_resident_greedy_agreement", agree)
    _report("qlora_tiny_streamed_vs_resident_divergence_gaps", gaps)
    # bf16: the same weights in other matmul orders. A greedy decode that differs once differs at every later
    # position, so the positions' agreement says little; what must hold is that each row's first difference is a
    # near tie: the two tokens' logits (the HF forward's, a third matmul order) within bf16's rounding of the scale.
    assert max(gaps, default=0.0) < 0.05, gaps


def test_4bit_streamed_eager_step_with_the_attention_kernel_qwen3(tmp_path):
    """Streamed 4-bit projections outside the block kernels (compile off; a Qwen3 block, whose per-head q/k norms
    the block kernels do not take): the eager step in CUDA graphs with the attention kernel decodes the tokens the
    resident copy decodes (fp32 compute: exact up to matmul order)."""
    pytest.importorskip("bitsandbytes")
    from scgrpo.models import LoraSettings, load_policy
    from tests.conftest import build_tokenizer
    from tests.rollout.test_compact import tiny

    tok = build_tokenizer()
    tiny("qwen3", len(tok), hidden_size=128, num_attention_heads=4, head_dim=32, intermediate_size=256).save_pretrained(
        tmp_path)
    tok.save_pretrained(tmp_path)
    policy, tok = load_policy(str(tmp_path), torch.float32, LoraSettings(r=4, alpha=8), "nf4", torch.device("cuda"))
    policy.eval()
    tok.padding_side = "left"
    enc = _encode(tok, [f"question {i}: " + "x" * (i % 7) for i in range(12)])
    tokens = {}
    for mode in ("resident", "streamed"):
        decoder = CompactDecoder(policy, compile_layers=False, four_bit=mode)
        assert decoder.fused_attention and not decoder.block_kernels and decoder.four_bit == mode
        sampler = SlotDecoder(decoder, [], tok.pad_token_id, 24, greedy=True, cuda_graphs=True)
        tokens[mode] = sampler(enc["input_ids"], enc["attention_mask"])[0]
        assert sampler.stats["rollout/graphs_recorded"] == 1  # one graph per slot count, not per length bucket
    agree = (tokens["resident"] == tokens["streamed"]).float().mean().item()
    assert agree > 0.9


def test_fp32_head_from_bf16_operands_equals_the_upcast_matmul():
    """The teacher pass's fp32 logits from a bf16 head: tensor-core products with fp32 output equal the fp32
    matmul of the upcast operands up to summation order (no bf16 rounding of the logits)."""
    import torch.nn.functional as F

    from scgrpo.objectives.functional import fp32_head, fp32_output_mm_works

    torch.manual_seed(0)
    head = torch.nn.Linear(512, 4096, bias=False).cuda().to(torch.bfloat16)
    hidden = torch.randn(3, 100, 512, device="cuda", dtype=torch.bfloat16)
    assert fp32_output_mm_works(hidden.device)
    ours = fp32_head(head)(hidden)
    exact = F.linear(hidden.float(), head.weight.float())
    assert ours.dtype == torch.float32 and ours.shape == (3, 100, 4096)
    rounded = F.linear(hidden, head.weight).float()  # bf16 logits: what the fp32 path avoids
    assert float((ours - exact).abs().max()) < 1e-4 < float((rounded - exact).abs().max())
