#!/usr/bin/env bash
# grpo-gpu-scale: our GRPO run over 1, 2, 4 (and 8) GPUs, layouts on disjoint GPUs at the same time, one
# table, the issue's target lines and a plot of samples/s against GPUs. See benchmarks/README.md.
#
#   bash benchmarks/gpu_scale.sh                             # the colocated FSDP2 line the visible GPUs allow
#   bash benchmarks/gpu_scale.sh --prompts 256               # strong scaling on a node-sized step
#   bash benchmarks/gpu_scale.sh --weak 64                   # weak scaling: 64 prompts per GPU
#   bash benchmarks/gpu_scale.sh --engines-per-gpu 2         # two vLLM engines beside each learner rank
#   bash benchmarks/gpu_scale.sh --layouts 1gpu,4gpu-split-zero2,4gpu-split-zero2-async   # any of LAYOUTS
#   bash benchmarks/gpu_scale.sh --results "$OUT"            # JSON lines (and the plot) somewhere else
#
# Python: $PYTHON, else .venv/bin/python, else python3; on a machine with parts staged by tests/gpu/stage.sh
# they are installed first (tests/gpu/install.sh). The random-weight Qwen2.5-1.5B is built once under
# <--workdir>/models/ next to the Qwen2 tokenizer (benchmarks/models.py: $TOKENIZER, else the asset cache's).
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
check_gpus gpu_scale.sh  # each layout's local Ray inherits its NCCL settings
exec "$PY" benchmarks/scale.py "$@"
