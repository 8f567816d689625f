"""GRPO on MATH in one command (evaluated on MATH-500): a default recipe, then scripts/train_grpo.py.

    python scripts/train_math.py             # 1 GPU: Qwen2.5-1.5B-Instruct, MATH train -> MATH-500
    python scripts/train_math.py --cpu       # CPU: SmolLM2-135M-Instruct on CHAMP (shipped data)
    python scripts/train_math.py --config configs/grpo_math_qwen2.5-7b_8gpu_split.yaml

Every recipe is configs/grpo_math_*.yaml; `--config` and key=value overrides work as in train_grpo.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from scripts.train_grpo import main  # noqa: E402

RECIPES = {"gpu": "configs/grpo_math_qwen2.5-1.5b_1gpu.yaml", "cpu": "configs/grpo_math_smollm2_cpu.yaml"}

if __name__ == "__main__":
    args = sys.argv[1:]
    recipe = RECIPES["cpu" if "--cpu" in args else "gpu"]
    sys.exit(main(["--config", recipe, *(a for a in args if a != "--cpu")]))  # a later --config wins
