"""Quick check of the CUDA path on a randomly initialised model with SmolLM2-135M's shapes.

    python scripts/gpu_probe.py   (on a GPU machine; writes $OUT/gpu_probe.json when OUT is set)

Times this package's decode loop against ``model.generate`` (same batch, 128 new tokens forced, sampling),
and one LoRA forward+backward through the chunked log-prob path, in bf16; prints versions and the card.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from scgrpo.objectives.functional import chunked_token_logprobs
from scgrpo.rollout.engine import decode_loop

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)


def timed(fn, repeats=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(device, torch.bfloat16).eval()
    result = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__}
    new = 128
    for rows in (64, 256):
        prompt = torch.randint(3, 49000, (rows, 48), device=device)
        mask = torch.ones_like(prompt)
        ours = timed(lambda: decode_loop(model, prompt, mask, new, [2], 2, min_new_tokens=new)[0])
        hf = timed(lambda: model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=True, top_k=None, pad_token_id=2))
        result[f"decode_loop_{rows}_tok_s"] = rows * new / ours
        result[f"hf_generate_{rows}_tok_s"] = rows * new / hf
    policy = get_peft_model(model.float().to(torch.bfloat16), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    policy.train()
    ids = torch.randint(3, 49000, (32, 192), device=device)

    def step():
        hidden = policy.get_base_model().model(input_ids=ids).last_hidden_state[:, -129:-1]
        lp, _ = chunked_token_logprobs(hidden, policy.get_base_model().lm_head, ids[:, -128:])
        lp.mean().backward()

    torch.cuda.reset_peak_memory_stats()
    result["lora_fwd_bwd_32x192_s"] = timed(step)
    result["lora_fwd_bwd_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_probe.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
