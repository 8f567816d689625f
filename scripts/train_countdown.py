"""GRPO on Countdown or the Game of 24 in one command: a default recipe, then scripts/train_grpo.py.

    python scripts/train_countdown.py                 # 1 GPU: Qwen2.5-1.5B-Instruct on Countdown
    python scripts/train_countdown.py --game24        # 1 GPU: the same on the Game of 24
    python scripts/train_countdown.py --cpu [--game24]  # CPU: SmolLM2-135M-Instruct (shipped puzzles)
    python scripts/train_countdown.py --config configs/grpo_countdown_qwen2.5-7b_8gpu_split.yaml

Every recipe is configs/grpo_{countdown,game24}_*.yaml; `--config` and key=value overrides work as in
train_grpo.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from scripts.train_grpo import main  # noqa: E402

RECIPES = {
    ("countdown", "gpu"): "configs/grpo_countdown_qwen2.5-1.5b_1gpu.yaml",
    ("countdown", "cpu"): "configs/grpo_countdown_smollm2_cpu.yaml",
    ("game24", "gpu"): "configs/grpo_game24_qwen2.5-1.5b_1gpu.yaml",
    ("game24", "cpu"): "configs/grpo_game24_smollm2_cpu.yaml",
}

if __name__ == "__main__":
    args = sys.argv[1:]
    recipe = RECIPES["game24" if "--game24" in args else "countdown", "cpu" if "--cpu" in args else "gpu"]
    sys.exit(main(["--config", recipe, *(a for a in args if a not in ("--cpu", "--game24"))]))
