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

import numpy as np

MEDIAN_FRAC = 3 / 32
TAIL_FRAC, TAIL_SHARE = 3 / 4, 0.01
Z_99 = 2.3263478740408408  # the standard normal's 99th percentile
SIGMA = math.log(TAIL_FRAC / MEDIAN_FRAC) / Z_99


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
