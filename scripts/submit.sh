#!/usr/bin/env bash
# Submit a training run to a Ray cluster as a Ray Job (the job's driver runs on the head node).
#
#   ray start --head                              # or an existing cluster
#   scripts/submit.sh configs/grpo_tiny_cpu.yaml grpo.steps=2
#   scripts/submit.sh configs/dpo_tiny_cpu.yaml dpo.max_steps=2     # algorithm: dpo -> train_dpo.py
#
# RAY_ADDRESS picks the cluster's dashboard (default http://127.0.0.1:8265). Ray 2.60 turns token
# auth on by default: export RAY_AUTH_MODE (and the token) as your cluster requires; for a
# loopback-only test head, RAY_AUTH_MODE=disabled on both `ray start` and here.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/submit.sh configs/<recipe>.yaml [key=value ...]}
shift
RAY=${RAY:-.venv/bin/ray}
script=scripts/train_grpo.py
if grep -qE '^algorithm:[[:space:]]*dpo' "$config" || printf '%s\n' "$@" | grep -qx 'algorithm=dpo'; then
  script=scripts/train_dpo.py
fi
exec "$RAY" job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir . \
  --runtime-env-json '{"excludes": [".venv", ".cache", "outputs", ".git"]}' \
  -- python "$script" --config "$config" "$@"
