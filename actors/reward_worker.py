"""Reward scoring off the learners: one Ray actor that decodes completions, runs a `rewards.RewardPool`
and serves the learned rewards (reward models, judges) on its device share.

Where completions become text: here, once per step, in one batch (`rlhf.scoring.decode_completions`).
- Engines return token ids only: vLLM's incremental detokenizer runs inside the engine's loop,
  between decode steps, where it slows generation down by about a half ("Token ids out" in
  docs/design/generation.md has the figures). The HF backend returns ids too, so the backend cannot
  change the strings the rewards see.
- Decoding is the scorer's job (`PoolScorer`, which evaluation scores with in the driver), so the
  loop only forwards ids and the generation phase times the engines alone.

Where reward models run (`reward.model_device`, placed by actors/cluster.py, `reward_share`):
- `cpu`: no device share; fp32 in this process, as evaluation scores.
- `gpu`: a GPU share by the engines' rule: colocated, a slice of GPU 0 beside the engine and learner
  rank 0, the weights in host memory between scorings (`RewardModel(offload=True)`) and the freed
  cache returned, so the learners train with the memory; split, a GPU of its own, the weights
  resident. bf16 on a GPU (fp32 where the share is a CPU's: the same code path on CPU machines).
  Each step reports `memory/reward_peak_gib` (the device's allocated peak while scoring).
- Judges (`{judge: ...}`): the policy's engines (`EngineHandles`, their current weights), or the
  judge model's own engine of `generation.backend` in this process (`judge_model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import ray
import torch

from actors.actor_group import gather
from actors.device import detect
from actors.worker_setup import gc_paused, wait_for
from rlhf.config import GenerationConfig, RewardConfig, RewardFnConfig
from rlhf.data.batching import even_shards
from rlhf.types import Completion, PromptRow, SamplingSpec


class EngineHandles:
    """The policy's engine actors as a `Generator` for judges: a call's prompts sharded over them
    in order (like actors.engine_group.EngineGroup), answers concatenated in prompt order."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = list(engines)

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> list[Completion]:
        shards = even_shards(len(prompt_ids), len(self.engines))
        busy = [e for e, s in enumerate(shards) if len(s)]
        refs = [self.engines[e].generate.remote([list(p) for p in prompt_ids[shards[e].start:shards[e].stop]],
                                                sampling, shards[e].start) for e in busy]
        parts = gather(refs, [f"engine {e}" for e in busy], "judge")
        return [c for part in parts for c in part]


class RewardWorker:
    """Holds the policy's tokenizer, the process pool (time limits that bound a step, failures
    counted) and the learned rewards for the whole run."""

    @gc_paused()  # start-up: see actors/worker_setup.py
    def __init__(self, cfg: RewardConfig, tokenizer_path: str, *, offload: bool = False,
                 generation: GenerationConfig | None = None, dtype: str = "float32", seed: int = 0,
                 engines: Sequence[Any] = (), start_after: list | None = None) -> None:
        """`offload`: keep reward models in host memory between scorings (colocated on a GPU);
        `generation`, `dtype`, `seed`: what a judge model's own engine starts with; `engines`: the
        policy's engine actors, which judges without a model of their own ask; `start_after`: refs
        to wait for before touching the device (the colocated engines' start-up, actors/cluster.py)."""
        from transformers import AutoTokenizer

        from rlhf.scoring import PoolScorer

        wait_for(start_after)

        self.device = detect()
        on_gpu = self.device.kind != "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.generation, self.dtype, self.seed, self.engines = generation or GenerationConfig(), dtype, seed, engines
        self.judge_engines: list[Any] = []
        self.offload = offload and on_gpu
        self.scorer = PoolScorer(cfg.functions, tokenizer=self.tokenizer, timeout_s=cfg.timeout_s,
                                 num_workers=cfg.num_workers, warn_failed_frac=cfg.warn_failed_frac,
                                 device=self.device.torch_device(0),
                                 dtype=torch.bfloat16 if on_gpu else torch.float32, offload=self.offload,
                                 max_tokens_per_batch=cfg.max_tokens_per_batch, judge_engine=self._judge_engine)
        self.device.empty_cache()

    def _judge_engine(self, f: RewardFnConfig) -> tuple[Any, Any]:
        """The engine and tokenizer that answer judge entry `f` ("Judges" in the module docstring)."""
        from transformers import AutoTokenizer

        from actors.actor_group import load_class
        from actors.cluster import GENERATORS

        if not f.judge_model:
            if not self.engines:
                raise ValueError(f"reward judge '{f.judge}' has no judge_model and this worker no engines")
            return EngineHandles(self.engines), self.tokenizer
        cfg = dataclasses.replace(self.generation, gpu_memory_utilization=f.judge_memory_utilization)
        engine = load_class(GENERATORS[cfg.backend])(f.judge_model, cfg, dtype=self.dtype, seed=self.seed,
                                                     enable_sleep=False)
        self.judge_engines.append(engine)
        return engine, AutoTokenizer.from_pretrained(f.judge_model)

    def score(self, rows: list[PromptRow], token_ids: list[list[int]]
              ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """Rewards, metrics and the step's warning lines (`RewardPool.warnings`), which the driver prints."""
        on_gpu = self.device.kind != "cpu"
        if on_gpu:
            self.device.reset_peak()
        rewards, metrics, warnings = self.scorer.score_and_warnings(rows, token_ids)
        if on_gpu and self.scorer.learned:
            metrics["memory/reward_peak_gib"] = self.device.peak_memory_gib()
        if self.offload:
            self.device.empty_cache()  # the weights went back to host memory: give the learners their share
        return rewards, metrics, warnings

    def close(self) -> None:
        self.scorer.close()
        for engine in self.judge_engines:
            getattr(engine, "shutdown", lambda: None)()


class RayRewardScorer:
    """`rlhf.protocols.RewardScorer` backed by a RewardWorker actor; `tokenizer_path` is the policy's
    model folder (readable on the actor's node). `options`: the actor's Ray options (its device share
    and placement, from actors/cluster.py); `worker`: RewardWorker's keyword arguments."""

    def __init__(self, cfg: RewardConfig, tokenizer_path: str, *, options: dict[str, Any] | None = None,
                 **worker: Any) -> None:
        self.actor = ray.remote(RewardWorker).options(**(options or {"num_cpus": 0})).remote(
            cfg, tokenizer_path, **worker)

    def ready_ref(self) -> ray.ObjectRef:
        """A ref ready once the worker's constructor returned (its models loaded)."""
        return self.actor.__ray_ready__.remote()

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
