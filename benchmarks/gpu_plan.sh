#!/usr/bin/env bash
# Issue 14's GPU checks of the memory planner: every configuration of benchmarks/plan_check.py runs under
# memory.plan=auto; predicted vs measured learner peak (target +-10% on >= 4), no OOM, and on an H200 the H200
# plan against the H100 plan (target >= 1.3x samples/s). See benchmarks/README.md.
#
#   bash benchmarks/gpu_plan.sh --configs 1.5b-fsdp2                # one configuration (or a few) per device call
#   bash benchmarks/gpu_plan.sh --configs 1.5b-fsdp2-h100plan       # the H100 plan, on the same H200
#   bash benchmarks/gpu_plan.sh --combine                           # one table from the latest run of each
#   bash benchmarks/gpu_plan.sh                                     # every configuration the visible GPUs allow
#   bash benchmarks/gpu_plan.sh --results outputs/plan-results ...  # JSON lines somewhere else (any plan_check.py option)
#
# Python: $PYTHON, else .venv/bin/python, else python3; on a machine with parts staged by tests/gpu/stage.sh
# they are installed first (tests/gpu/install.sh). The random-weight Qwen2.5 shapes a configuration needs are
# built once under outputs/bench/models/ (by a child process, on the GPU) next to the Qwen2 tokenizer
# (benchmarks/models.py: $TOKENIZER, else the asset cache's).
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
if [[ " $* " == *" --combine "* ]]; then
  exec "$PY" benchmarks/plan_check.py "$@"  # runs nothing: no GPU needed
fi
check_gpus gpu_plan.sh  # each configuration's local Ray inherits its NCCL settings
exec "$PY" benchmarks/plan_check.py "$@"
