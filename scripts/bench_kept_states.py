"""What keeping the sampler's final states (``generation.student_states: rollout``) costs the rollout.

A random two-layer model as wide as an 8B one (hidden 4,096, Qwen3's 151,936-token head: each decode step's states
are the 8B step's), 64 rows x 1,024 new tokens forced, bf16, CUDA graphs: the median rollout time over ``--repeats``
calls without and with kept states, the time the host spent emptying the stage, and the stage's size.

Usage (on a GPU)::

    python scripts/bench_kept_states.py --repeats 3 --out kept_states.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import transformers

    from scgrpo.rollout import slots as slots_module
    from scgrpo.rollout.compact import CompactDecoder
    from scgrpo.rollout.slots import SlotDecoder

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(device, torch.bfloat16).eval()
    prompts = torch.randint(100, 150000, (args.rows, 48), device=device)
    mask = torch.ones_like(prompts)
    flush_s: list = []
    flush = SlotDecoder._flush

    def timed(self, **kwargs):
        start = time.perf_counter()
        flush(self, **kwargs)
        flush_s.append(time.perf_counter() - start)

    SlotDecoder._flush = timed
    results = {}
    for keep in (False, True, False, True):
        sampler = SlotDecoder(CompactDecoder(model), [], 0, args.new, min_new_tokens=args.new, keep_states=keep)
        sampler(prompts, mask)  # records graphs
        times = []
        for _ in range(args.repeats):
            flush_s.clear()
            torch.cuda.synchronize() if device.type == "cuda" else None
            start = time.perf_counter()
            sampler(prompts, mask)
            torch.cuda.synchronize() if device.type == "cuda" else None
            times.append(time.perf_counter() - start)
        name = "kept_states" if keep else "plain"
        results.setdefault(name, []).extend(times)
        if keep:
            results["flush_s"] = sum(flush_s)
            results["flushes"] = len(flush_s)
            results["stage_steps"] = int(sampler._stage.row.shape[0]) if sampler._stage is not None else 0
        sampler.release()
    summary = {"plain_s": statistics.median(results["plain"]), "kept_states_s": statistics.median(results["kept_states"]),
               "flush_s": results["flush_s"], "flushes": results["flushes"], "stage_steps": results["stage_steps"]}
    summary["overhead_s"] = summary["kept_states_s"] - summary["plain_s"]
    if device.type == "cuda":  # what a fresh pinned host tensor of one call's states takes
        allocs = []
        for _ in range(3):
            start = time.perf_counter()
            buffer = torch.empty(args.rows, args.new, config.hidden_size, dtype=torch.bfloat16, pin_memory=True)
            allocs.append(time.perf_counter() - start)
            del buffer
        summary["pinned_alloc_s"] = allocs
    payload = {"command": "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
               "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
               "rows": args.rows, "new_tokens": args.new, "stage_bytes": slots_module.STAGE_BYTES, **summary,
               "times": results}
    text = json.dumps(payload, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
