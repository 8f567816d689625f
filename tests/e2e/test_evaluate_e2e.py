"""Every CPU recipe trains and logs its evaluation; scripts/evaluate.py on the checkpoint one wrote gives
the loop's final figures (pass@k itself: tests/unit/test_evaluate.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf.evaluate import pass_at_k
from rlhf.run.metrics import read_metrics
from tests.support.runs import private_ray_env

ROOT = Path(__file__).resolve().parents[2]


CI_SIZED = ["model.path=tiny-qwen2", "model.dtype=float32", "grpo.steps=1", "grpo.prompts_per_step=2",
            "grpo.group_size=2", "generation.max_new_tokens=8", "data.num_train=6", "data.num_eval=4",
            "eval_every=1", "eval.num_prompts=2", "eval.n=2", "eval.k=[1,2]", "eval.temperature=1.0",
            "learner.micro_batch_size=4", "reward.num_workers=1"]
# One recipe through vLLM (the engine's start is most of a run); the others through the HF generator.
RECIPES = {"gsm8k": ("scripts/train_gsm8k.py", "--cpu", "gsm_symbolic", "vllm"),
           "math": ("scripts/train_math.py", "--cpu", "champ", "hf"),
           "countdown": ("scripts/train_countdown.py", "--cpu", "countdown", "hf"),
           "game24": ("scripts/train_countdown.py", "--cpu --game24", "game24", "hf")}


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.parametrize("name", list(RECIPES))
def test_cpu_recipe_trains_and_logs_eval(name, tmp_path_factory):
    script, flags, task, backend = RECIPES[name]
    out = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, script, *flags.split(), f"output_dir={out}", f"generation.backend={backend}", *CI_SIZED]
    proc = subprocess.run(cmd, cwd=ROOT, env=private_ray_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["data"]["task"] == task and config["model"]["path"] == "tiny-qwen2"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # before the step, and after it
        assert 0.0 <= r[f"eval/{task}/pass@1"] <= r[f"eval/{task}/pass@2"] <= 1.0
        assert r[f"eval/{task}/response_len/mean"] > 0
    assert "reward/mean" in records[0] and (out / "checkpoints" / "step_000001" / "model").is_dir()
    if backend == "vllm":
        check_evaluate_cli_on_checkpoint(out, script_flags=flags, final=records[1], task=task)


def check_evaluate_cli_on_checkpoint(out: Path, *, script_flags: str, final: dict, task: str) -> None:
    """scripts/evaluate.py on the checkpoint folder training wrote, with the run's config: same weights,
    same engine, same eval seed, so the same samples as the loop's final evaluation."""
    recipe = {"--cpu": "configs/grpo_gsm8k_smollm2_cpu.yaml"}[script_flags]
    ckpt = out / "checkpoints" / "step_000001"
    cmd = [sys.executable, "scripts/evaluate.py", "--config", recipe, "--model", str(ckpt), *CI_SIZED]
    proc = subprocess.run(cmd, cwd=ROOT, env=private_ray_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((ckpt / "eval_report.json").read_text())  # next to the checkpoint by default
    assert data["model"] == str(ckpt / "model") and data["task"] == task and (data["num_prompts"], data["n"]) == (2, 2)
    for k in (1, 2):  # the report's pass@k is the estimator over its own per-prompt counts
        want = sum(pass_at_k(2, p["num_correct"], k) for p in data["prompts"]) / 2
        assert data["pass@k"][f"pass@{k}"] == pytest.approx(want)
    assert all(len(p["completions"]) == 2 for p in data["prompts"])
    assert data["metrics"] == pytest.approx({k: v for k, v in final.items() if k.startswith("eval/")})
    assert f"{task} (n=2)" in proc.stdout and "pass@2" in proc.stdout
