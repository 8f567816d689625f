"""pass@k of a model on a recipe's held-out prompts, sampled with the recipe's generation engine.

    python scripts/evaluate.py --config configs/grpo_gsm8k_qwen2.5-0.5b_1gpu.yaml \\
        --model outputs/grpo_gsm8k_qwen2.5-0.5b_1gpu/checkpoints/step_000200/model eval.n=8 eval.k=[1,8] \\
        eval.temperature=0.6

`--model` is an HF model folder, a checkpoint written by training (`.../checkpoints/step_N` or its
`model/` folder) or a built-in model name; without it, the recipe's `model.path`. The prompts are
the first `eval.num_prompts` (0: all `data.num_eval`) of the task's held-out split; sampling is
`eval.n`, `eval.temperature`, `eval.max_new_tokens` (see rlhf/evaluate.py for what counts as
correct). Writes `eval_report.json` (pass@k overall and per level/subject, every sample) into
`--out` (default: next to a checkpoint, else the recipe's output_dir) and prints a table.
The engine runs in this process (no Ray); on GPU set generation.gpu_memory_utilization as you like.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rlhf.config import ConfigError, load_config  # noqa: E402
from rlhf.data.model_folder import check_model_files  # noqa: E402
from scripts.launch import with_compute_dtype  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML recipe: task, prompt template, generation, eval")
    p.add_argument("--model", help="model folder, training checkpoint or built-in name (default: model.path)")
    p.add_argument("--out", help="folder for eval_report.json (default: by a checkpoint, else output_dir)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.n=8 eval.k=[1,8]")
    return p.parse_args(argv)


def model_folder(name_or_path: str) -> str:
    """A loadable folder: a checkpoint `step_N/` means its `model/`; built-in names resolve as in training."""
    from rlhf.data.assets import resolve_model_path

    path = Path(name_or_path)
    if (path / "model" / "config.json").is_file():
        path = path / "model"
    return resolve_model_path(str(path))


def default_out(model: str, output_dir: str) -> Path:
    """Next to a training checkpoint (`.../step_N/model` -> `.../step_N`), else the recipe's output_dir."""
    path = Path(model)
    if path.name == "model" and (path.parent / "manifest.json").is_file():
        return path.parent
    return Path(output_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = with_compute_dtype(load_config(args.config, args.overrides))
        model = model_folder(args.model or cfg.model.path)
        check_model_files(model, key="--model" if args.model else "model.path")  # weights, tokenizer
        prepared = prepare(cfg, model)
    except (ConfigError, ValueError, OSError) as e:  # FileNotFoundError is an OSError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out(model, cfg.output_dir)
    run(cfg, model, *prepared, out=out, config_path=args.config)
    return 0


def prepare(cfg, model: str):
    """What can fail on bad input, before the engine starts: the prompts and the correctness checker."""
    from transformers import AutoTokenizer

    from rlhf.evaluate import load_eval_set
    from rlhf.scoring import PoolScorer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return load_eval_set(cfg, tokenizer), PoolScorer.correctness(cfg, tokenizer)


def run(cfg, model: str, eval_set, scorer, *, out: Path, config_path: str) -> None:
    from actors.actor_group import load_class
    from actors.cluster import GENERATORS
    from rlhf.config import config_to_dict
    from rlhf.evaluate import eval_sampling, evaluate, format_table, report, write_report
    from rlhf.scoring import correctness_spec

    start = time.perf_counter()
    try:
        generator = load_class(GENERATORS[cfg.generation.backend])(
            model, cfg.generation, dtype=cfg.model.dtype, seed=cfg.seed, enable_sleep=False,
            tensor_parallel_size=cfg.cluster.generator_tp,
        )
        try:
            result = evaluate(generator, scorer, eval_set, eval_sampling(cfg), cfg.eval.k)
        finally:
            generator.shutdown()
    finally:
        scorer.close()
    path = write_report(out / "eval_report.json", report(
        result, scorer.tokenizer, model=model, config=config_path, correctness=correctness_spec(cfg),
        eval=config_to_dict(cfg.eval), data=config_to_dict(cfg.data),
        seconds=round(time.perf_counter() - start, 1),
    ))
    print(format_table(result))
    print(f"report: {path}")


if __name__ == "__main__":
    sys.exit(main())
