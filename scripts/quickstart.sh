#!/usr/bin/env bash
# Set up .venv (first time: a few minutes) and run the main job: GRPO teaching SmolLM2-135M-Instruct
# single-digit sums on CPU (configs/quickstart_smollm2_cpu.yaml: the reward rises within a few
# minutes), then print the run's summary and write the plot.
#
#   bash scripts/quickstart.sh                  # the learning run, about 5 minutes on 2 cores
#   bash scripts/quickstart.sh --smoke          # the tiny random-weight run (configs/grpo_tiny_cpu.yaml), ~1 min
#   bash scripts/quickstart.sh --verbose        # also show the vLLM/Ray/learner logs (else in <output_dir>/logs/)
#   bash scripts/quickstart.sh grpo.steps=20    # any key=value override
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/quickstart_smollm2_cpu.yaml
args=()
fresh=overwrite=true  # running the quick start again starts it afresh (it says what it deleted) ...
for arg in "$@"; do
  case $arg in
    resume=*) fresh=; args+=("$arg") ;;  # ... unless it is asked to continue
    --smoke) config=configs/grpo_tiny_cpu.yaml ;;
    --verbose) args+=(logging.verbose=true) ;;
    *) args+=("$arg") ;;
  esac
done
bash scripts/setup.sh
exec .venv/bin/python scripts/train_grpo.py --config "$config" $fresh ${args[@]+"${args[@]}"}
