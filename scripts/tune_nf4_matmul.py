"""Launch settings and variants of the fused nf4 matmul (``scgrpo.rollout.nf4_matmul``) on an 8B model's decode
shapes, beside what the streamed 4-bit mode runs without it (bitsandbytes' dequantization into a scratch, then
cuBLAS) and a bf16 matmul by a resident weight.

    python scripts/tune_nf4_matmul.py [--rows 64] [--out results.json] [--budget-s 240]

Shapes are Qwen3-8B's projections (hidden 4096, 32 query and 8 key/value heads of 128, MLP 12288), nf4 with double
quantisation, blocks of 64, as QLoRA's loader makes them. Each setting is timed as a CUDA graph of calls over
:data:`COPIES` different weights read in turn (more than the L2 cache holds, as a decode step's layers are),
replayed 20 times. First every setting of :func:`grid` on the MLP's shapes (within ``--budget-s``), then the best
:data:`FINALISTS` on every shape with the split of K around the default; ``step_ms`` sums each projection's time
over a decode step's 36 layers, ``gb_per_s`` is the bytes each must read (codes, fp32 block scales, the input) over
its time. ``launches`` is the best setting of each weight shape (:func:`shared_launches`), in the form
``nf4_matmul.TUNED`` takes, of the product
``nf4_matmul.ORDER`` ("fused_best"); "fused_best_wx" is the best of the product by a register operand, which races
(``nf4_matmul.ORDERS``), for comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
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
SEARCHED = ("gate_up", "down")
COPIES = 4
TILE_PER_THREAD = {"registers": 64, "pairs": 32}
"""The most weights of a step's tile a thread may hold: past these, ptxas spills registers (sm_90, Triton 3.6,
K = 4096: 128 for the registers look-up, 64 for the pairs one)"""
FINALISTS = 8
PREVIOUS = dict(lookup="table", order="wx", block_k=64, block_n=128, num_warps=4, num_stages=3)
"""The kernel as it was before its look-ups in registers or by bytes (its defaults then)"""


def grid() -> list[dict]:
    """Look-ups x products x steps of K x rows a program x launch settings, in a shuffled order."""
    out = []
    for lookup, order, block_k, block_n, (warps, stages) in itertools.product(
            ("registers", "pairs"), nf4_matmul.ORDERS, (64, 128, 256), (64, 128, 256),
            ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4), (8, 5))):
        if block_n * block_k / (32 * warps) > TILE_PER_THREAD[lookup]:
            continue
        out.append(dict(lookup=lookup, order=order, block_k=block_k, block_n=block_n, num_warps=warps,
                        num_stages=stages))
    random.Random(0).shuffle(out)  # (a search cut short by its budget still samples every variant)
    return out


def nf4_weights(rows: int, cols: int, copies: int) -> list:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    return [bnb.nn.Params4bit(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02, requires_grad=False,
                              compress_statistics=True, quant_type="nf4").cuda() for _ in range(copies)]


def timed(fn) -> dict:
    try:
        return {"us": graph_time(fn, calls=COPIES * 8)}
    except Exception as err:  # noqa: BLE001 - a setting that does not fit (registers, shared memory)
        return {"error": f"{type(err).__name__}: {str(err)[:160]}"}


def cycling(calls):
    """One callable that runs the next of ``calls`` each time (the graph records them in turn)."""
    state = {"i": 0}

    def run():
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return run


class Shape:
    """One projection's weights, input and output buffers, and what its matmuls must read."""

    def __init__(self, name: str, rows: int) -> None:
        self.name = name
        self.n, self.k, self.per_layer = SHAPES[name]
        self.m = rows
        self.dequantizers = [Dequantizer(w) for w in nf4_weights(self.n, self.k, COPIES)]
        for d in self.dequantizers:
            d.prepare()
        self.x = torch.randn(rows, self.k, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty(self.n, rows, dtype=torch.bfloat16, device="cuda")
        self.bytes = self.n * self.k // 2 + self.n * self.k // 64 * 4 + rows * self.k * 2 + self.n * rows * 2

    def fused(self, launch: dict) -> dict:
        result = timed(cycling([lambda d=d: nf4_matmul.nf4_matmul_t(self.x, d, self.out, **launch)
                                for d in self.dequantizers]))
        if "us" in result:
            result["gb_per_s"] = self.bytes / result["us"] / 1e3
        return {**launch, **result}

    def close(self) -> None:
        del self.dequantizers, self.x, self.out
        torch.cuda.empty_cache()


def baselines(shape: Shape) -> dict:
    n, k = shape.n, shape.k
    scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(COPIES)]
    x_t = shape.x.t()
    entry = {"rows": n, "cols": k, "m": shape.m, "bytes": shape.bytes}
    entry["dequantize_mm"] = timed(cycling(
        [lambda d=d: torch.mm(d.into(scratch), x_t, out=shape.out) for d in shape.dequantizers]))
    entry["bf16_mm"] = timed(cycling([lambda w=w: torch.mm(w, x_t, out=shape.out) for w in dense]))
    entry["previous_kernel"] = shape.fused(PREVIOUS)
    want = torch.mm(shape.dequantizers[0].into(scratch), x_t).float()
    entry["max_abs"] = float(want.abs().max())
    entry["max_abs_diff"] = {}
    for lookup in nf4_matmul.LOOKUPS:
        got = nf4_matmul.nf4_matmul_t(shape.x, shape.dequantizers[0], lookup=lookup)
        entry["max_abs_diff"][lookup] = float((got.float() - want).abs().max())
    del scratch, dense
    return entry


def key(launch: dict) -> str:
    return json.dumps({k: v for k, v in launch.items() if k not in ("us", "gb_per_s", "error", "split")},
                      sort_keys=True)


def shared_launches(shapes: dict[str, dict]) -> dict[str, dict]:
    """The launch of each weight shape ``"NxK"``: of the safe product's finalists timed on every projection of that
    shape (q and o share one), the least time summed over a layer's weights of the shape."""
    by_shape: dict[str, list[str]] = {}
    for name, entry in shapes.items():
        by_shape.setdefault(f"{entry['rows']}x{entry['cols']}", []).append(name)
    launches = {}
    for shape, names in by_shape.items():
        timed_on = []  # per projection: launch (as JSON) -> its time on it
        for name in names:
            timed_on.append({json.dumps({k: v for k, v in t.items() if k not in ("us", "gb_per_s")}, sort_keys=True):
                             SHAPES[name][2] * t["us"] for t in shapes[name]["finalists"]
                             if "us" in t and t["order"] == nf4_matmul.ORDER})
        common = set.intersection(*(set(times) for times in timed_on))
        if common:
            launches[shape] = json.loads(min(common, key=lambda k: sum(times[k] for times in timed_on)))
    return launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="the decode batch")
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=240.0, help="time for the first search")
    args = parser.parse_args()
    nf4_matmul.TUNED = {}  # (each setting as given, its split from splits(): not the table of an earlier run)
    started = time.time()
    report = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "rows": args.rows, "shapes": {}, "search": {}}
    # 1. every setting of the grid on the searched shapes, their times summed over a decode step's layers
    scores: dict[str, float] = {}
    settings = grid()
    for name in SEARCHED:
        shape = Shape(name, args.rows)
        tried = []
        for launch in settings:
            if time.time() - started > args.budget_s * (SEARCHED.index(name) + 1) / len(SEARCHED):
                break
            result = shape.fused(launch)
            tried.append(result)
            if "us" in result:
                scores[key(launch)] = scores.get(key(launch), 0.0) + shape.per_layer * result["us"]
        report["search"][name] = tried
        ok = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])
        print(f"search {name}: {len(tried)} settings; best {json.dumps(ok[:3])}", flush=True)
        shape.close()
    complete = [k for k in scores if all(any(key(t) == k and "us" in t for t in report["search"][s]) for s in SEARCHED)]
    finalists = [json.loads(k) for order in nf4_matmul.ORDERS  # (the best of each product)
                 for k in sorted((k for k in complete if json.loads(k)["order"] == order), key=scores.get)[:FINALISTS]]
    report["finalists"] = finalists
    # 2. the finalists on every shape, the split of K around the default
    totals: dict[str, float] = {}
    launches = {}
    for name in SHAPES:
        shape = Shape(name, args.rows)
        entry = baselines(shape)
        tried = []
        for launch in finalists:
            auto = nf4_matmul.splits(shape.n, shape.k, 1, launch["block_n"], launch["block_k"])
            for split in sorted({max(1, auto // 2), auto, min(nf4_matmul.MAX_SPLIT, auto * 2)}):
                if shape.k % (split * launch["block_k"]) == 0:
                    tried.append(shape.fused({**launch, "split": split}))
        ok = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])
        safe = [t for t in ok if t["order"] == nf4_matmul.ORDER]
        entry["best"] = safe[0] if safe else None
        entry["best_wx"] = next((t for t in ok if t["order"] == "wx"), None)
        entry["finalists"] = tried
        report["shapes"][name] = entry
        for label, result in (("dequantize_mm", entry["dequantize_mm"]), ("bf16_mm", entry["bf16_mm"]),
                              ("previous_kernel", entry["previous_kernel"]), ("fused_best", entry["best"] or {}),
                              ("fused_best_wx", entry["best_wx"] or {})):
            if "us" in result:
                totals[label] = totals.get(label, 0.0) + shape.per_layer * LAYERS * result["us"] / 1000
        print(json.dumps({k: v for k, v in entry.items() if k != "finalists"}), flush=True)
        shape.close()
    launches = shared_launches(report["shapes"])
    step_bytes = sum(SHAPES[s][2] * LAYERS * report["shapes"][s]["bytes"] for s in SHAPES)
    report["step_ms"] = totals
    report["step_bytes"] = step_bytes
    report["gb_per_s"] = {k: step_bytes / v / 1e6 for k, v in totals.items()}
    report["launches"] = launches
    report["wall_s"] = time.time() - started
    print(f"projections of one decode step (ms): {json.dumps(totals)}; GB/s {json.dumps(report['gb_per_s'])}",
          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
