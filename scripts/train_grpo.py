"""Train a policy with GRPO on Ray (vLLM generation, FSDP2/DeepSpeed learners).

    python scripts/train_grpo.py --config configs/grpo_tiny_cpu.yaml [key=value ...]

Runs on a local Ray instance, or joins a cluster when `cluster.address` or RAY_ADDRESS is set
(as under `ray job submit`, see scripts/submit.sh). Bad config, reward specs, data or model folders
print one line and exit with status 2 before anything starts; into an output_dir that holds an
earlier run it starts only with resume=true or overwrite=true. Ctrl-C stops it with one line saying
where to resume from (exit status 130).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from scripts.launch import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, "configs/grpo_tiny_cpu.yaml", "grpo", argv, prepare_run, run)


def prepare_run(cfg):
    """Everything that can fail on bad input, checked before Ray starts: rewards load, the model
    resolves and its folder is complete, the prompts load and tokenize and fit the model's
    positions with their completions, the held-out prompts (with `eval_every`) load, and a resume
    fits its checkpoint."""
    from transformers import AutoTokenizer

    from rlhf.data.assets import resolve_model_path
    from rlhf.data.model_folder import check_context, check_model_files
    from rlhf.data.prompts import load_prompts, tokenize_prompts
    from rlhf.data.stream import PromptStream
    from rlhf.evaluate import load_eval_set
    from rlhf.run.folder import check_resume
    from rlhf.scoring import check_rewards

    check_rewards(cfg.reward.functions)
    model_path = resolve_model_path(cfg.model.path)
    check_model_files(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows, ids, dropped = tokenize_prompts(load_prompts(cfg.data, "train"), tokenizer, cfg.data)
    if dropped:
        print(f"data: dropped {dropped} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    check_context(cfg, model_path, max(map(len, ids), default=0))
    prompts = PromptStream(list(zip(rows, ids)), seed=cfg.data.seed)
    check_resume(cfg, model_path, prompts)
    eval_set = load_eval_set(cfg, tokenizer) if cfg.eval_every else None
    return model_path, tokenizer, prompts, eval_set


def run(cfg, model_path: str, tokenizer, prompts, eval_set) -> None:
    from actors.cluster import build_cluster
    from rlhf.grpo import run_grpo
    from rlhf.run.plots import plot_metrics
    from scripts.launch import ray_session

    with ray_session(cfg) as out:
        cluster = build_cluster(cfg, model_path)
        try:
            run_grpo(cfg, cluster, prompts, tokenizer, eval_set)
        finally:
            cluster.shutdown()
    print(f"metrics: {out / 'metrics.jsonl'}  plot: {plot_metrics(out / 'metrics.jsonl')}")


if __name__ == "__main__":
    sys.exit(main())
