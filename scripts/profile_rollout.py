"""Where a compact-engine decode step spends its GPU time: the kernels of a timed rollout under the PyTorch
profiler, grouped by name, as microseconds and launches per decode step.

    python scripts/profile_rollout.py                          # SmolLM2-135M shape, 64 and 512 sequences
    python scripts/profile_rollout.py --cases smollm2_64_lora --top 30

Same models and settings as ``scripts/bench_rollout.py`` (random weights, bf16, 48-token prompts, 128 new
tokens forced). The rollout is run once untimed (graphs, compilation), then once under the profiler. LoRA cases
profile the unmerged adapters. Prints one table per case (the prefill's kernels counted in, spread over
the decode steps) and writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_rollout import CASES, add_lora, build_model, compact_runner  # noqa: E402
from bench_step import card_name  # noqa: E402


def profile_case(name: str, top: int, merged: bool = False, compiled_step: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    spec = CASES[name]
    model = build_model(spec["shape"], spec["family"])
    if spec.get("lora"):
        model = add_lora(model)
        if merged:
            model = model.merge_and_unload()
    n, max_new = spec["seqs"], spec["max_new"]
    torch.manual_seed(2)
    ids = torch.randint(3, 1000, (n, 48), device="cuda")
    run, sampler = compact_runner(model, ids, torch.ones_like(ids), max_new, block_kernels=False if compiled_step else None)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    steps = sampler.stats.get("rollout/decode_steps", max_new)  # the prefill's kernels are spread over them
    rows = []
    total = 0.0
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total += device_us
        rows.append({"kernel": event.key[:110], "us_per_step": device_us / steps, "calls_per_step": event.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    label = name + ("_merged" if merged else "") + ("_compiled_step" if compiled_step else "")
    launches = sum(r["calls_per_step"] for r in rows)
    print(f"\n== {label}: {total / steps:.1f} us of kernels per decode step, {launches:.0f} launches "
          f"({len(rows)} kernel names)")
    for r in rows[:top]:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:7.1f} x  {r['kernel']}")
    del model
    torch.cuda.empty_cache()
    return {"case": label, "kernel_us_per_step": total / steps, "launches_per_step": launches, "kernels": rows[:top],
            "stats": dict(sampler.stats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="smollm2_64,smollm2_512")
    parser.add_argument("--merged", action="store_true", help="also profile LoRA cases merged")
    parser.add_argument("--compiled-step", action="store_true",
                        help="the step as torch.compile'd code between the matmuls, not the Triton block kernels")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_rollout.py profiles GPU kernels; no CUDA device found")
    report = {"card": card_name(), "command": "python scripts/profile_rollout.py " + " ".join(sys.argv[1:]), "cases": []}
    for name in args.cases.split(","):
        report["cases"].append(profile_case(name, args.top, compiled_step=args.compiled_step))
        if args.merged and CASES[name].get("lora"):
            report["cases"].append(profile_case(name, args.top, merged=True, compiled_step=args.compiled_step))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
