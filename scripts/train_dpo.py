"""Train a policy with DPO (or IPO, hinge, robust, SimPO) on the Ray learner group.

    python scripts/train_dpo.py --config configs/dpo_smollm2_cpu.yaml [key=value ...]

Offline: no generator, no reward workers; the learner group (FSDP2 or DeepSpeed) trains on
preference pairs and its frozen reference model (or precomputed reference log-probs) scores them.
Runs on a local Ray instance, or joins a cluster when `cluster.address` or RAY_ADDRESS is set (as
under `ray job submit`, see scripts/submit.sh). Bad config, data or model folders print one line and
exit with status 2 before anything starts; into an output_dir that holds an earlier run it starts
only with resume=true or overwrite=true. Ctrl-C stops it with one line saying where to resume from
(exit status 130).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from scripts.launch import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, "configs/dpo_tiny_cpu.yaml", "dpo", argv, prepare_run, run)


def prepare_run(cfg):
    """Everything that can fail on bad input, checked before Ray starts: the model resolves and its
    folder is complete, dpo.max_length fits its positions, the pairs load, parse and tokenize, and
    a resume fits its checkpoint."""
    from transformers import AutoTokenizer

    from rlhf.data.assets import resolve_model_path
    from rlhf.data.model_folder import check_context, check_model_files
    from rlhf.data.preferences import load_preference_data
    from rlhf.data.stream import PromptStream
    from rlhf.run.folder import check_resume

    model_path = resolve_model_path(cfg.model.path)
    check_model_files(model_path)
    check_context(cfg, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = load_preference_data(cfg, tokenizer)
    print("data: " + ", ".join(f"{k}={v}" for k, v in data.stats.items()))
    # the stream rlhf.dpo.run_dpo takes the pairs from: its checkpointed state must be this one's
    check_resume(cfg, model_path, PromptStream(list(enumerate(data.train)), seed=cfg.seed))
    return model_path, tokenizer, data


def run(cfg, model_path: str, tokenizer, data) -> None:
    from actors.cluster import build_learner_cluster
    from rlhf.dpo import run_dpo
    from rlhf.run.plots import plot_metrics
    from scripts.launch import ray_session

    with ray_session(cfg) as out:
        cluster = build_learner_cluster(cfg, model_path)
        try:
            run_dpo(cfg, cluster.learners, data, pad_id=tokenizer.pad_token_id)
        finally:
            cluster.shutdown()
    print(f"metrics: {out / 'metrics.jsonl'}  plot: {plot_metrics(out / 'metrics.jsonl')}")


if __name__ == "__main__":
    sys.exit(main())
