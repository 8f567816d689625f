# Sourced by the benchmarks/*.sh entry points: strict mode, the repository root as the working
# folder, and $PY, the Python to run: $PYTHON, else .venv/bin/python, else python3 (e.g. with the
# .gpubundle site-packages on PYTHONPATH).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
# A GPU machine without a registry: the packages and assets tests/gpu/stage.sh staged there.
if [ -d "${RLHF_GPU_STAGE:-/tmp/stage}" ]; then source tests/gpu/install.sh; fi

# check_gpus TAG: every GPU of a multi-GPU run, with the versions of the stack, on one line (fails
# without CUDA). No NVLink SHARP / multicast (NCCL, torch symmetric memory, NVSHMEM): the lent
# multi-GPU hosts do not allow it; the runs' local Ray actors inherit the setting.
check_gpus() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  "$PY" - "$1" <<'PY'
import sys
import torch, vllm, ray, deepspeed, transformers
assert torch.cuda.is_available(), f"{sys.argv[1]} needs CUDA devices"
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"[{sys.argv[1]}] {len(names)} GPU(s): {', '.join(names)} | torch {torch.__version__} vllm {vllm.__version__} "
      f"deepspeed {deepspeed.__version__} transformers {transformers.__version__} ray {ray.__version__}", flush=True)
PY
}
