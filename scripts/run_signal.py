"""SC-GRPO (the paper's defaults) vs GRPO and DAPO on the quickstart task: each objective x seed is one
``scripts/bench_quickstart.py`` run of ``configs/<objective>_arith.yaml`` (the same rollout budget: 30 steps x
8 prompts x G=4), ``--jobs`` runs at a time, then the tables of docs/results.md.

    python scripts/run_signal.py                       # CPU, one run at a time, seeds 0 1 2
    python scripts/run_signal.py --jobs 3 -- --trainer.accelerator=gpu --trainer.devices=1   # several on one GPU

Finished runs (a results file exists) are skipped, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--objectives", default="scgrpo,grpo,dapo")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--results-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--ablation", default=None,
                        help="a configs/ablations/*.yaml layered over each run (names become signal_<ablation>_...)")
    parser.add_argument("extra", nargs="*", help="further scgrpo fit arguments for every run (after --)")
    args = parser.parse_args()

    def run(job: tuple[str, str]) -> int:
        objective, seed = job
        ablation = os.path.splitext(os.path.basename(args.ablation))[0].replace("_", "-") if args.ablation else ""
        tag = f"{objective}-{ablation}" if ablation else objective
        name = f"signal_{tag}_seed{seed}"
        layer = [f"--config={os.path.abspath(args.ablation)}"] if args.ablation else []
        if os.path.exists(os.path.join(args.results_dir, f"{name}.json")):
            print(f"{name}: done already", flush=True)
            return 0
        with open(os.path.join(args.results_dir, f"{name}.log"), "w") as log:
            code = subprocess.run(
                [sys.executable, os.path.join(ROOT, "scripts", "bench_quickstart.py"), "--name", name,
                 "--config", os.path.join(ROOT, "configs", f"{objective}_arith.yaml"), "--results-dir", args.results_dir,
                 "--", *layer, f"--seed_everything={seed}", f"--data.seed={seed}", *args.extra],
                stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{name}: exit {code}", flush=True)
        return code

    os.makedirs(args.results_dir, exist_ok=True)
    jobs = [(o, s) for s in args.seeds.split(",") for o in args.objectives.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        codes = list(pool.map(run, jobs))
    if any(codes):
        raise SystemExit(f"{sum(1 for c in codes if c)} run(s) failed; see the .log files in {args.results_dir}")


if __name__ == "__main__":
    main()
