#!/usr/bin/env bash
# grpo-gpu-long: long-tailed chains of thought (forced lengths: median 1.5k, 1% above 12k, cap 16k) on one
# GPU; ours in batch, stream and partial rollouts beside TRL 1.16 on the same lengths (benchmarks/README.md).
#
#   bash benchmarks/gpu_long.sh                                   # every side, in turn; a record in results/
#   bash benchmarks/gpu_long.sh --only ours --only ours-partial --deadline 540 --results "$OUT"
#   bash benchmarks/gpu_long.sh --tiny                            # the same code path on CPU
#
# Any benchmarks/run.py option works; staged parts are installed first (tests/gpu/install.sh).
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
if [[ " $* " != *" --tiny "* ]]; then check_gpus gpu_long.sh; fi
exec "$PY" benchmarks/run.py --workload grpo-gpu-long "$@"
