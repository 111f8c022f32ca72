"""Times rollouts alone with whatever ``scgrpo`` is on ``PYTHONPATH``: run by ``bench_step.py --before-src DIR``
to time an earlier source tree of the package (``git archive <commit> src``) in the same call as the current one.

    PYTHONPATH=DIR python scripts/sampling_probe.py MODEL_FOLDER ROWS GROUP NEW_TOKENS REPEATS OUT_JSON

Uses only the API both trees share (``load_policy``, ``GenerationSettings``, ``generate``, the arithmetic task), the
same policy and prompts as ``bench_step.run_sampling_cases`` (nf4 base, LoRA r=16 with B drawn from N(0, 0.01) under
seed 1, 64 rows), and writes ``OUT_JSON``: the median of ``REPEATS`` timed calls after an untimed one. It imports
nothing of ``bench_step`` (which would put this tree's ``src`` first on the path); ``bench_step`` imports its setup.
"""

from __future__ import annotations

import json
import inspect
import statistics
import sys
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def qlora_policy_and_prompts(model: str, rows: int, group: int, device: torch.device):
    """The sampling cases' policy (nf4 base, LoRA r=16 whose B's are drawn from N(0, 0.01) under seed 1: adapters
    that change the outputs) in eval mode, its tokenizer (left padding) and ``rows / group`` arithmetic prompts;
    ``bench_step.run_sampling_cases`` uses it too."""
    from scgrpo.data.tasks import ArithmeticTask
    from scgrpo.models import LoraSettings, load_policy

    policy, tokenizer = load_policy(model, torch.bfloat16, LoraSettings(r=16, alpha=32), "nf4", device)
    policy.eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    tokenizer.padding_side = "left"
    questions = [row["question"] for row in ArithmeticTask(seed=0).rows("train")[: rows // group]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    return policy, tokenizer, prompts


def main() -> None:
    model, rows, group, new_tokens, repeats = sys.argv[1], *map(int, sys.argv[2:6])
    out_path = sys.argv[6]
    import scgrpo
    from scgrpo.rollout.engine import GenerationSettings, generate

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    policy, tokenizer, prompts = qlora_policy_and_prompts(model, rows, group, device)
    settings = GenerationSettings(num_generations=group, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    kept = {}  # one backend for every call, its workspace kept (a tree whose engine holds it itself: nothing to pass)
    if "sampler" in inspect.signature(generate).parameters:
        from scgrpo.rollout.backends import make_sampler

        kept["sampler"] = make_sampler(settings)
    torch.manual_seed(0)
    sync()
    first = time.perf_counter()
    generate(policy, tokenizer, prompts, group, settings, device, **kept)
    sync()
    first = time.perf_counter() - first
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        generate(policy, tokenizer, prompts, group, settings, device, **kept)
        sync()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    with open(out_path, "w") as f:
        json.dump({"source": scgrpo.__file__, "rows": rows, "new_tokens": new_tokens, "first_call_s": first,
                   "seconds": times, "median_s": seconds, "ms_per_decode_step": 1000 * seconds / new_tokens,
                   "new_tok_s": rows * new_tokens / seconds}, f)


if __name__ == "__main__":
    main()
