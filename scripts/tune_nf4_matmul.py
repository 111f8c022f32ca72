"""Launch settings of the fused nf4 matmul (``scgrpo.rollout.nf4_matmul``) on an 8B model's decode shapes, beside
what the streamed 4-bit mode runs without it (bitsandbytes' dequantization into a scratch, then cuBLAS) and a
bf16 matmul by a resident weight.

    python scripts/tune_nf4_matmul.py [--rows 64] [--out results.json]

Shapes are Qwen3-8B's projections (hidden 4096, 32 query and 8 key/value heads of 128, MLP 12288), nf4 with double
quantisation, blocks of 64, as QLoRA's loader makes them. Each setting is timed as a CUDA graph of calls over
:data:`COPIES` different weights read in turn (more than the L2 cache holds, as a decode step's layers are),
replayed 20 times. ``step_ms`` sums each projection's time over a decode step's 36 layers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from scgrpo.rollout import nf4_matmul  # noqa: E402
from scgrpo.rollout.four_bit import Dequantizer  # noqa: E402
from tune_decode_attention import graph_time  # noqa: E402

HIDDEN, INNER, HEADS, KV, DIM, LAYERS = 4096, 12288, 32, 8, 128, 36
SHAPES = {  # name: (rows, cols, weights of this shape a layer)
    "q": (HEADS * DIM, HIDDEN, 1), "kv": (KV * DIM, HIDDEN, 2), "o": (HIDDEN, HEADS * DIM, 1),
    "gate_up": (INNER, HIDDEN, 2), "down": (HIDDEN, INNER, 1)}
COPIES = 4


def nf4_weights(rows: int, cols: int, copies: int) -> list:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    return [bnb.nn.Params4bit(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02, requires_grad=False,
                              compress_statistics=True, quant_type="nf4").cuda() for _ in range(copies)]


def timed(fn) -> dict:
    try:
        return {"us": graph_time(fn, calls=COPIES * 8)}
    except Exception as err:  # noqa: BLE001 - a setting that does not fit (registers, shared memory)
        return {"error": f"{type(err).__name__}: {str(err)[:120]}"}


def cycling(calls):
    """One callable that runs the next of ``calls`` each time (the graph records them in turn)."""
    state = {"i": 0}

    def run():
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64", help="comma-separated decode batch sizes")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a few settings only")
    args = parser.parse_args()
    started = time.time()
    report = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "shapes": {}, "step_ms": {}}
    blocks = (32, 64, 128, 256) if not args.quick else (64, 128)
    launches = ((4, 3), (4, 4), (8, 3), (8, 4)) if not args.quick else ((4, 3), (8, 3))
    for rows in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        for name, (n, k, per_layer) in SHAPES.items():
            weights = nf4_weights(n, k, COPIES)
            dequantizers = [Dequantizer(w) for w in weights]
            for d in dequantizers:
                d.prepare()
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(n, rows, dtype=torch.bfloat16, device="cuda")
            scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
            dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(COPIES)]
            x_t = x.t()
            entry = {"rows": n, "cols": k, "m": rows}
            entry["dequantize_mm"] = timed(cycling(
                [lambda d=d: torch.mm(d.into(scratch), x_t, out=out) for d in dequantizers]))
            entry["bf16_mm"] = timed(cycling([lambda w=w: torch.mm(w, x_t, out=out) for w in dense]))
            entry["fused_default"] = timed(cycling([lambda d=d: nf4_matmul.nf4_matmul_t(x, d, out) for d in dequantizers]))
            want = torch.mm(dequantizers[0].into(scratch), x_t)
            got = nf4_matmul.nf4_matmul_t(x, dequantizers[0])
            entry["max_abs_diff"] = float((got.float() - want.float()).abs().max())
            entry["max_abs"] = float(want.float().abs().max())
            settings = []
            for block_n, (warps, stages) in itertools.product(blocks, launches):
                auto = nf4_matmul.splits(n, k, 1, block_n)
                for split in sorted({max(1, auto // 2), auto, min(nf4_matmul.MAX_SPLIT, auto * 2)}):
                    if k % (split * nf4_matmul.BLOCK_K):
                        continue
                    launch = dict(block_n=block_n, split=split, num_warps=warps, num_stages=stages)
                    settings.append({**launch, **timed(cycling(
                        [lambda d=d, launch=launch: nf4_matmul.nf4_matmul_t(x, d, out, **launch) for d in dequantizers]))})
            ok = sorted((s for s in settings if "us" in s), key=lambda s: s["us"])
            entry["best"] = ok[0] if ok else None
            entry["settings"] = settings
            report["shapes"][f"{name}_m{rows}"] = entry
            for key in ("dequantize_mm", "bf16_mm", "fused_default"):
                if "us" in entry[key]:
                    totals[key] = totals.get(key, 0.0) + per_layer * LAYERS * entry[key]["us"] / 1000
            if entry["best"]:
                totals["fused_best"] = totals.get("fused_best", 0.0) + per_layer * LAYERS * entry["best"]["us"] / 1000
            print(json.dumps({k: v for k, v in entry.items() if k != "settings"}), flush=True)
            del weights, dequantizers, dense, scratch
            torch.cuda.empty_cache()
        report["step_ms"][f"m{rows}"] = totals
        print(f"rows {rows}: projections of one decode step (ms): {json.dumps(totals)}", flush=True)
    report["wall_s"] = time.time() - started
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
