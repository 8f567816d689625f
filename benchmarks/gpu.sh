#!/usr/bin/env bash
# grpo-gpu: ours against TRL 1.16 GRPOTrainer (use_vllm=True, vllm_mode="colocate") on one GPU, plus our
# VLLMGenerator alone on the same batch (in-loop generation efficiency). See benchmarks/README.md.
#
#   bash benchmarks/gpu.sh                     # every side; table; JSON line in benchmarks/results/grpo-gpu.jsonl
#   bash benchmarks/gpu.sh --parallel          # 2+ GPUs: ours and TRL at the same time, one GPU each (else in turn)
#   bash benchmarks/gpu.sh --parallel --tuned  # ... plus the tuned row: ours-tuned (memory.plan=auto), trl-vllm-tuned
#   bash benchmarks/gpu.sh --only ours         # one side per call (e.g. under a per-command time limit) ...
#   bash benchmarks/gpu.sh --only trl-vllm
#   bash benchmarks/gpu.sh --only ours-gen
#   bash benchmarks/gpu.sh --combine           # ... then one table from the latest record of each side
#   bash benchmarks/gpu.sh --profile           # torch.profiler traces (benchmarks/results/traces/grpo-gpu/)
#   bash benchmarks/gpu.sh --deadline 540      # a record within 540 s (each side its share; stopped sides keep their steps)
#   bash benchmarks/gpu.sh --results "$OUT"    # JSON lines somewhere else (any benchmarks/run.py option works)
#
# Python: $PYTHON, else .venv/bin/python, else python3; on a machine with parts staged by tests/gpu/stage.sh
# they are installed first (tests/gpu/install.sh). The random-weight Qwen2.5-1.5B is built once under
# <--workdir>/models/ next to the Qwen2 tokenizer (benchmarks/models.py: $TOKENIZER, else the asset cache's).
source "$(dirname "$0")/common.sh"  # strict mode, repository root, $PY
"$PY" - <<'PY'
import torch, vllm, trl, accelerate, ray, transformers
assert torch.cuda.is_available(), "grpo-gpu needs a CUDA device"
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"[gpu.sh] {len(names)} GPU(s): {', '.join(names)} | torch {torch.__version__} vllm {vllm.__version__} "
      f"trl {trl.__version__} transformers {transformers.__version__} ray {ray.__version__}", flush=True)
PY
exec "$PY" benchmarks/run.py --workload grpo-gpu "$@"
