#!/usr/bin/env bash
# The GPU tests on a GPU machine, and docs/gpu_tests.md from their JUnit file (commit, card, versions, a row per test).
# Usage (from the repository root, on the card): bash scripts/gpu_tests.sh [extra pytest arguments]
# SCGRPO_COMMIT=<commit> names the commit tested where the tree's git folder is not its own (a copy sent to the card)
# Exits with pytest's status once the page is written.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
TESTS=(tests/gpu tests/rollout tests/distributed/test_fsdp.py)
python3 -m pytest -q -rA -p no:cacheprovider --junitxml=build/gpu_tests.xml "${TESTS[@]}" "$@"
status=$?
python3 scripts/gpu_tests_report.py build/gpu_tests.xml --out docs/gpu_tests.md || status=1
exit $status
