"""Plan a recipe's memory for a GPU: per-GPU breakdown of the candidates, then the chosen settings.

    python scripts/plan.py --config configs/grpo_gsm8k_qwen2.5-1.5b_1gpu.yaml --gpu h200-141gb [key=value ...]
    python scripts/plan.py --config RECIPE --gpu-memory-gib 48 --gpus 4      # any other GPU, 4 of them

Reads the model's config.json only (or a known shape for hub ids; no weights). Keys set in the
recipe or the overrides are kept (`memory.plan: auto` applies the same plan at launch); the chosen
plan is printed last as `key=value` lines, ready to paste as overrides. A recipe that fits nowhere
prints one `error:` line naming the memory it needs and the setting to change, and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rlhf.config import ConfigError, explicit_keys, load_config  # noqa: E402
from rlhf.planner.memory import describe, make_plan, no_fit_message, plan_lines  # noqa: E402
from rlhf.planner.shapes import GPU_KINDS, model_shape  # noqa: E402
from scripts.launch import _one_line, _Parser, planned_gpu  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="auto", help=f"{'|'.join(GPU_KINDS)}|auto (default: this machine's)")
    parser.add_argument("--gpu-memory-gib", type=float, default=0.0,
                        help="memory per GPU, overriding the kind's (any other GPU)")
    parser.add_argument("--gpus", type=int, default=0,
                        help="GPUs of the run, sets learner.num_ranks unless set (default: the recipe's)")
    try:
        args = parser.parse(argv, "configs/grpo_tiny_cpu.yaml")
        cfg = load_config(args.config, args.overrides)
        if cfg.model.dtype == "auto":  # what a GPU computes in (actors.device.compute_dtype)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
        gpu = planned_gpu(args.gpu, args.gpu_memory_gib)
        if gpu is None:
            raise ConfigError(f"--gpu auto: this machine has no GPU; name one ({', '.join(GPU_KINDS)}) "
                              f"or give --gpu-memory-gib")
        pinned, shape = explicit_keys(args.config, args.overrides), model_shape(cfg.model.path)
        plan = make_plan(cfg, shape, gpu, pinned, args.gpus)
        print(f"model: {cfg.model.path}, {shape.params() / 1e9:.3g}B parameters, {cfg.model.dtype}")
        print(describe(plan))
        if plan.best is None:
            raise ConfigError(no_fit_message(cfg, shape, gpu, plan, pinned, args.gpus))
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    best = plan.best
    print(f"plan ({best.learner_s:.2f} s learner step predicted, {best.breakdown.need:.1f} GiB per GPU):")
    print("\n".join(plan_lines(plan)) or "(the recipe as written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
