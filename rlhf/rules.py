"""Rules derived from a config that more than one part of the system must agree on, each written
once: the cluster that builds a run, the memory planner that sizes it and the loops that drive it
all call these. Pure functions of a `RunConfig` (no Ray, vLLM or device imports).

- `engine_count`: how many vLLM engines a run has (`cluster.generator_engines: auto` resolved).
- `engines_per_device`: how many of them share one device, `engine_generation` the memory share of
  each, and `engine_gpus` the GPUs of their own they take (split).
- `reward_workers`: how many processes score rewards (`reward.num_workers: auto` resolved).
- `checkpoint_due`: whether the loop saves a checkpoint after a step (`save_every`).
- `scores_reference`: whether the loop asks for reference log-probs every step.
- `holds_reference_model`: whether the learners keep a frozen reference copy of the model for that.
- `learner_state`: what a learner backend keeps of the model between steps, and where; the memory
  planner sizes a GPU from it and the checkpoint estimate sizes the disk from it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from rlhf.config import GenerationConfig, LearnerConfig, RewardConfig, RunConfig
from rlhf.errors import ConfigError


def engine_count(cfg: RunConfig, device_kind: str, cluster_gpus: float) -> int:
    """The run's vLLM engines: `cluster.generator_engines`, or what `auto` means here, checked
    against the Ray cluster's GPUs (`cluster_gpus`; ignored on CPU). 0 for DPO, which generates
    nothing. Raises ConfigError (one line) when the run cannot fit.

    `auto`: on CPU 1 (more engines would share the same cores); colocated, one per learner GPU;
    split, `engines_per_gpu` on each GPU the learners and a reward worker's own GPU (`reward_gpus`)
    leave free, over `cluster.generator_tp`. GRPO never gets more
    engines than a step has prompt groups, and colocated the count divides the learner ranks (each
    engine sits beside the same number of ranks)."""
    if cfg.algorithm == "dpo":
        return 0
    cl, ranks, tp = cfg.cluster, cfg.learner.num_ranks, cfg.cluster.generator_tp
    scorer = reward_gpus(cfg)  # a reward worker's GPU of its own (split), 0 or 1
    engines = cl.generator_engines
    if engines == "auto":
        if device_kind == "cpu":
            engines = 1
        elif cl.placement == "colocated":
            engines = ranks
        else:
            free = int(cluster_gpus) - ranks - scorer
            if free < tp or free % tp:
                less = f"learner.num_ranks={ranks}" + (" and the reward worker's GPU" if scorer else "")
                raise ConfigError(
                    f"cluster.generator_engines=auto: the Ray cluster's {cluster_gpus:g} GPUs less {less} leave "
                    f"{free}, not a positive multiple of cluster.generator_tp={tp}; set cluster.generator_engines "
                    f"or learner.num_ranks")
            engines = free // tp * cl.engines_per_gpu
        engines = min(engines, cfg.grpo.prompts_per_step)
        while cl.placement == "colocated" and ranks % engines:
            engines -= 1
    if device_kind != "cpu":
        need = run_gpus(cfg, engines)
        if need > cluster_gpus:
            raise ConfigError(
                f"the run needs {need} GPUs (learner.num_ranks={ranks}"
                + (f" + {engine_gpus(cfg, engines)} for {engines} engine(s) (cluster.generator_tp={tp}, "
                   f"cluster.engines_per_gpu={cl.engines_per_gpu})" if cl.placement == "split" else "")
                + (f" + {scorer} for the reward worker" if scorer else "")
                + f") but the Ray cluster has {cluster_gpus:g}")
    return engines


def engines_sleep(placement: str, device_kind: str) -> bool:
    """Whether the engines sleep while the learners train: colocated on a GPU, where vLLM's sleep
    mode hands their memory to the learners. Split or CPU engines never sleep, and are not even asked
    to: an engine runs one call at a time, so a no-op `sleep` would wait behind a generation running
    ahead (asynchronous GRPO) and hold the learners until it ends."""
    return placement == "colocated" and device_kind != "cpu"


def engines_per_device(cfg: RunConfig, engines: int) -> int:
    """Engines that share one device. Colocated, those beside one learner rank: `cluster.generator_engines`
    over `learner.num_ranks` when it is a multiple of it (several engines per GPU, so that several host
    threads feed a decode that one thread cannot keep the GPU busy with), else 1; split,
    `cluster.engines_per_gpu`. Together they hold `generation.gpu_memory_utilization` of the device,
    each an equal part of it."""
    if cfg.cluster.placement == "split":
        return cfg.cluster.engines_per_gpu
    ranks = cfg.learner.num_ranks
    return engines // ranks if engines > ranks else 1


def engines_without_cluster(cfg: RunConfig) -> int:
    """The engines a run is sized with before a cluster is there to count (the planner, a benchmark
    placing its sides): `cluster.generator_engines`, or for `auto` one GPU's `engines_per_gpu`
    (split: one generating GPU, every other one the learners'; colocated `engine_count` then sizes
    `auto` by the learners)."""
    pinned = cfg.cluster.generator_engines
    return cfg.cluster.engines_per_gpu if pinned == "auto" else pinned


def engine_gpus(cfg: RunConfig, engines: int) -> int:
    """GPUs of their own that `engines` engines take: split, `generator_tp` for every
    `engines_per_device` of them; colocated none (they share the learners')."""
    if cfg.cluster.placement != "split":
        return 0
    return -(-engines // engines_per_device(cfg, engines)) * cfg.cluster.generator_tp


def engine_generation(generation: GenerationConfig, per_device: int) -> GenerationConfig:
    """The generation settings of one of `per_device` engines on a device (`engines_per_device`): an
    equal part of `generation.gpu_memory_utilization` each."""
    if per_device <= 1:
        return generation
    return replace(generation, gpu_memory_utilization=generation.gpu_memory_utilization / per_device)


def run_gpus(cfg: RunConfig, engines: int) -> int:
    """GPUs a run with `engines` engines takes: the learners' (colocated engines share them), plus
    the engines' own and the reward worker's (`reward_gpus`) in split placement."""
    return cfg.learner.num_ranks + engine_gpus(cfg, engines) + reward_gpus(cfg)


def reward_workers(num_workers: int | Literal["auto"], cores: int) -> int:
    """Processes in the reward pool: `reward.num_workers`, or for `auto` a quarter of `cores` (those
    the scoring process may run on), 2 to 8. The pool sends one sample per round trip to a runner, so
    on a GPU node's many cores more runners hide that latency; a 2-core machine keeps 2."""
    if num_workers != "auto":
        return num_workers
    return min(8, max(2, cores // 4))


def checkpoint_due(steps_done: int, total_steps: int, save_every: int) -> bool:
    """Save after this step? Every `save_every` steps and after the last one; `save_every=-1`: never."""
    if save_every < 0:
        return False
    return steps_done == total_steps or (save_every > 0 and steps_done % save_every == 0)


def device_share(reward: RewardConfig) -> bool:
    """Whether the reward worker takes a device share (actors/cluster.py places it): reward models
    with `reward.model_device: gpu`, or a judge with a model of its own (its engine needs one)."""
    return (reward.model_device == "gpu" and any(f.model for f in reward.functions)) or any(
        f.judge_model for f in reward.functions)


def reward_gpus(cfg: RunConfig) -> int:
    """GPUs the reward worker takes for itself: one in split placement with a device share (colocated,
    its share is a slice of a learner's GPU)."""
    return int(device_share(cfg.reward) and cfg.cluster.placement == "split")


def scores_reference(cfg: RunConfig) -> bool:
    """Whether the loop asks for reference log-probs at every step: GRPO with a KL term; DPO unless
    they are precomputed once before training (`dpo.precompute_ref`) or it is SimPO, which has no
    reference."""
    if cfg.algorithm == "grpo":
        return cfg.grpo.kl_coef > 0
    return cfg.dpo.loss_type != "simpo" and not cfg.dpo.precompute_ref


def holds_reference_model(cfg: RunConfig) -> bool:
    """Whether the learners keep a frozen copy of the model to score the reference: whenever the
    loop asks for reference log-probs, except with LoRA, where the reference is the policy with its
    adapters off ("LoRA" in actors/learner_base.py)."""
    return scores_reference(cfg) and cfg.learner.lora_rank == 0


@dataclass(frozen=True)
class LearnerState:
    """What the learners keep of the model between steps, in bytes over all ranks (`learner_state`)."""

    module: float
    """The weights in the compute dtype: DeepSpeed's module. FSDP2 computes from its masters: 0."""
    masters: float
    """fp32 weights the optimizer updates, where they are a copy of their own: FSDP2 every parameter
    (LoRA's frozen base too); DeepSpeed the trained ones (ZeRO-2 copies whatever the compute dtype;
    ZeRO-3 updates an fp32 module in place, with no copy)."""
    gradients: float
    """fp32 gradients of the trained weights."""
    optimizer: float
    """AdamW's two fp32 moments of the trained weights."""
    module_shards: int
    """Ranks the module is split over: ZeRO-3 all of them; ZeRO-2 keeps it whole on every rank."""
    module_on_host: bool
    """ZeRO-3 `offload_params`: the module lives in host memory."""
    optimizer_on_host: bool
    """DeepSpeed `offload_optimizer`: masters, gradients and moments live in host memory."""
    saved: float
    """A checkpoint's train state (the HF export aside): the fp32 weights and the moments, plus
    DeepSpeed's module under ZeRO-2, and with LoRA the frozen base (either stage)."""


def learner_state(learner: LearnerConfig, dtype_bytes: int, params: int, lora_params: int = 0) -> LearnerState:
    """What `learner.backend` keeps for a model of `params` parameters in a `dtype_bytes` compute
    dtype (`lora_params`: the adapters' parameters with `learner.lora_rank`, else 0)."""
    trained = lora_params or params
    moments = 8.0 * trained
    if learner.backend == "fsdp2":
        masters = 4.0 * (params + lora_params)
        return LearnerState(module=0.0, masters=masters, gradients=4.0 * trained, optimizer=moments,
                            module_shards=learner.num_ranks, module_on_host=False, optimizer_on_host=False,
                            saved=masters + moments)
    stage3 = learner.zero_stage == 3
    in_place = stage3 and dtype_bytes == 4 and not learner.offload_optimizer  # deepspeed/runtime/zero/stage3.py
    module = float(dtype_bytes * params)
    return LearnerState(module=module, masters=0.0 if in_place else 4.0 * trained, gradients=4.0 * trained,
                        optimizer=moments, module_shards=learner.num_ranks if stage3 else 1,
                        module_on_host=stage3 and learner.offload_params, optimizer_on_host=learner.offload_optimizer,
                        saved=4.0 * trained + moments + (module if not stage3 or lora_params else 0.0))
