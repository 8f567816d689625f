"""Forced completion lengths (`generation.forced_lengths`): speed runs on random weights, where a
model never stops by itself, get the lengths of a long chain-of-thought workload instead.

`long_tail`: log-normal lengths with a median of 3/32 of the cap and 1% above 3/4 of it (at a cap
of 16k tokens: median 1.5k, 1% above 12k), cut to [1, cap]: the shape of reasoning traces, whose
longest samples hold up a synchronous step. Completion j of the run's g-th group (its g-th prompt)
draws from a generator seeded by (seed, g) alone, so every side of a benchmark, and every rollout
mode of ours, generates the same number of tokens for the same prompt.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rlhf.config import RunConfig

MEDIAN_FRAC = 3 / 32
TAIL_FRAC, TAIL_SHARE = 3 / 4, 0.01
SIGMA = math.log(TAIL_FRAC / MEDIAN_FRAC) / NormalDist().inv_cdf(1 - TAIL_SHARE)


def forced_lengths(kind: str, cap: int, seed: int, group: int, n: int) -> list[int]:
    """The token limits of the n completions of the run's group `group` under `kind` ("none": the
    cap for all)."""
    if kind == "none":
        return [cap] * n
    if kind != "long_tail":
        raise ValueError(f"forced lengths {kind!r}: 'none' or 'long_tail'")
    rng = np.random.default_rng([seed, group])
    draws = rng.lognormal(math.log(MEDIAN_FRAC * cap), SIGMA, size=n)
    return [int(min(max(round(x), 1), cap)) for x in draws]


def group_lengths(cfg: RunConfig, group: int) -> list[int]:
    """The token limits of the run's g-th group's completions under `cfg` (the one rule every rollout
    mode and every benchmark side uses)."""
    gen = cfg.generation
    return forced_lengths(gen.forced_lengths, gen.max_new_tokens, cfg.seed, group, cfg.grpo.group_size)
