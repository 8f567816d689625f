#!/usr/bin/env bash
# grpo-gpu-scale: our GRPO run on 1 and 2 GPUs (colocated FSDP2 / ZeRO-2, split), one layout after the other,
# one table and the issue's target lines (2 GPUs >= 1.8x the samples/s of 1; sync <= 0.3 s). See benchmarks/README.md.
#
#   bash benchmarks/gpu_scale.sh                             # every layout the visible GPUs allow
#   bash benchmarks/gpu_scale.sh --layouts 1gpu,2gpu-split   # some of them (any benchmarks/scale.py option works)
#   bash benchmarks/gpu_scale.sh --results "$OUT"            # JSON lines somewhere else
#
# Python: $PYTHON, else .venv/bin/python, else python3 (e.g. with the .gpubundle site-packages on PYTHONPATH).
# The random-weight Qwen2.5-1.5B is built once under outputs/bench/models/ next to the Qwen2 tokenizer from
# $TOKENIZER (default .gpubundle/meta/tok.tar.xz).
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
check_gpus gpu_scale.sh  # each layout's local Ray inherits its NCCL settings
"$PY" benchmarks/models.py random:qwen2.5-1.5b --tokenizer "${TOKENIZER:-.gpubundle/meta/tok.tar.xz}"
exec "$PY" benchmarks/scale.py "$@"
