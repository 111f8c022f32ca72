"""Launch settings of the decode step's block kernels (``scgrpo.rollout.norms``: the add-and-norm and the gated
activation, each with and without LoRA terms, and q/k/v's LoRA term), on the SmolLM2-135M decode shapes, beside the compiled PyTorch they replace (``torch.compile`` of the same operations, no LoRA).

    python scripts/tune_block_kernels.py [--rows 64,512] [--parts norms,matmul] [--out results.json]

LoRA cases use 16 ranks per adapted layer (the o or down projection's 16 into the add-and-norm, gate's and up's
16 each into the activation, q's, k's and v's 16 each into ``lora_add``). Each setting is timed as a CUDA graph of
30 calls, replayed 20 times; the report keeps every setting and the fastest.

Part ``matmul`` (30 copies of each weight, read in turn, as the decode step's layers are): each projection (q/k/v, o, gate/up, down) with its LoRA term inside (``scgrpo.rollout.lora_matmul``)
against cuBLAS (``F.linear``) without adapters, with the adapters' A rows (``[x W^T | z]``, whose B product the
block kernels add) and, for q/k/v, with the ``lora_add`` launch after it.
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
from scgrpo.rollout import lora_matmul, norms  # noqa: E402
from scgrpo.rollout.layers import rms_norm  # noqa: E402
from tune_decode_attention import graph_time  # noqa: E402

WIDTH, INNER, HEADS, KV, DIM, RANK, LAYERS = 576, 1536, 9, 3, 64, 16, 30


def timed(fn) -> dict:
    try:
        return {"us": graph_time(fn)}
    except Exception as err:  # noqa: BLE001 - a setting that does not fit (registers, shared memory)
        return {"error": f"{type(err).__name__}: {str(err)[:80]}"}


def sweep(fn, settings) -> dict:
    results = [{**launch, **timed(lambda: fn(launch))} for launch in settings]
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    return {"default_us": timed(lambda: fn(None)).get("us"), "best": ok[0] if ok else None, "settings": results}


PROJECTIONS = {  # name: (layers' outputs, input width)
    "qkv": ((HEADS * DIM, KV * DIM, KV * DIM), WIDTH), "o": ((WIDTH,), HEADS * DIM),
    "gate_up": ((INNER, INNER), WIDTH), "down": ((WIDTH,), INNER)}


def tune_matmuls(rows: int, report: dict) -> None:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if rows <= 128:  # (W's rows and the A rows as two operands, or as one)
        shapes = itertools.product((64 if rows > 32 else 16,), (16, 32), (64, 128), ((4, 4), (4, 5)), (False, True))
    else:
        shapes = itertools.product((64, 128), (32, 64), (64, 128), ((4, 3), (4, 4), (8, 4)), (False,))
    settings = [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, one_dot=d)
                for m, n, k, (w, s), d in shapes]
    for name, (sizes, width) in PROJECTIONS.items():
        out, r = sum(sizes), RANK * len(sizes)
        x = torch.randn(rows, width, **bf16)
        blocks, start = [], 0
        for i, size in enumerate(sizes):
            blocks.append((start, start + size, tuple(range(i * RANK, (i + 1) * RANK))))
            start += size
        copies = []  # one per layer, read in turn: the weights stream from memory, as in the decode step
        for _ in range(LAYERS):
            weight = torch.randn(out + r, width, **bf16) / width ** 0.5
            up = torch.zeros(r, out, **bf16)
            for i, (start, end, _) in enumerate(blocks):
                up[i * RANK:(i + 1) * RANK, start:end] = torch.randn(RANK, end - start, **bf16) / 64
            copies.append((weight, weight[:out].contiguous(), up))
        turn = itertools.cycle(copies)
        cublas = {"no_lora_us": timed(lambda: F.linear(x, next(turn)[1]))["us"],
                  "with_a_rows_us": timed(lambda: F.linear(x, next(turn)[0]))["us"]}
        if name == "qkv":
            cublas["with_a_rows_and_lora_add_us"] = timed(
                lambda: norms.lora_add(F.linear(x, (c := next(turn))[0]), c[2]))["us"]

        def fused(launch, with_lora=True):
            weight, base, up = next(turn)
            if with_lora:
                return lora_matmul.lora_matmul(x, weight, None, up, tuple(blocks), launch=launch)
            return lora_matmul.lora_matmul(x, base, None, None, launch=launch)

        found = sweep(fused, settings)
        plain = sweep(lambda launch: fused(launch, False), [found["best"]] if found["best"] else [])
        report["cases"][f"matmul_{name}_{rows}"] = {"cublas": cublas, **found,
                                                     "no_lora_triton_us": plain["settings"][0].get("us")
                                                     if plain["settings"] else None}
        print(f"{rows} rows {name}: cuBLAS {cublas}, lora_matmul default {found['default_us']} us, best "
              f"{found['best']}, without LoRA at that setting {report['cases'][f'matmul_{name}_{rows}']['no_lora_triton_us']}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,512")
    parser.add_argument("--parts", default="norms,matmul")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    torch.manual_seed(0)
    report = {"card": torch.cuda.get_device_name(), "command": "python scripts/tune_block_kernels.py", "cases": {}}
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    norm_settings = [dict(block_m=m, num_warps=w) for m, w in itertools.product((1, 2, 4, 8), (2, 4, 8))]
    silu_settings = {0: [dict(block_m=m, block=b, num_warps=4) for m, b in itertools.product((1, 4), (256, 512, 1024))],
                     RANK: [dict(block_m=m, block=b, num_warps=w)  # (tensor-core dots: 16 rows or more)
                            for m, b, w in itertools.product((16, 32), (32, 64, 128), (2, 4, 8))]}
    for rows in (int(r) for r in args.rows.split(",")):
        if "matmul" in parts:
            tune_matmuls(rows, report)
        if "norms" not in parts:
            continue
        x, weight = torch.randn(rows, WIDTH, **bf16), torch.rand(WIDTH, **bf16)
        compiled_norm = torch.compile(lambda x, y, w: (x + y, rms_norm(x + y, w, 1e-5)))
        y0 = torch.randn(rows, WIDTH, **bf16)
        gu0 = torch.randn(rows, 2 * INNER, **bf16)
        compiled_silu = torch.compile(lambda gu: F.silu(gu[:, :INNER]) * gu[:, INNER:])
        baselines = {"add_norm": timed(lambda: compiled_norm(x, y0, weight))["us"],
                     "silu_mul": timed(lambda: compiled_silu(gu0))["us"]}
        for r in (0, RANK):
            y = torch.randn(rows, WIDTH + r, **bf16)
            up = torch.randn(r, WIDTH, **bf16) if r else None
            found = sweep(lambda launch: norms.add_norm(x, y, up, weight, 1e-5, launch=launch), norm_settings)
            report["cases"][f"add_norm_r{r}_{rows}"] = {"compiled_us": baselines["add_norm"], **found}
            print(f"{rows} rows add_norm, {r} ranks: compiled (no LoRA) {baselines['add_norm']:.2f} us, default "
                  f"{found['default_us']:.2f}, best {found['best']}", flush=True)
            ranks = (r, r)
            gu = torch.randn(rows, 2 * INNER + 2 * r, **bf16)
            lora = torch.randn(2 * r, 2 * INNER, **bf16) if r else None
            found = sweep(lambda launch: norms.silu_mul(gu, lora, ranks, launch=launch), silu_settings[r])
            report["cases"][f"silu_mul_r{r}_{rows}"] = {"compiled_us": baselines["silu_mul"], **found}
            print(f"{rows} rows silu_mul, {r}+{r} ranks: compiled (no LoRA) {baselines['silu_mul']:.2f} us, default "
                  f"{found['default_us']:.2f}, best {found['best']}", flush=True)
        # q/k/v's LoRA term before attention: 16 ranks each of q, k and v
        qkv = torch.randn(rows, (HEADS + 2 * KV) * DIM + 3 * RANK, **bf16)
        up = torch.randn(3 * RANK, (HEADS + 2 * KV) * DIM, **bf16)
        lora_settings = [dict(block_m=m, block=b, num_warps=w)
                         for m, b, w in itertools.product((16, 32), (32, 64, 128), (2, 4, 8))]
        found = sweep(lambda launch: norms.lora_add(qkv, up, launch=launch), lora_settings)
        report["cases"][f"lora_add_r{3 * RANK}_{rows}"] = {"compiled_us": None, **found}
        print(f"{rows} rows lora_add, {3 * RANK} ranks: default {found['default_us']:.2f}, best {found['best']}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
