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
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
# No NVLink SHARP / multicast (NCCL, torch symmetric memory, NVSHMEM): the lent multi-GPU hosts do not allow it.
# Each layout's training script starts its own local Ray, whose actors inherit this environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$PY" - <<'PY'
import torch, vllm, ray, deepspeed, transformers
assert torch.cuda.is_available(), "grpo-gpu-scale needs CUDA devices"
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"[gpu_scale.sh] {len(names)} GPU(s): {', '.join(names)} | torch {torch.__version__} vllm {vllm.__version__} "
      f"deepspeed {deepspeed.__version__} transformers {transformers.__version__} ray {ray.__version__}", flush=True)
PY
"$PY" benchmarks/models.py random:qwen2.5-1.5b --tokenizer "${TOKENIZER:-.gpubundle/meta/tok.tar.xz}"
exec "$PY" benchmarks/scale.py "$@"
