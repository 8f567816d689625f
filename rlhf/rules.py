"""Rules derived from a config that more than one part of the system must agree on, each written
once: the cluster that builds a run, the memory planner that sizes it and the loops that drive it
all call these. Pure functions of a `RunConfig` (no Ray, vLLM or device imports).

- `engine_count`: how many vLLM engines a run has (`cluster.generator_engines: auto` resolved).
- `scores_reference`: whether the loop asks for reference log-probs every step.
- `holds_reference_model`: whether the learners keep a frozen reference copy of the model for that.
"""

from __future__ import annotations

from rlhf.config import ConfigError, RunConfig


def engine_count(cfg: RunConfig, device_kind: str, cluster_gpus: float) -> int:
    """The run's vLLM engines: `cluster.generator_engines`, or what `auto` means here, checked
    against the GPUs the run may use (`cluster_gpus`; ignored on CPU). 0 for DPO, which generates
    nothing. Raises ConfigError (one line) when the run cannot fit.

    `auto`: on CPU 1 (more engines would share the same cores); colocated, one per learner GPU;
    split, the GPUs the learners leave free over `cluster.generator_tp`. GRPO never gets more
    engines than a step has prompt groups, and colocated the count divides the learner ranks (each
    engine sits beside the same number of ranks)."""
    if cfg.algorithm == "dpo":
        return 0
    cl, ranks, tp = cfg.cluster, cfg.learner.num_ranks, cfg.cluster.generator_tp
    engines = cl.generator_engines
    if engines == "auto":
        if device_kind == "cpu":
            engines = 1
        elif cl.placement == "colocated":
            engines = ranks
        else:
            free = int(cluster_gpus) - ranks
            if free < tp or free % tp:
                raise ConfigError(
                    f"cluster.generator_engines=auto: the Ray cluster's {cluster_gpus:g} GPUs less learner.num_ranks="
                    f"{ranks} leave {free}, not a positive multiple of cluster.generator_tp={tp}; set "
                    f"cluster.generator_engines or learner.num_ranks")
            engines = free // tp
        engines = min(engines, cfg.grpo.prompts_per_step)
        while cl.placement == "colocated" and ranks % engines:
            engines -= 1
    if device_kind != "cpu":
        need = run_gpus(cfg, engines)
        if need > cluster_gpus:
            raise ConfigError(
                f"the run needs {need} GPUs (learner.num_ranks={ranks}"
                + (f" + {engines} engines x cluster.generator_tp={tp}" if cl.placement == "split" else "")
                + f") but the Ray cluster has {cluster_gpus:g}")
    return engines


def run_gpus(cfg: RunConfig, engines: int) -> int:
    """GPUs a run with `engines` engines takes: the learners' (colocated engines share them), plus
    the engines' own in split placement."""
    split = cfg.cluster.placement == "split"
    return cfg.learner.num_ranks + (engines * cfg.cluster.generator_tp if split else 0)


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
    adapters off (actors.learner_base choice 9)."""
    return scores_reference(cfg) and cfg.learner.lora_rank == 0
