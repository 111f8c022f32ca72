#!/usr/bin/env bash
# SC-GRPO (the paper's defaults) vs GRPO and DAPO on the quickstart task (two-digit addition; ID and three-digit
# OOD evaluation), 3 seeds each, the same rollout budget (30 steps x 8 prompts x G=4), then the tables of
# docs/results.md. Usage: bash scripts/run_signal.sh [seeds...]   (default: 0 1 2)
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=("${@:-0 1 2}")
for seed in ${seeds[@]}; do
  for objective in scgrpo grpo dapo; do
    python scripts/bench_quickstart.py --name "signal_${objective}_seed${seed}" \
      --config "configs/${objective}_arith.yaml" -- "--seed_everything=${seed}" "--data.seed=${seed}"
  done
done
python scripts/results_table.py > docs/results.md
