"""Launch settings of the decode-attention kernel (``scgrpo.rollout.kernels``): microseconds per call for each
(block_n, num_warps, num_stages, and for long rows the parts each row is split into), on the shapes the rollout
benchmarks use.

    python scripts/tune_decode_attention.py [--out results.json]

Rows hold random cache lengths (48 prompt tokens plus 0-128 generated: SmolLM2-135M at 64 and 512 slots; 48 +
0-512 for Qwen2.5-1.5B at 32). Each setting is timed as a CUDA graph of 30 calls (one per layer, as in a decode
step), replayed 20 times; the PyTorch path it replaces (indexed cache write, masked SDPA) is timed the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from scgrpo.rollout import kernels  # noqa: E402

SHAPES = {
    "smollm2_64": dict(slots=64, heads=9, kv=3, dim=64, longest=176),
    "smollm2_512": dict(slots=512, heads=9, kv=3, dim=64, longest=176),
    "qwen1p5b_32": dict(slots=32, heads=12, kv=2, dim=128, longest=560),
}


def graph_time(fn, calls: int = 30, replays: int = 20) -> float:
    """Microseconds per call of ``fn`` recorded ``calls`` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (calls * replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"card": torch.cuda.get_device_name(), "shapes": {}}
    for name, shape in SHAPES.items():
        if name not in args.shapes.split(","):
            continue
        s, h, kv, d, longest = (shape[k] for k in ("slots", "heads", "kv", "dim", "longest"))
        width = (h + 2 * kv) * d
        qkv = torch.randn(s, width, device="cuda", dtype=torch.bfloat16)
        lens = torch.randint(48, longest, (s,), device="cuda")
        cache = torch.randn(2, s, kv, longest + 64, d, device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(longest + 64, d, device="cuda", dtype=torch.bfloat16)
        sin = torch.randn_like(cos)
        rows = []
        length = int(longest // 64 + 1) * 64
        mask = torch.zeros(s, 1, 1, length, device="cuda", dtype=torch.bfloat16).masked_fill(
            (torch.arange(length, device="cuda") > lens[:, None]).view(s, 1, 1, length), float("-inf"))
        q = qkv[:, : h * d].view(s, kv, h // kv, d)
        kvs = qkv[:, h * d :].view(s, 2, kv, d)  # [S, 2, kv, D]: the indexed store's layout
        slots = torch.arange(s, device="cuda")

        def torch_path():
            cache[:, slots, :, lens] = kvs
            return F.scaled_dot_product_attention(q, cache[0, :, :, :length], cache[1, :, :, :length], attn_mask=mask)

        baseline = graph_time(torch_path)
        print(f"{name}: PyTorch write + SDPA {baseline:.2f} us", flush=True)
        parts = (1, 2, 4, 8) if longest >= 512 else (1,)  # long rows: also split each row over programs
        for block_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4, 8), (1, 2), parts):
            launch = dict(block_n=block_n, num_warps=warps, num_stages=stages, splits=splits)
            row = dict(launch)
            try:
                row["us"] = graph_time(lambda: kernels.decode_attention(qkv, lens, cache, cos, sin, h, d ** -0.5,
                                                                        launch=launch))
            except Exception as err:  # noqa: BLE001 - a setting that does not fit (registers, shared memory)
                row["error"] = f"{type(err).__name__}: {str(err)[:80]}"
            rows.append(row)
            print(f"  {row}", flush=True)
        best = min((r for r in rows if "us" in r), key=lambda r: r["us"])
        report["shapes"][name] = {"torch_us": baseline, "settings": rows, "best": best}
        print(f"{name}: best {best}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
