"""The GRPO loop's own work between its timed phases, on the driver's CPU: what `timing/step_s` holds
beyond generate + reward + train + sync (~0.34 s a step on four H200s at 256 prompts x 8).

    python3 benchmarks/loop_overhead.py                         # 256 prompts x 8 x 256 tokens
    python3 benchmarks/loop_overhead.py --prompts 64 --tokens 512 --repeats 10

Stand-in rollouts of the given shape (random token ids, prompts of 60-79 tokens, every completion
at full length) go through the functions `rlhf.grpo.run_grpo` calls between its phases, each timed
alone: the median of `--repeats` calls after one warm-up, in milliseconds, one line each and a
total. No Ray, no model: what a faster driver would save on every step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlhf.algo.advantages import grpo_advantages  # noqa: E402
from rlhf.config import load_config  # noqa: E402
from rlhf.data.batching import rollouts_to_batch  # noqa: E402
from rlhf.grpo import SignalWatch, learning_signal, step_metrics  # noqa: E402
from rlhf.sampling import filter_overlong  # noqa: E402
from rlhf.types import Completion, PromptRow, RolloutBatch, StepMetrics  # noqa: E402


def stand_in_rollouts(prompts: int, group: int, tokens: int, seed: int = 0) -> RolloutBatch:
    """A scored step of `prompts` x `group` completions of `tokens` tokens (random ids)."""
    rng = random.Random(seed)
    return RolloutBatch(
        rows=[PromptRow(prompt=f"prompt {i}", answer="1") for i in range(prompts)],
        prompt_ids=[[rng.randrange(151_000) for _ in range(60 + i % 20)] for i in range(prompts)],
        completions=[Completion([rng.randrange(151_000) for _ in range(tokens)], [-0.5] * tokens, "length")
                     for _ in range(prompts * group)],
        group_size=group, rewards=torch.rand(prompts * group, generator=torch.Generator().manual_seed(seed)))


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(prompts: int, group: int, tokens: int, repeats: int) -> dict[str, float]:
    """{function: median ms} of the loop's driver-side work for one step of this shape."""
    cfg = load_config(REPO / "configs/grpo_tiny_cpu.yaml", [f"grpo.group_size={group}", f"grpo.prompts_per_step={prompts}",
                                                     f"generation.max_new_tokens={tokens}"])
    rollouts = stand_in_rollouts(prompts, group, tokens)
    advantages = grpo_advantages(rollouts.rewards, group, scale_by_std=True)
    batch = rollouts_to_batch(rollouts, advantages, 0)
    watch, seconds = SignalWatch(0, tokens), {"timing/step_s": 1.0, "timing/generate_s": 0.5}
    train = StepMetrics(loss=0.0, grad_norm=0.0, values={})
    return {
        "learning_signal": median_ms(lambda: learning_signal(rollouts), repeats),
        "SignalWatch.check": median_ms(lambda: watch.check(1, rollouts, 0.5), repeats),
        "grpo_advantages": median_ms(lambda: grpo_advantages(rollouts.rewards, group, scale_by_std=True), repeats),
        "rollouts_to_batch": median_ms(lambda: rollouts_to_batch(rollouts, advantages, 0), repeats),
        "filter_overlong": median_ms(lambda: filter_overlong(batch, rollouts, cfg.grpo), repeats),
        "step_metrics": median_ms(lambda: step_metrics(1, rollouts, batch, train, seconds), repeats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="completion tokens (every completion at full length)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.prompts, args.group, args.tokens, args.repeats) < 1:
        p.error("--prompts, --group, --tokens and --repeats must be at least 1")
    ms = measure(args.prompts, args.group, args.tokens, args.repeats)
    print(f"{args.prompts} prompts x {args.group} x {args.tokens} tokens, median of {args.repeats} (ms):")
    for name, value in ms.items():
        print(f"  {name:<20} {value:9.2f}")
    print(f"  {'total':<20} {sum(ms.values()):9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
