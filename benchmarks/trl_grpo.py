"""TRL 1.16 `GRPOTrainer` on a benchmark workload: the TRL side of benchmarks/run.py.

    python benchmarks/trl_grpo.py --recipe configs/grpo_smollm2_cpu.yaml --generation hf --out side.json \\
        model.path=smollm2-135m-instruct grpo.steps=5 ...      # the overrides our side gets

Resolves the same RunConfig as our run, builds `GRPOConfig` from it
(`benchmarks.workloads.trl_grpo_kwargs`), feeds TRL our prompts in our order and our reward
functions, and writes a side record (benchmarks/sidecommon.py) with, per optimizer step:
  step_s      wall time from the end of the previous step (or from the start of training)
  generate_s  time in `_generate_single_turn`, weight sync excluded
  sync_s      time in the vLLM weight sync (0 with transformers generation: no second copy)
  reward_s    time in `_calculate_rewards`
  train_s     step_s minus `_generate_and_score_completions` (forward, backward, optimizer)
  gen_tokens, train_tokens (prompt + completion), reward_mean, response_len_mean
  prompts_match  TRL tokenized exactly our prompt ids, each repeated group_size times
With `generation.forced_lengths` (vLLM generation), each completion gets our limit (`force_lengths`).
The trainer is subclassed only to time those methods; what runs is TRL's code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.sidecommon import load_run_config, run_side, side_parser, step_clock  # noqa: E402


def make_reward(cfg: Any):
    """One TRL reward function: our weighted reward functions, called as our reward pool calls
    them (prompt text, completion text, answer + meta as keywords; None and errors score 0)."""
    from rewards.api import combine

    scorer = combine(cfg.reward.functions)

    def reward(prompts, completions, prompt_text, row_json, **_):
        out = []
        for prompt, completion, row in zip(prompt_text, completions, row_json):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            try:
                out.append(float(scorer(prompt, text, **json.loads(row))))
            except Exception:  # the pool scores a raising reward 0; so do we
                out.append(0.0)
        return out

    return reward


def build_dataset(cfg: Any, tokenizer: Any):
    """Our step prompts in our order, as a TRL prompt dataset; and the expected prompt ids per step."""
    from datasets import Dataset

    from benchmarks.workloads import grpo_step_prompts, reward_columns, trl_prompt

    steps = grpo_step_prompts(cfg, tokenizer)
    rows = [row for step in steps for row, _ in step]
    data = Dataset.from_list([{"prompt": trl_prompt(r, cfg), "prompt_text": r.user_text(),
                               "row_json": reward_columns(r)} for r in rows])
    expected = [[ids for _, ids in step for _ in range(cfg.grpo.group_size)] for step in steps]
    return data, expected


def main(argv: list[str] | None = None) -> int:
    p = side_parser(__doc__)
    p.add_argument("--generation", choices=["hf", "vllm"], default="hf",
                   help="TRL's transformers generation (hf) or its vLLM colocate mode")
    args = p.parse_args(argv)
    name = "trl-vllm" if args.generation == "vllm" else "trl"
    return run_side(name, args.out, lambda record: train(args, record))


def train(args: Any, record: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.workloads import trl_grpo_kwargs
    from rlhf.data.assets import resolve_model_path

    cfg = load_run_config(args.recipe, args.overrides)
    model_path = resolve_model_path(cfg.model.path)
    use_cpu = not torch.cuda.is_available()
    if use_cpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.generation.cpu_kvcache_gib)  # as our generator sets it
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset, expected = build_dataset(cfg, tokenizer)
    kwargs = trl_grpo_kwargs(cfg, use_vllm=args.generation == "vllm", ignore_eos=args.ignore_eos,
                             output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
                             use_cpu=use_cpu)
    record["trl_config"] = kwargs
    record["torch_threads"] = torch.get_num_threads()
    current: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        current[key] = current.get(key, 0.0) + value

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            add("score_s", time.perf_counter() - t)
            return out

        def _generate_single_turn(self, prompt_ids, *a, **kw):
            sync_before = current.get("sync_s", 0.0)
            t = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
            add("generate_s", time.perf_counter() - t - (current.get("sync_s", 0.0) - sync_before))
            add("gen_tokens", sum(len(c) for c in completion_ids))
            add("prompt_tokens", sum(len(p) for p in prompt_ids))
            add("completions", len(completion_ids))
            step = len(record["steps"])
            current["prompts_match"] = float(step < len(expected) and [list(p) for p in prompt_ids] == expected[step])
            return completion_ids, logprobs

        def _calculate_rewards(self, *a, **kw):
            t = time.perf_counter()
            rewards_per_func = super()._calculate_rewards(*a, **kw)
            add("reward_s", time.perf_counter() - t)
            add("reward_sum", float(torch.nansum(rewards_per_func.sum(dim=1))))
            return rewards_per_func

    def close_step(step_s: float) -> None:
        n = max(current.get("completions", 0.0), 1.0)
        record["steps"].append({
            "step": len(record["steps"]), "step_s": step_s,
            "generate_s": current.get("generate_s", 0.0), "sync_s": current.get("sync_s", 0.0),
            "reward_s": current.get("reward_s", 0.0), "train_s": step_s - current.get("score_s", 0.0),
            "gen_tokens": current.get("gen_tokens", 0.0),
            "train_tokens": current.get("prompt_tokens", 0.0) + current.get("gen_tokens", 0.0),
            "reward_mean": current.get("reward_sum", 0.0) / n,
            "response_len_mean": current.get("gen_tokens", 0.0) / n,
            "prompts_match": bool(current.get("prompts_match", 0.0)),
        })
        current.clear()

    trainer = TimedGRPOTrainer(model=model_path, reward_funcs=[make_reward(cfg)], args=GRPOConfig(**kwargs),
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[step_clock(record, args, close_step)()])
    if cfg.generation.forced_lengths != "none":
        force_lengths(trainer.vllm_generation.llm, cfg)
    if args.generation == "vllm":
        generation = trainer.vllm_generation
        sync = generation.sync_weights

        def timed_sync():
            t = time.perf_counter()
            sync()
            add("sync_s", time.perf_counter() - t)

        generation.sync_weights = timed_sync
    trainer.train()


def force_lengths(llm: Any, cfg: Any) -> None:
    """Our forced lengths (`generation.forced_lengths`) on TRL's colocated vLLM: TRL sends one copy of a
    prompt per completion, in our order, so the run's completion i is sample i % G of group i // G and
    gets that sample's limit (rlhf.data.lengths), as ours does."""
    from rlhf.data.lengths import group_lengths

    generate, seen, g = llm.generate, [0], cfg.grpo.group_size

    def per_completion(prompts: list[Any], sampling_params: Any = None, **kwargs: Any) -> Any:
        first, last = seen[0] // g, (seen[0] + len(prompts) - 1) // g
        limits = [n for group in range(first, last + 1) for n in group_lengths(cfg, group)]
        params = []
        for i in range(len(prompts)):
            params.append(sampling_params.clone())
            params[-1].max_tokens = limits[seen[0] + i - first * g]
        seen[0] += len(prompts)
        return generate(prompts, sampling_params=params, **kwargs)

    llm.generate = per_completion


if __name__ == "__main__":
    raise SystemExit(main())
