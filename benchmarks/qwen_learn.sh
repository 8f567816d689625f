#!/usr/bin/env bash
# A real 0.5B model learns on GPUs (issue 39): Qwen2.5-Coder-0.5B-Instruct (the opt-in asset
# `qwen2.5-coder-0.5b-instruct`) on the GSM and Countdown recipes on one GPU, the GSM recipe on four, and
# DPO on one. A run can outlast a device call, so each starts detached and later calls look at it:
#
#   bash benchmarks/qwen_learn.sh start gsm [GPUS] [key=value ...]   # detached; returns at once
#   bash benchmarks/qwen_learn.sh start countdown 1                  # another GPU, at the same time
#   bash benchmarks/qwen_learn.sh start gsm-4gpu 0,1,2,3             # GPUS: CUDA_VISIBLE_DEVICES
#   bash benchmarks/qwen_learn.sh start dpo 2
#   bash benchmarks/qwen_learn.sh status                             # one line per run
#   bash benchmarks/qwen_learn.sh wait 540                           # status every minute until done or 540 s
#   bash benchmarks/qwen_learn.sh collect "$OUT"                     # -> $OUT/qwen_learn.tgz, one file
#
# TASK: gsm, countdown (configs/grpo_{gsm8k,countdown}_qwen2.5-coder-0.5b_1gpu.yaml), gsm-4gpu
# (configs/grpo_gsm8k_qwen2.5-coder-0.5b_4gpu.yaml),
# dpo (configs/dpo_gsm-symbolic_qwen2.5-coder-0.5b_1gpu.yaml).
# GPUS defaults to 0 (0,1,2,3 for gsm-4gpu). A run lives in outputs/qwen_learn/TASK/: the run's own files
# (metrics.jsonl, config.yaml, logs/), log.txt (what it printed), info.json (recipe, GPUs, commit, start)
# and exit.json (exit status, end) once it ends; a new start of TASK replaces it. The commit is
# $RLHF_COMMIT, else git's HEAD. Then, here or on the CPU machine after unpacking the tarball:
#   python benchmarks/learning_record.py record outputs/qwen_learn/gsm      # -> docs/<recipe>_metrics.jsonl
#
# Python: $PYTHON, else .venv/bin/python, else python3. On a GPU machine without a registry, install first
# as tests/gpu/run.sh does from the parts tests/gpu/stage.sh staged (`--qwen` too: the model's six wheels),
# e.g. `bash tests/gpu/run.sh tests/gpu/test_learning_gpu.py --co -q`, then set
# PYTHON=python3 PYTHONPATH=/tmp/site:$PWD.
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
RUNS=outputs/qwen_learn

recipe_of() {  # recipe_of TASK: the recipe file
  case $1 in
    gsm) echo configs/grpo_gsm8k_qwen2.5-coder-0.5b_1gpu.yaml ;;
    countdown) echo configs/grpo_countdown_qwen2.5-coder-0.5b_1gpu.yaml ;;
    gsm-4gpu) echo configs/grpo_gsm8k_qwen2.5-coder-0.5b_4gpu.yaml ;;
    dpo) echo configs/dpo_gsm-symbolic_qwen2.5-coder-0.5b_1gpu.yaml ;;
    *) echo "qwen_learn.sh: unknown task '$1' (gsm, countdown, gsm-4gpu, dpo)" >&2; return 2 ;;
  esac
}

running() {  # running DIR: its run has not ended and its process group is alive
  [ -f "$1/pid" ] && [ ! -f "$1/exit.json" ] && kill -0 "$(cat "$1/pid")" 2>/dev/null
}

start() {
  local task=${1:?start TASK [GPUS] [key=value ...]}; shift
  local recipe gpus dir want
  recipe=$(recipe_of "$task")
  want=$(sed -E 's/.*_([0-9]+)gpu.*/\1/' <<<"$recipe")
  gpus=$([ "$want" = 4 ] && echo 0,1,2,3 || echo 0)
  if [[ ${1:-} =~ ^[0-9]+(,[0-9]+)*$ ]]; then gpus=$1; shift; fi
  if [ "$(tr ',' '\n' <<<"$gpus" | wc -l)" != "$want" ]; then
    echo "qwen_learn.sh: $task is a $want-GPU recipe, GPUS=$gpus" >&2; return 2
  fi
  dir=$RUNS/$task
  if running "$dir"; then
    echo "qwen_learn.sh: $task is still running (pid $(cat "$dir/pid"))" >&2; return 1
  fi
  "$PY" -m scripts.assets fetch qwen2.5-coder-0.5b-instruct  # here, not in the job: never two builds at once
  rm -rf "$dir" && mkdir -p "$dir"
  local names commit
  names=$(nvidia-smi --query-gpu=index,name --format=csv,noheader 2>/dev/null \
          | awk -F', ' -v want=",$gpus," 'index(want, "," $1 ",") { print $2 }' || true)
  commit=${RLHF_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  "$PY" - "$dir/info.json" "$task" "$recipe" "$gpus" "$commit" "$names" "$@" <<'PY'
import json, sys, time
path, task, recipe, gpus, commit, names, *overrides = sys.argv[1:]
info = {"task": task, "recipe": recipe, "overrides": overrides, "cuda_visible_devices": gpus,
        "gpu_names": [n.strip() for n in names.splitlines() if n.strip()], "commit": commit,
        "started": time.time()}
open(path, "w").write(json.dumps(info) + "\n")
PY
  # on its GPUs' share of the host's cores (benchmarks/pin.py): runs side by side each get what a
  # one-GPU machine has, and one run's busy threads do not slow another's host-bound decode
  CUDA_VISIBLE_DEVICES=$gpus RAY_TMPDIR=/tmp/ray_ql_$task \
    setsid nohup "$PY" -m benchmarks.pin "$gpus" -- \
    bash benchmarks/qwen_learn.sh _job "$task" "$recipe" "$@" > "$dir/log.txt" 2>&1 < /dev/null &
  echo $! > "$dir/pid"
  echo "[qwen_learn] $task started on GPU $gpus (pid $!): $recipe, log $dir/log.txt"
}

_job() {  # the detached run of `start`: the GPUs on one line, the recipe, then exit.json
  local task=$1 recipe=$2; shift 2
  local dir=$RUNS/$task script=scripts/train_grpo.py rc=0
  echo $$ > "$dir/pid"  # the session leader, whichever way setsid started it
  [[ $(basename "$recipe") == dpo_* ]] && script=scripts/train_dpo.py
  mkdir -p "$RAY_TMPDIR"  # a Ray of its own: runs on other GPUs go on at the same time
  check_gpus "qwen_learn $task" && "$PY" "$script" --config "$recipe" output_dir="$dir" "$@" || rc=$?
  "$PY" -c "import json, sys, time; print(json.dumps({'rc': int(sys.argv[1]), 'ended': time.time()}))" "$rc" \
    > "$dir/exit.json"
  exit "$rc"
}

status() {
  "$PY" benchmarks/learning_record.py status "$RUNS"
}

wait_runs() {  # wait_runs MAX_S: until no run is running or MAX_S have passed, status every minute
  local start until busy now
  start=$(date +%s) until=$(( $(date +%s) + ${1:-540} ))
  while :; do
    busy=0 now=$(date +%s)
    for d in "$RUNS"/*/; do running "$d" && busy=1; done
    { [ "$busy" = 0 ] || [ "$now" -ge "$until" ]; } && break
    sleep $(( until - now < 10 ? until - now : 10 ))
    if (( ($(date +%s) - start) % 60 < 10 )); then echo "--- $(date -u +%H:%M:%S)"; status; fi
  done
  status
}

collect() {  # collect DIR: each run's files and the end of its log (of logs/ too if it failed) in one tarball
  local dest=${1:?collect DIR} tmp out
  ls "$RUNS"/*/info.json > /dev/null 2>&1 || { echo "qwen_learn.sh: no runs under $RUNS" >&2; return 1; }
  tmp=$(mktemp -d)
  for d in "$RUNS"/*/; do
    out=$tmp/qwen_learn/$(basename "$d")
    mkdir -p "$out"
    for f in info.json exit.json metrics.jsonl config.yaml metrics.png; do
      [ -f "$d/$f" ] && cp "$d/$f" "$out/"
    done
    [ -f "$d/log.txt" ] && tr '\r' '\n' < "$d/log.txt" | tail -n 300 > "$out/log_tail.txt"
    if [ -f "$d/exit.json" ] && ! grep -q '"rc": 0' "$d/exit.json" && [ -d "$d/logs" ]; then
      for f in "$d"/logs/*; do [ -f "$f" ] && { echo "=== $f"; tail -n 80 "$f"; }; done > "$out/logs_tail.txt"
    fi
  done
  mkdir -p "$dest"
  tar -C "$tmp" -czf "$dest/qwen_learn.tgz" qwen_learn
  rm -rf "$tmp"
  echo "[qwen_learn] $dest/qwen_learn.tgz: $(ls "$RUNS" | tr '\n' ' ')"
  status
}

case ${1:-} in
  start) shift; start "$@" ;;
  _job) shift; _job "$@" ;;
  status) status ;;
  wait) wait_runs "${2:-540}" ;;
  collect) collect "${2:-}" ;;
  *) echo "usage: bash benchmarks/qwen_learn.sh start TASK [GPUS] [key=value ...] | status | wait [MAX_S]" \
          "| collect DIR" >&2
     exit 2 ;;
esac
