#!/usr/bin/env bash
# The GPU acceptance suite: every GPU path of the project on this machine's GPUs, one command, <= 10 min
# on one H100/H200. Prints a summary table (test, outcome, seconds, the figures each test asserts on) and
# appends one JSON record (machine, versions, commit, per-test results and figures) to
# benchmarks/results/gpu-acceptance.jsonl. Tests that need more GPUs than there are are skipped with the
# reason. Exit status: pytest's.
#
#   bash tests/gpu/run.sh                      # the whole suite
#   bash tests/gpu/run.sh -k lora              # pytest arguments pass through
#   RLHF_GPU_COPY_TO=DIR bash tests/gpu/run.sh # also copy the record and the raw results to DIR
#   RLHF_GPU_DEADLINE_S=540 bash tests/gpu/run.sh  # stop pytest (SIGINT) after 540 s: the tests that did
#                                              # not finish are `not run`, and the record is still written
#   RLHF_GPU_RECORD=FILE bash tests/gpu/run.sh # append the record to FILE instead
#
# Python: $PYTHON, else .venv/bin/python, else python3. On a GPU machine without the packages and
# without a registry (README, "Testing on a GPU"), the parts tests/gpu/stage.sh staged under /tmp/stage
# are installed first (tests/gpu/install.sh). tests/gpu/schedule.py runs it on disjoint GPUs at once.
source "$(dirname "$0")/../../benchmarks/common.sh"  # strict mode, repository root, $PY
source tests/gpu/install.sh  # the staged packages and assets, on a machine without them
"$PY" - <<'PY'
import torch, vllm, ray, deepspeed, transformers
assert torch.cuda.is_available(), "tests/gpu/run.sh needs a CUDA device"
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"[gpu suite] {len(names)} GPU(s): {', '.join(names)} | torch {torch.__version__} vllm {vllm.__version__} "
      f"deepspeed {deepspeed.__version__} transformers {transformers.__version__} ray {ray.__version__}", flush=True)
PY
work=$(mktemp -d)
set +e
paths=(tests/gpu)
for a in "$@"; do [[ $a == tests/* ]] && paths=(); done  # test files named: run those, in that order
deadline=()
[ -n "${RLHF_GPU_DEADLINE_S:-}" ] && deadline=(timeout -s INT -k 15 "$RLHF_GPU_DEADLINE_S")
RLHF_GPU_RESULTS=$work/results.json RLHF_GPU_RUNS_LOG=$work/runs.log \
  "${deadline[@]}" "$PY" -m pytest "${paths[@]}" -p no:cacheprovider -v -rs "$@" 2>&1 | tee "$work/pytest.log"
status=${PIPESTATUS[0]}
set -e
"$PY" tests/gpu/report.py "$work/results.json" --log "$work/pytest.log" "$work/runs.log" --record "${RLHF_GPU_RECORD:-benchmarks/results/gpu-acceptance.jsonl}" \
  --command "bash tests/gpu/run.sh $*" \
  ${RLHF_GPU_COPY_TO:+--copy-to "$RLHF_GPU_COPY_TO"}
exit "$status"
