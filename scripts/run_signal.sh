#!/usr/bin/env bash
# SC-GRPO vs GRPO on the quickstart task (two-digit addition, ID and three-digit OOD evaluation), 2 seeds each,
# the same rollout budget (30 steps x 8 prompts x G=4), then the results table in docs/results.md.
# Usage: bash scripts/run_signal.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for seed in 0 1; do
  for objective in scgrpo grpo; do
    python scripts/bench_quickstart.py --name "signal_${objective}_seed${seed}" \
      --config "configs/${objective}_arith.yaml" -- "--seed_everything=${seed}"
  done
done
python scripts/results_table.py
