"""The LoRA-epilogue matmul (``scgrpo.rollout.lora_gemm``) against cuBLAS at decode shapes: is one kernel with
LoRA's term as fast as the merged model's plain matmul?

    python scripts/bench_lora_gemm.py [--out results.json]

SmolLM2-135M's projections (q/k/v, o, gate/up, down with r=16 per adapted layer: 48, 16, 32, 16 rows of A) at
64 and 512 rows, bf16. Per shape, microseconds per call, each timed as a CUDA graph of 30 calls replayed 20 times:
``merged`` (cuBLAS ``x W^T``: what unmerged LoRA should cost), ``two_kernels`` (cuBLAS ``x [W; A]^T`` then an
addmm of the low-rank term: the unfused way) and the fused kernel under each launch setting; the best setting's
ratio to ``merged`` and its largest difference from an fp32 reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from tune_decode_attention import graph_time  # noqa: E402

from scgrpo.rollout.lora_gemm import lora_gemm  # noqa: E402

SHAPES = {"qkv": (960, 576, 48), "o": (576, 576, 16), "gate_up": (3072, 576, 32), "down": (576, 1536, 16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"card": torch.cuda.get_device_name(), "command": "python scripts/bench_lora_gemm.py", "shapes": {}}
    for rows, (name, (n, k, r)) in itertools.product((64, 512), SHAPES.items()):
        dev, bf = "cuda", torch.bfloat16
        x = torch.randn(rows, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) / k ** 0.5
        a = torch.randn(r, k, device=dev, dtype=bf) / k ** 0.5
        up = 0.02 * torch.randn(r, n, device=dev, dtype=bf)
        wa = torch.cat([w, a])
        reference = x.float() @ w.float().t() + (x.float() @ a.float().t()).to(bf).float() @ up.float()
        merged = graph_time(lambda: F.linear(x, w))

        def two():
            y = F.linear(x, wa)
            return torch.addmm(y[:, :n], y[:, n:], up)

        row = {"rows": rows, "n": n, "k": k, "r": r, "merged_us": merged, "two_kernels_us": graph_time(two),
               "fused": []}
        for bm, bn, bk, warps, stages in itertools.product((16, 64), (32, 64), (64, 128), (4,), (3,)):
            if bm > rows:
                continue
            launch = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            try:
                us = graph_time(lambda: lora_gemm(x, w, a, up, **launch))
                err = float((lora_gemm(x, w, a, up, **launch).float() - reference).abs().max())
                row["fused"].append({**launch, "us": us, "max_abs_err": err})
            except Exception as error:  # noqa: BLE001 - a setting that does not fit
                row["fused"].append({**launch, "error": f"{type(error).__name__}: {str(error)[:80]}"})
        best = min((f for f in row["fused"] if "us" in f), key=lambda f: f["us"])
        row["best"], row["best_over_merged"] = best, best["us"] / merged
        report["shapes"][f"{name}_{rows}"] = row
        print(f"{name:>8} x{rows:<4} merged {merged:6.2f} us  two kernels {row['two_kernels_us']:6.2f}  fused best "
              f"{best['us']:6.2f} ({best['us'] / merged:.2f}x merged, err {best['max_abs_err']:.3g}) {best}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
