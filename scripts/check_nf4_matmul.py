"""Repeated calls of the fused nf4 matmul (``scgrpo.rollout.nf4_matmul``), each weight checked bit for bit.

    python scripts/check_nf4_matmul.py [--passes 10] [--launches tune.json] [--out results.json]

A pass multiplies unit rows (``x`` the identity's rows, 64 at a time) so that the output is ``W``'s columns, exact in
any summation order, and compares every weight with bitsandbytes' dequantization of it. Each of :data:`SETTINGS`
runs ``--passes`` passes (``K / 64`` calls each) on Qwen3-8B's MLP shape (12288 x 4096, nf4, double quantisation);
with ``--launches`` (``scripts/tune_nf4_matmul.py``'s output), so does each shape's tuned launch on its shape. The
result counts the passes with a wrong weight and the wrong weights, with where the first ones lie.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from scgrpo.rollout import nf4_matmul  # noqa: E402
from scgrpo.rollout.four_bit import Dequantizer  # noqa: E402

BASE = dict(block_n=128, block_k=64, num_warps=4, num_stages=3, split=4)
"""The launch that raced with the product by a register operand (order "wx"): the kernel's defaults then"""
SETTINGS = [dict(BASE, **given) for given in (
    dict(lookup="registers", order="wx"), dict(lookup="pairs", order="wx"), dict(lookup="registers", order="xw"),
    dict(lookup="pairs", order="xw"), dict(lookup="table", order="xw"), dict(lookup="registers", order="xw", num_warps=8),
    dict(lookup="registers", order="xw", num_stages=4),
    dict(lookup="registers", order="xw", block_n=64, block_k=128, split=2))]
"""The product by a register operand beside the other product at that launch and others (each setting whole: the
kernel's defaults and ``nf4_matmul.TUNED`` play no part)"""


def check(n: int, k: int, settings: list[dict], passes: int) -> list[dict]:
    """Each of ``settings`` over ``passes`` passes of unit rows through an nf4 weight ``[n, k]``."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    weight = bnb.nn.Params4bit(torch.randn(n, k, dtype=torch.bfloat16) * 0.02, requires_grad=False,
                               compress_statistics=True, quant_type="nf4").cuda()
    d = Dequantizer(weight)
    want = d.into(torch.empty(n, k, dtype=torch.bfloat16, device="cuda"))
    units = torch.eye(64, dtype=torch.bfloat16, device="cuda")
    entries = []
    for setting in settings:
        started = time.time()
        wrong_passes, wrong, first = 0, 0, []
        got = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        for _ in range(passes):
            for c0 in range(0, k, 64):
                x = torch.zeros(64, k, dtype=torch.bfloat16, device="cuda")
                x[:, c0 : c0 + 64] = units
                got[:, c0 : c0 + 64] = nf4_matmul.nf4_matmul_t(x, d, **setting)
            bad = (got != want).nonzero()
            if len(bad):
                wrong_passes += 1
                wrong += int(bad.shape[0])
                first += bad[:4].tolist()
        entry = {"shape": [n, k], **nf4_matmul.launch_settings(n, k, **setting), "passes": passes, "wrong_passes": wrong_passes, "wrong_weights": wrong,
                 "first": first[:12], "s": round(time.time() - started, 2)}
        entries.append(entry)
        print(json.dumps(entry), flush=True)
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--rows", type=int, default=12288)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--launches", default=None, help="a tune_nf4_matmul.py output: check its launches too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    nf4_matmul.TUNED = {}  # (the settings as written)
    report = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "settings": check(args.rows, args.cols, SETTINGS, args.passes)}
    if args.launches:
        with open(args.launches) as f:
            launches = json.load(f)["launches"]
        for shape, launch in launches.items():
            n, k = (int(v) for v in shape.split("x"))
            report["settings"] += check(n, k, [launch], args.passes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
