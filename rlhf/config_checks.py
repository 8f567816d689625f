"""The config's validation: range checks per section, then the settings under which a run cannot
learn. Each raises `ConfigError` (rlhf.errors, also importable from rlhf.config) with one line naming
the key and what is allowed; `RunConfig.__post_init__` runs `validate`. Validation is of values
only: it reads no file and imports no user code, so building a config never runs a user's module
(what the launch checks beyond the values, files and user code, is rlhf/run/preflight.py).

What counts as "cannot learn" for GRPO (each refused, with the reason):
1. Every sample of a group identical: greedy generation (`generation.temperature=0`) or
   `generation.top_k=1`. Advantages are rewards minus the group mean, so all of them are 0.
2. Every reward weight 0: every reward, and so every advantage, is 0.
3. A clip range of [1, 1] (`grpo.clip_low=0` and `grpo.clip_high=0`) with several updates per
   step: after the first update the ratio moves off 1 and every token is clipped, so the later
   updates change nothing (the first, at ratio exactly 1, still passes its gradient).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rlhf.errors import ConfigError

if TYPE_CHECKING:
    from rlhf.config import (DataConfig, DPOConfig, EnvConfig, EvalConfig, GenerationConfig, LearnerConfig,
                             RewardConfig, RewardFnConfig, RunConfig)


def check(ok: bool, key: str, allowed: str, value: Any) -> None:
    """Raise ConfigError(`key=value is not allowed: allowed`) naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}", key=key)


def validate(c: RunConfig) -> None:
    """Every check below, section by section: a section's own ranges take that section only; the
    checks that relate sections take the whole config."""
    _run(c)
    _grpo(c)
    _dpo(c.dpo)
    _eval(c.eval)
    _learner(c.learner)
    _generation(c.generation)
    _quantization(c)
    _reward(c.reward)
    _env(c.env)
    _data(c.data)
    _cluster(c)
    if c.algorithm == "grpo":
        _grpo_can_learn(c)


def _run(c: RunConfig) -> None:
    check(c.seed >= 0, "seed", "an integer >= 0", c.seed)
    check(c.save_every >= -1, "save_every", "an integer >= -1 (0 = only at the end, -1 = never)", c.save_every)
    check(c.keep_checkpoints >= 0, "keep_checkpoints", "an integer >= 0 (0 = keep all)", c.keep_checkpoints)
    check(c.eval_every >= 0, "eval_every", "an integer >= 0 (0 = never)", c.eval_every)
    check(not (c.overwrite and c.resume), "overwrite", "false when resume is set (resume continues the run "
          "that overwrite would delete)", c.overwrite)
    check(c.memory.gpu_memory_gib >= 0, "memory.gpu_memory_gib", "a number >= 0 (0 = the GPU kind's)",
          c.memory.gpu_memory_gib)
    check(len(c.logging.backends) >= 1 and len(set(c.logging.backends)) == len(c.logging.backends),
          "logging.backends", "a non-empty list without repeats of jsonl, tensorboard, wandb, mlflow",
          list(c.logging.backends))


def _grpo(c: RunConfig) -> None:
    g = c.grpo
    check(g.steps >= 1, "grpo.steps", "an integer >= 1", g.steps)
    check(g.prompts_per_step >= 1, "grpo.prompts_per_step", "an integer >= 1", g.prompts_per_step)
    check(g.group_size >= 2, "grpo.group_size", "an integer >= 2 (advantages compare samples of a group)",
          g.group_size)
    check(0 <= g.clip_low < 1, "grpo.clip_low", "a number in [0, 1)", g.clip_low)
    check(g.clip_high >= 0, "grpo.clip_high", "a number >= 0", g.clip_high)
    check(g.kl_coef >= 0, "grpo.kl_coef", "a number >= 0", g.kl_coef)
    check(g.updates_per_step >= 1, "grpo.updates_per_step", "an integer >= 1", g.updates_per_step)
    check(g.max_staleness >= 0, "grpo.max_staleness", "an integer >= 0 (0 = on-policy)", g.max_staleness)
    check(g.is_cap >= 1 and math.isfinite(g.is_cap), "grpo.is_cap", "a finite number >= 1", g.is_cap)
    check(0 <= g.overlong_buffer <= c.generation.max_new_tokens, "grpo.overlong_buffer",
          f"an integer in [0, generation.max_new_tokens={c.generation.max_new_tokens}] (0 = a quarter of it)",
          g.overlong_buffer)
    check(g.overlong_penalty_factor >= 0 and math.isfinite(g.overlong_penalty_factor),
          "grpo.overlong_penalty_factor", "a finite number >= 0", g.overlong_penalty_factor)
    check(g.max_sampling_rounds >= 1, "grpo.max_sampling_rounds", "an integer >= 1", g.max_sampling_rounds)
    check(not (g.dynamic_sampling and g.max_staleness > 0), "grpo.dynamic_sampling",
          "false with grpo.max_staleness > 0 (it decides on rewards before the next generation)",
          g.dynamic_sampling)
    _streaming(c)


def _streaming(c: RunConfig) -> None:
    """`grpo.rollouts: stream | partial` (rlhf.partial) and forced lengths: vLLM engines, single-turn."""
    g = c.grpo
    check(g.rollouts != "stream" or g.max_staleness == 0, "grpo.max_staleness",
          "0 with grpo.rollouts=stream (on-policy streaming; grpo.rollouts=partial runs samples across versions)",
          g.max_staleness)
    check(g.rollouts != "partial" or g.max_staleness >= 1, "grpo.max_staleness",
          ">= 1 with grpo.rollouts=partial (a paused sample continues under the next version)", g.max_staleness)
    check(g.rollouts != "partial" or 1 <= g.overprovision <= g.max_staleness + 1, "grpo.overprovision",
          f"a number in [1, grpo.max_staleness + 1 = {g.max_staleness + 1}] (groups running per prompts_per_step;"
          " more could not be trained within the staleness bound)", g.overprovision)
    if g.rollouts != "batch":
        check(c.generation.backend == "vllm", "grpo.rollouts", "batch with generation.backend=hf (streaming "
              "needs vLLM's engine)", g.rollouts)
        check(not g.dynamic_sampling, "grpo.dynamic_sampling", f"false with grpo.rollouts={g.rollouts}",
              g.dynamic_sampling)
        check(g.rollouts != "partial" or (not c.env.tools and c.env.environment is None), "grpo.rollouts",
              "batch or stream with multi-turn episodes (env.tools or env.environment): a paused episode's "
              "environment is not checkpointed", g.rollouts)
    check(c.generation.forced_lengths == "none" or c.generation.backend == "vllm", "generation.forced_lengths",
          "none with generation.backend=hf (per-sample limits are vLLM requests)", c.generation.forced_lengths)


def _dpo(d: DPOConfig) -> None:
    check(d.beta > 0, "dpo.beta", "a number > 0", d.beta)
    check(0 <= d.label_smoothing < 0.5, "dpo.label_smoothing", "a number in [0, 0.5)", d.label_smoothing)
    check(d.epochs >= 1, "dpo.epochs", "an integer >= 1", d.epochs)
    check(d.pairs_per_step >= 1, "dpo.pairs_per_step", "an integer >= 1", d.pairs_per_step)
    check(d.max_steps >= 0, "dpo.max_steps", "an integer >= 0 (0 = all epochs)", d.max_steps)
    check(d.num_train >= 0, "dpo.num_train", "an integer >= 0 (0 = all rows)", d.num_train)
    check(d.num_eval >= 0, "dpo.num_eval", "an integer >= 0", d.num_eval)
    check(d.max_prompt_length >= 1, "dpo.max_prompt_length", "an integer >= 1", d.max_prompt_length)
    check(d.max_length > d.max_prompt_length, "dpo.max_length", "an integer > dpo.max_prompt_length",
          d.max_length)


def _eval(ev: EvalConfig) -> None:
    check(ev.n >= 1, "eval.n", "an integer >= 1", ev.n)
    check(len(ev.k) >= 1 and all(1 <= k <= ev.n for k in ev.k), "eval.k", f"integers in [1, eval.n={ev.n}]",
          list(ev.k))
    check(ev.temperature >= 0, "eval.temperature", "a number >= 0", ev.temperature)
    check(ev.n == 1 or ev.temperature > 0, "eval.temperature", "> 0 when eval.n > 1 (greedy samples are "
          "all the same)", ev.temperature)
    check(ev.max_new_tokens >= 0, "eval.max_new_tokens", "an integer >= 0 (0 = generation.max_new_tokens)",
          ev.max_new_tokens)
    check(ev.num_prompts >= 0, "eval.num_prompts", "an integer >= 0 (0 = all of data.num_eval)",
          ev.num_prompts)


def _learner(l: LearnerConfig) -> None:
    check(l.lr > 0 and math.isfinite(l.lr), "learner.lr", "a finite number > 0", l.lr)
    check(l.weight_decay >= 0, "learner.weight_decay", "a number >= 0", l.weight_decay)
    check(all(0 <= b < 1 for b in l.betas), "learner.betas", "two numbers in [0, 1)", l.betas)
    check(l.num_ranks >= 1, "learner.num_ranks", "an integer >= 1", l.num_ranks)
    check(l.micro_batch_size >= 1, "learner.micro_batch_size", "an integer >= 1", l.micro_batch_size)
    check(l.max_tokens_per_micro_batch >= 0, "learner.max_tokens_per_micro_batch",
          "an integer >= 0 (0 = learner.micro_batch_size rows per micro-batch)", l.max_tokens_per_micro_batch)
    check(l.max_grad_norm > 0, "learner.max_grad_norm", "a number > 0", l.max_grad_norm)
    check(l.max_nonfinite_steps >= 0, "learner.max_nonfinite_steps", "an integer >= 0", l.max_nonfinite_steps)
    check(l.lora_rank >= 0, "learner.lora_rank", "an integer >= 0 (0 = full fine-tuning)", l.lora_rank)
    check(l.lora_alpha > 0, "learner.lora_alpha", "a number > 0", l.lora_alpha)
    check(0 <= l.lora_dropout < 1, "learner.lora_dropout", "a number in [0, 1)", l.lora_dropout)
    check(len(l.lora_target_modules) >= 1 and all(l.lora_target_modules), "learner.lora_target_modules",
          "a non-empty list of module names, or [all-linear]", list(l.lora_target_modules))
    check(l.warmup_steps >= 0, "learner.warmup_steps", "an integer >= 0", l.warmup_steps)
    check(not (l.share_prompts and l.pack_sequences), "learner.share_prompts",
          "false while learner.pack_sequences=true (two ways of laying out a micro-batch)", l.share_prompts)
    check(l.attention != "varlen" or l.pack_sequences, "learner.attention",
          "not varlen unless learner.pack_sequences=true (varlen attends packed rows)", l.attention)
    check(not (l.compile and l.liger), "learner.compile",
          "false with learner.liger=true (both fuse the same work, and Liger's kernels do not trace under "
          "torch.compile: choose one)", l.compile)
    check(l.head_kernels == "eager" or l.fused_head, "learner.head_kernels",
          "'eager' with learner.fused_head=false (the kernels are the fused head's)", l.head_kernels)
    check(not l.head_keep_logits or l.fused_head, "learner.head_keep_logits",
          "false with learner.fused_head=false (the logits kept are the fused head's)", l.head_keep_logits)
    check(not l.compile or l.backend == "fsdp2", "learner.compile",
          "false with learner.backend=deepspeed (ZeRO's parameter hooks inside the layers break the graph)", l.compile)
    check(not l.cast_once_per_step or l.backend == "fsdp2", "learner.cast_once_per_step",
          "false with learner.backend=deepspeed (an FSDP2 setting)", l.cast_once_per_step)


def _generation(gen: GenerationConfig) -> None:
    check(gen.max_num_seqs >= 0, "generation.max_num_seqs", "an integer >= 0 (0 = vLLM's default)",
          gen.max_num_seqs)
    check(gen.max_num_batched_tokens >= 0, "generation.max_num_batched_tokens",
          "an integer >= 0 (0 = vLLM's default)", gen.max_num_batched_tokens)
    check(gen.max_new_tokens >= 1, "generation.max_new_tokens", "an integer >= 1", gen.max_new_tokens)
    check(gen.temperature >= 0 and math.isfinite(gen.temperature), "generation.temperature",
          "a finite number >= 0", gen.temperature)
    check(0 < gen.top_p <= 1, "generation.top_p", "a number in (0, 1]", gen.top_p)
    check(gen.top_k == -1 or gen.top_k >= 1, "generation.top_k", "-1 or an integer >= 1", gen.top_k)
    check(0 < gen.gpu_memory_utilization <= 1, "generation.gpu_memory_utilization", "a number in (0, 1]",
          gen.gpu_memory_utilization)
    check(gen.cpu_kvcache_gib >= 1, "generation.cpu_kvcache_gib", "an integer >= 1", gen.cpu_kvcache_gib)


def _quantization(c: RunConfig) -> None:
    """FP8 rollouts need vLLM and bf16 weights (vLLM's FP8 takes bf16/fp16 only); whether the device
    has FP8 is checked at launch (actors.vllm_generator.refuse_quantization)."""
    q = c.generation.quantization
    check(q == "none" or c.generation.backend == "vllm", "generation.quantization",
          "none with generation.backend=hf (FP8 rollouts are vLLM's)", q)
    check(q == "none" or c.model.dtype != "float32", "generation.quantization",
          "none with model.dtype=float32 (vLLM quantizes bf16 weights to FP8: set model.dtype=bfloat16)", q)


def _reward(r: RewardConfig) -> None:
    check(len(r.functions) >= 1, "reward.functions", "at least one reward function", [])
    check(r.timeout_s > 0, "reward.timeout_s", "a number > 0", r.timeout_s)
    check(r.max_failed_steps >= 1, "reward.max_failed_steps", "an integer >= 1", r.max_failed_steps)
    check(0 < r.warn_failed_frac <= 1, "reward.warn_failed_frac", "a number in (0, 1]", r.warn_failed_frac)
    check(r.num_workers == "auto" or r.num_workers >= 1, "reward.num_workers", "'auto' or an integer >= 1",
          r.num_workers)
    check(r.max_tokens_per_batch >= 0, "reward.max_tokens_per_batch",
          "an integer >= 0 (0 = reward.functions[i].batch_size rows per batch)", r.max_tokens_per_batch)
    for i, fn in enumerate(r.functions):
        _reward_entry(i, fn)


def _reward_entry(i: int, fn: RewardFnConfig) -> None:
    """One `reward.functions` entry: exactly one of function, model, judge, and its own settings."""
    from rewards.judges import template_problem

    key = f"reward.functions[{i}]"
    kinds = [k for k in ("function", "model", "judge") if getattr(fn, k)]
    if not kinds:
        raise ConfigError(f"{key}.function is required (or {key}.model, a reward model folder, or "
                          f"{key}.judge, a judge template)", key=key)
    check(len(kinds) == 1, f"{key}.{kinds[-1]}", f"empty when {key}.{kinds[0]} is set (one reward per entry)",
          getattr(fn, kinds[-1]))
    check(bool(fn.model or fn.judge) or ":" in fn.function, f"{key}.function",
          "'package.module:function' or 'path/to/file.py:function'", fn.function)
    check(fn.batch_size >= 1, f"{key}.batch_size", "an integer >= 1", fn.batch_size)
    check(math.isfinite(fn.weight), f"{key}.weight", "a finite number", fn.weight)
    check(not fn.judge_model or bool(fn.judge), f"{key}.judge_model", f"empty unless {key}.judge is set "
          "(the judge's own model)", fn.judge_model)
    if fn.judge:
        problem = template_problem(fn.judge)
        check(problem is None, f"{key}.judge", problem or "", fn.judge)
    check(fn.judge_max_tokens >= 1, f"{key}.judge_max_tokens", "an integer >= 1", fn.judge_max_tokens)
    check(0 < fn.judge_memory_utilization < 1, f"{key}.judge_memory_utilization", "a number in (0, 1)",
          fn.judge_memory_utilization)


def _env(e: EnvConfig) -> None:
    check(e.max_turns >= 1, "env.max_turns", "an integer >= 1", e.max_turns)
    check(e.tool_timeout_s > 0, "env.tool_timeout_s", "a number > 0 (seconds)", e.tool_timeout_s)
    check(e.max_tool_output_chars >= 1, "env.max_tool_output_chars", "an integer >= 1",
          e.max_tool_output_chars)
    for i, spec in enumerate(e.tools):
        check(isinstance(spec, str) and ":" in spec, f"env.tools[{i}]",
              "'package.module:function' or 'path/to/file.py:function'", spec)
    if e.environment is not None:
        check(isinstance(e.environment, str) and ":" in e.environment, "env.environment",
              "'package.module:Name' or 'path/to/file.py:Name' (a class or function row -> episode)",
              e.environment)
        check(not e.tools, "env.environment", "unset while env.tools is set (the tools run in the built-in "
              "tool environment; an environment of your own runs its own)", e.environment)


def _data(d: DataConfig) -> None:
    check(d.num_train >= 1, "data.num_train", "an integer >= 1", d.num_train)
    check(d.num_eval >= 0, "data.num_eval", "an integer >= 0", d.num_eval)
    check(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", "an integer >= 1", d.max_prompt_tokens)


def _cluster(c: RunConfig) -> None:
    """Engine count and width against the learners and the prompts (what the GPU count allows is
    checked at launch, against the Ray cluster: rlhf.rules.engine_count)."""
    cl, ranks = c.cluster, c.learner.num_ranks
    check(cl.timeout_s > 0, "cluster.timeout_s", "a number > 0 (seconds)", cl.timeout_s)
    check(cl.generator_tp >= 1, "cluster.generator_tp", "an integer >= 1", cl.generator_tp)
    check(cl.placement == "split" or cl.generator_tp == 1, "cluster.generator_tp",
          "1 with placement=colocated (an engine shares one learner's device; tensor-parallel engines "
          "need placement=split)", cl.generator_tp)
    k = cl.engines_per_gpu
    check(k >= 1, "cluster.engines_per_gpu", "an integer >= 1", k)
    check(k == 1 or cl.placement == "split", "cluster.engines_per_gpu",
          "1 with placement=colocated (there, generator_engines over learner.num_ranks engines share a "
          "device)", k)
    check(k == 1 or cl.generator_tp == 1, "cluster.engines_per_gpu",
          f"1 with cluster.generator_tp={cl.generator_tp} (engines sharing a GPU are not tensor-parallel)", k)
    engines = cl.generator_engines
    if engines == "auto":
        return
    check(engines >= 1, "cluster.generator_engines", "'auto' or an integer >= 1", engines)
    check(engines % k == 0, "cluster.generator_engines",
          f"a multiple of cluster.engines_per_gpu={k} (every generating GPU holds that many)", engines)
    if cl.placement == "colocated":
        check(ranks % engines == 0 or engines % ranks == 0, "cluster.generator_engines",
              f"a divisor or a multiple of learner.num_ranks={ranks} with placement=colocated (an engine "
              f"beside every num_ranks/engines-th learner rank, or engines/num_ranks on every rank's "
              f"device)", engines)
    if c.algorithm == "grpo":
        check(engines <= c.grpo.prompts_per_step, "cluster.generator_engines",
              f"at most grpo.prompts_per_step={c.grpo.prompts_per_step} (a GRPO group never spans "
              f"engines, so more engines than groups would idle)", engines)


def _grpo_can_learn(c: RunConfig) -> None:
    """The module docstring's settings under which GRPO has nothing to learn from."""
    g, gen = c.grpo, c.generation
    same = "every sample of a group the same, so every advantage is 0 and GRPO learns nothing"
    check(gen.temperature > 0, "generation.temperature",
          f"> 0 for GRPO: greedy decoding makes {same} (e.g. 1.0; eval.temperature sets evaluation's)",
          gen.temperature)
    check(gen.top_k != 1, "generation.top_k",
          f"not 1 for GRPO: top-1 sampling makes {same} (-1 turns top-k off)", gen.top_k)
    weights = [fn.weight for fn in c.reward.functions]
    check(any(w != 0 for w in weights), "reward.functions",
          "at least one weight != 0 (every reward, so every advantage, would be 0)",
          [f"{fn.function or fn.model or fn.judge} (weight {fn.weight:g})" for fn in c.reward.functions])
    check(g.updates_per_step == 1 or g.clip_low > 0 or g.clip_high > 0, "grpo.clip_high",
          f"> 0 (or grpo.clip_low > 0) with grpo.updates_per_step={g.updates_per_step}: a clip range of "
          f"[1, 1] clips every token once the first update moves the ratio, so the later updates change "
          f"nothing (e.g. clip_low=0.2, clip_high=0.28, or updates_per_step=1)", g.clip_high)
