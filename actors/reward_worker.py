"""Reward scoring off the learners: one Ray actor that decodes completions and runs a `rewards.RewardPool`.

Where completions become text: here, once per step, in one batch (`rlhf.scoring.decode_completions`).
- Engines return token ids only: vLLM's incremental detokenizer runs inside the engine's loop,
  between decode steps, where it slows generation down by about a half ("Token ids out" in
  docs/design/generation.md has the figures). The HF backend returns ids too, so the backend cannot
  change the strings the rewards see.
- Decoding is the scorer's job (`PoolScorer`, which evaluation scores with in the driver), so the
  loop only forwards ids and the generation phase times the engines alone.
- Cost: linear in the step's completions, a small share of the step next to generating them; if
  many engines make it show, the decode moves into the engines.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch

from actors.actor_group import gather
from actors.worker_setup import gc_paused
from rlhf.config import RewardConfig
from rlhf.types import PromptRow


class RewardWorker:
    """Holds the policy's tokenizer and the process pool (time limits that bound a step, failures
    counted) for the whole run."""

    @gc_paused()  # start-up: see actors/worker_setup.py
    def __init__(self, cfg: RewardConfig, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        from rlhf.scoring import PoolScorer

        self.scorer = PoolScorer(cfg.functions, tokenizer=AutoTokenizer.from_pretrained(tokenizer_path),
                                 timeout_s=cfg.timeout_s, num_workers=cfg.num_workers,
                                 warn_failed_frac=cfg.warn_failed_frac)

    def score(self, rows: list[PromptRow], token_ids: list[list[int]]
              ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """Rewards, metrics and the step's warning lines (`RewardPool.warnings`), which the driver prints."""
        return self.scorer.score_and_warnings(rows, token_ids)

    def close(self) -> None:
        self.scorer.close()


class RayRewardScorer:
    """`rlhf.protocols.RewardScorer` backed by a RewardWorker actor; `tokenizer_path` is the policy's
    model folder (readable on the actor's node)."""

    def __init__(self, cfg: RewardConfig, tokenizer_path: str) -> None:
        self.actor = ray.remote(RewardWorker).options(num_cpus=0).remote(cfg, tokenizer_path)

    def score(self, rows: Sequence[PromptRow], token_ids: Sequence[Sequence[int]]
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scored in the actor; a reward that failed on too many samples gets its line on the
        driver's terminal here (the actor's own stdout goes to its log)."""
        from rlhf.scoring import print_lines

        rewards, metrics, warnings = gather([self.actor.score.remote(list(rows), list(token_ids))],
                                            ["reward worker"], "reward")[0]
        print_lines(warnings)
        return rewards, metrics

    def shutdown(self) -> None:
        try:
            ray.get(self.actor.close.remote(), timeout=10.0)  # then killed: a teardown never hangs
        finally:
            ray.kill(self.actor)
