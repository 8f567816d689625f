#!/usr/bin/env bash
# Set up .venv (first time: a few minutes) and run the main job: a short GRPO run of the whole
# stack (Ray + vLLM + 2 FSDP2 learner ranks) on the embedded tiny recipe. Extra arguments are
# key=value overrides, e.g. `bash scripts/quickstart.sh grpo.steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/train_grpo.py --config configs/grpo_tiny_cpu.yaml "$@"
