"""Launch settings of the add-and-norm kernel (``scgrpo.rollout.norms.add_norm``): microseconds per call for each
setting, on the SmolLM2-135M decode shapes, with and without LoRA terms, beside the compiled PyTorch it
replaces (``torch.compile`` of the residual add and RMSNorm, no LoRA).

    python scripts/tune_add_norm.py [--rows 64,512] [--out results.json]

Cases: ``merged`` (no adapters), ``into_qkv`` (the down projection's 16 ranks in, q/k/v's 48 out), ``into_mlp``
(o's 16 in, gate/up's 32 out). Each setting is timed as a CUDA graph of 30 calls, replayed 20 times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from scgrpo.rollout import norms  # noqa: E402
from scgrpo.rollout.compact import rms_norm  # noqa: E402
from tune_decode_attention import graph_time  # noqa: E402

WIDTH = 576
CASES = {"merged": (0, 0), "into_qkv": (16, 48), "into_mlp": (16, 32)}


def settings(rows: int):
    for block_m, block_r, warps in itertools.product((1, 2), (16, 32), (4, 8)):
        yield dict(block_m=block_m, block_r=block_r, num_warps=warps)
    for block_m, block_k, block_r, warps in itertools.product((16, 32), (128, 256), (16, 32, 64), (4, 8)):
        yield dict(block_m=block_m, block_k=block_k, block_r=block_r, num_warps=warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,512")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"card": torch.cuda.get_device_name(), "command": "python scripts/tune_add_norm.py", "cases": {}}
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, WIDTH, **bf16)
        weight = torch.rand(WIDTH, **bf16)
        compiled = torch.compile(lambda x, y, w: (x + y, rms_norm(x + y, w, 1e-5)))
        y0 = torch.randn(rows, WIDTH, **bf16)
        baseline = graph_time(lambda: compiled(x, y0, weight))
        print(f"{rows} rows: compiled add + RMSNorm {baseline:.2f} us", flush=True)
        for case, (r_in, r_out) in CASES.items():
            y = torch.randn(rows, WIDTH + r_in, **bf16)
            up = torch.randn(r_in, WIDTH, **bf16) if r_in else None
            a = torch.randn(r_out, WIDTH, **bf16) if r_out else None
            results = []
            for launch in settings(rows):
                row = dict(launch)
                try:
                    row["us"] = graph_time(lambda: norms.add_norm(x, y, up, weight, 1e-5, a, launch=launch))
                except Exception as err:  # noqa: BLE001 - a setting that does not fit (registers, shared memory)
                    row["error"] = f"{type(err).__name__}: {str(err)[:80]}"
                results.append(row)
            default = graph_time(lambda: norms.add_norm(x, y, up, weight, 1e-5, a))
            best = min((r for r in results if "us" in r), key=lambda r: r["us"])
            top = sorted((r for r in results if "us" in r), key=lambda r: r["us"])[:5]
            print(f"  {case}: default {default:.2f} us; best {top}", flush=True)
            report["cases"][f"{case}_{rows}"] = {"compiled_add_norm_us": baseline, "default_us": default, "best": best,
                                                 "settings": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
