"""Train a policy with GRPO on Ray (vLLM generation, FSDP2/DeepSpeed learners).

    python scripts/train_grpo.py --config configs/grpo_tiny_cpu.yaml [key=value ...]

Runs on a local Ray instance, or joins a cluster when `cluster.address` or RAY_ADDRESS is set
(as under `ray job submit`, see scripts/submit.sh). Bad config or reward specs print one line and
exit with status 2 before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rlhf.config import ConfigError, config_to_dict, load_config  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/grpo_tiny_cpu.yaml", help="YAML recipe (default: %(default)s)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.steps=5 learner.lr=1e-5")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        prepared = prepare_run(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(cfg, *prepared)
    return 0


def prepare_run(cfg):
    """Everything that can fail on bad input, checked before Ray starts: rewards load, the model
    resolves, the prompts load and tokenize."""
    from transformers import AutoTokenizer

    from rewards import load_reward_fn
    from rlhf.assets import resolve_model_path
    from rlhf.data import PromptStream, load_prompts, tokenize_prompts

    for fn in cfg.reward.functions:
        load_reward_fn(fn.function)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows, ids, dropped = tokenize_prompts(load_prompts(cfg.data, "train"), tokenizer, cfg.data)
    if dropped:
        print(f"data: dropped {dropped} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    return model_path, tokenizer, PromptStream(list(zip(rows, ids)), seed=cfg.data.seed)


def run(cfg, model_path: str, tokenizer, prompts) -> None:
    import ray
    import yaml

    from actors.cluster import build_cluster
    from rlhf.grpo import run_grpo
    from rlhf.plots import plot_metrics

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, log_to_driver=True)
    cluster = build_cluster(cfg, model_path)
    try:
        run_grpo(cfg, cluster, prompts, tokenizer)
    finally:
        cluster.shutdown()
        ray.shutdown()
    print(f"metrics: {out / 'metrics.jsonl'}  plot: {plot_metrics(out / 'metrics.jsonl')}")


if __name__ == "__main__":
    sys.exit(main())
