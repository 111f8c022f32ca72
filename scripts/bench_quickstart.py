"""Run the quickstart (or any config) end to end and record what it achieved and what it cost.

    python scripts/bench_quickstart.py --name quickstart_cpu [--fresh-cache] [-- extra scgrpo fit args]

Runs ``scgrpo fit --config configs/quickstart.yaml`` in a scratch folder, measures wall time and the peak
resident memory of the run, reads the run's metrics.csv, and writes benchmarks/results/<name>.json with
evaluation before/after, seconds per step (mean and median, and per phase), and the exact command.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CREDIT_KEYS = ("credit/c", "credit/route_partial", "credit/route_solve_none", "credit/route_single", "credit/route_all",
               "credit/teacher_rows", "credit/kl_p25", "credit/kl_p50", "credit/kl_p75", "credit/kl_p95",
               "credit/f_mean", "credit/f_above_half", "credit/div_adv_std", "policy/entropy", "train/mixed_groups",
               "time/teacher_s", "credit/pivot_auroc", "credit/pivot_share", "credit/pivot_rows",
               "credit/pivot_auroc_turn", "credit/pivot_auroc_row")


def gpu_name(extra: list[str]):
    """The GPU's name when the run was asked to use one, else None."""
    if not any(a.startswith("--trainer.accelerator=") and not a.endswith("=cpu") for a in extra):
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


ISA_CAPS = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
"""Environment variables that hold PyTorch's CPU kernels to an instruction set (a CPU without AVX512 or AMX, here)"""


def cpu_native_bf16():
    """Whether this CPU has native bf16 (AVX512-BF16 or AMX), as scripts/quickstart.sh decides its dtype."""
    try:
        from scgrpo.models import cpu_has_native_bf16
    except ImportError:
        return None
    return bool(cpu_has_native_bf16())


def _float(row: dict, key: str):
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def summarise(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    evals = [r for r in rows if any(k.startswith("val/") and v for k, v in r.items())]
    steps = [r for r in rows if r.get("time/step_s")]

    def phase(key):
        values = [v for v in (_float(r, key) for r in steps) if v is not None and v == v]  # skip missing and NaN
        return {"mean": statistics.mean(values), "median": statistics.median(values)} if values else None

    return {
        # "step": the optimiser steps before the evaluation (val/global_step; the logger's step column says so
        # too since validation is logged at it, and said one less before)
        "evaluations": [{**{k: float(v) for k, v in r.items() if v and k.startswith("val/")},
                         "step": int(float(r.get("val/global_step") or r["step"]))} for r in evals],
        "steps": len(steps),
        "seconds_per_step": phase("time/step_s"),
        "generation_s": phase("time/generation_s"),
        "verification_s": phase("time/verification_s"),
        "train_s": phase("time/train_s"),
        "final_train_reward": _float(steps[-1], "train/reward") if steps else None,
        # the self-teacher's signal and the policy's entropy, averaged over the steps where they are defined
        "credit": {key: phase(key) for key in CREDIT_KEYS if phase(key) is not None},
        "entropy_first_last": [_float(steps[0], "policy/entropy"), _float(steps[-1], "policy/entropy")] if steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="quickstart_cpu")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.yaml"))
    parser.add_argument("--fresh-cache", action="store_true", help="convert the GGUF model again, as a fresh install does")
    parser.add_argument("--results-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("extra", nargs="*", help="further scgrpo fit arguments (after --)")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="scgrpo-bench-")
    env = dict(os.environ)
    if args.fresh_cache:
        env["SCGRPO_CACHE"] = os.path.join(workdir, "cache")
    # the console script where scgrpo is installed, else the module (a checkout on PYTHONPATH)
    launcher = ["scgrpo"] if shutil.which("scgrpo") else [sys.executable, "-m", "scgrpo.cli"]
    command = [*launcher, "fit", f"--config={os.path.abspath(args.config)}", *args.extra]
    start = time.perf_counter()
    subprocess.run(command, cwd=workdir, env=env, check=True)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    (run_dir,) = glob.glob(os.path.join(workdir, "runs", "*", "version_0"))
    caps = {k: os.environ[k] for k in ISA_CAPS if k in os.environ}  # instruction sets held back for the run
    result = {
        "name": args.name,
        "command": " ".join([f"{k}={v}" for k, v in caps.items()]
                            + ["python", "scripts/bench_quickstart.py", f"--name {args.name}",
                             f"--config {os.path.relpath(os.path.abspath(args.config), ROOT)}"]
                            + (["--fresh-cache"] if args.fresh_cache else []) + (["--", *args.extra] if args.extra else [])),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "gpu": gpu_name(args.extra),
                    "native_bf16": cpu_native_bf16(), "isa_caps": caps},
        "wall_s": round(wall, 1),
        "peak_rss_gib": round(peak_kib / 2**20, 2),
        "fresh_cache": args.fresh_cache,
        **summarise(run_dir),
    }
    os.makedirs(args.results_dir, exist_ok=True)
    out = os.path.join(args.results_dir, f"{args.name}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
