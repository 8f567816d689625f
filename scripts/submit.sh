#!/usr/bin/env bash
# Submit a training run to a Ray cluster as a Ray Job (the job's driver runs on the head node).
#
#   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address=127.0.0.1   # a test head
#   scripts/submit.sh configs/grpo_tiny_cpu.yaml grpo.steps=2
#   scripts/submit.sh configs/dpo_tiny_cpu.yaml dpo.max_steps=2     # algorithm: dpo -> train_dpo.py
#
# RAY_ADDRESS picks the cluster's dashboard (default http://127.0.0.1:8265: `ray start` serves it on
# the head's loopback only, so run this on the head, or through an SSH tunnel to its port 8265).
# Auth: Ray 2.60 has token auth; `ray start` turns it on when a token is there (RAY_AUTH_TOKEN,
# the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token, which `ray get-auth-token --generate`
# and any local run create), and so does this script, for `ray job submit`: RAY_AUTH_MODE=token
# unless you set RAY_AUTH_MODE yourself. A multi-node head: see docs/scaling.md ("Several nodes").
# The test head above (no env var: Ray would bind the machine's outward address instead, on every
# interface) listens on loopback only, every process of it; it cannot take other nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: scripts/submit.sh configs/<recipe>.yaml [key=value ...]}
shift
RAY=${RAY:-.venv/bin/ray}
# The recipe as the run reads it (its `base:` and the overrides included) says which script trains it.
algorithm=$("${PYTHON:-.venv/bin/python}" -c '
import sys
from rlhf.config import load_config
try:
    print(load_config(sys.argv[1], sys.argv[2:]).algorithm)
except Exception as e:
    sys.exit(f"submit.sh: {e}")' "$config" "$@")
script=scripts/train_grpo.py
[[ $algorithm == dpo ]] && script=scripts/train_dpo.py
token_file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
if [[ -z "${RAY_AUTH_MODE:-}" ]] && [[ -n "${RAY_AUTH_TOKEN:-}" || -s "$token_file" ]]; then
  export RAY_AUTH_MODE=token
fi
exec "$RAY" job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir . \
  --runtime-env-json '{"excludes": [".venv", ".cache", "outputs", ".git"]}' \
  -- python "$script" --config "$config" "$@"
