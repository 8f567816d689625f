"""Memory planner: fit a recipe to a GPU's memory, and spend spare memory on speed.

    shape = model_shape(cfg.model.path)
    plan = make_plan(cfg, shape, gpu_kind("h200-141gb"), pinned=explicit_keys(path, overrides))
    plan.values  # {"learner.max_tokens_per_micro_batch": 16384, "generation.gpu_memory_utilization": 0.15}

Everything here is arithmetic on the model's shape (its `config.json`, or the table `KNOWN_SHAPES`
for hub ids that cannot be read offline) and the recipe's batch shape; nothing is allocated.

Decisions, each a section of docs/design/memory-planner.md (the formulas, and the measured peaks
the fitted terms rest on):
- Memory model: per GPU, the backend's weights, masters, gradients and Adam state by sharding mode,
  a reference copy where `rlhf.rules.holds_reference_model`, activations per token per layer
  (b * (11h + 4f + 2a) fitted for eager layers, 2h less under LoRA, counted for Liger's) and the LM
  head's working set (rlhf.planner.activations), ZeRO-3's buffers, vLLM's weights and KV cache (of
  every engine on the GPU: `rlhf.rules.engines_per_device`), a CUDA context per process and a 10%
  fragmentation margin.
- Phases: colocated, vLLM sleeps (level 2) while the learner trains and the learner's state stays
  while vLLM generates, so a GPU holds the larger phase; split, each GPU holds its own side. A
  reward worker with a device share (`reward_memory`) scores beside the awake engine (colocated,
  its models offloaded while the learner trains) or on a GPU of its own (split).
- Step-time model: the learner only, FLOPs / (MFU * peak) with MFU growing with the micro-batch's
  tokens; the fastest candidate that fits wins, so more memory never plans a slower step.
- Pinned keys: what the recipe or the command line sets is evaluated, never changed; placement,
  engine count and TP stay the recipe's. Micro-batches are token budgets; vLLM's share is computed.
- Why not a library: `accelerate estimate-memory` and `llm-analysis` know nothing of activations
  under our kernels, a colocated engine, sleep phases or our sharding modes.
- GPU memory: what PyTorch reports for a device (an MI250X package is two devices of 64 GiB).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from rlhf.config import RunConfig, config_to_dict
from rlhf.planner.activations import head_bytes, layer_activations
from rlhf.planner.flops import train_flops_per_token
from rlhf.planner.shapes import GIB, GpuKind, ModelShape, gpu_kind, model_shape
from rlhf.rules import (
    device_share,
    engine_count,
    engine_gpus,
    engines_per_device,
    engines_without_cluster,
    holds_reference_model,
    learner_state,
    reward_gpus,
    run_gpus,
)

ZERO3_BUFFERS_GIB = 1.6  # ZeRO-3's gradient bucket and fetch buffers ("Memory model")
VLLM_OVERHEAD_GIB = 2.5  # vLLM's activations, sampler and CUDA graphs while awake
VLLM_ASLEEP_GIB = 1.0  # what a level-2 sleeping engine keeps (graph pool, its allocator)
CONTEXT_GIB = 0.75  # CUDA context + NCCL buffers per process on a GPU
FRAGMENTATION = 0.10  # share of the GPU kept free for the caching allocator
VLLM_DEFAULT_MAX_SEQS = 1024
MFU_MAX, MFU_HALF_TOKENS = 0.30, 2750.0
RECOMPUTE = 4 / 3
LINK_BYTES_S, PCIE_BYTES_S, HOST_ADAM_PARAMS_S = 200e9, 25e9, 1e9


@dataclass(frozen=True)
class Breakdown:
    """Per-GPU memory of one candidate, in GiB (module docstring, "Memory model")."""

    weights: float
    """Parameters in the compute dtype: resident (DeepSpeed) plus transient gathered copies."""
    masters: float
    gradients: float
    optimizer: float
    reference: float
    activations: float
    logits: float
    buffers: float
    """The backend's own buffers (ZeRO-3)."""
    learner_peak: float
    """Everything above: the learner's allocated peak (what `memory/learner_peak_gib` measures)."""
    learner_resident: float
    """What the learner keeps on the GPU while vLLM generates ("Phases")."""
    vllm_weights: float
    vllm_kv: float
    vllm_kv_needed: float
    """KV cache that holds every sequence the GPU's engines decode at once."""
    vllm_asleep: float
    """What the GPU's sleeping engines keep while the learner trains (colocated)."""
    contexts: float
    """CUDA contexts and NCCL buffers of the processes on the GPU."""
    margin: float
    """Kept free for the allocator's fragmentation."""
    need: float
    """Memory the GPU must have for the busiest phase."""
    tokens: int
    """Tokens of the largest micro-batch."""
    reward_scoring: float = 0.0
    """The reward worker while it scores: its models' bf16 weights, one budgeted batch's activations, a
    judge model's engine (`reward_memory`); on GPU 0 colocated, on its own GPU split."""
    reward_resident: float = 0.0
    """What the reward worker keeps on GPU 0 while the learner trains (colocated: a judge's engine only)."""
    engines_here: int = 1
    """vLLM engines on this GPU (`rlhf.rules.engines_per_device`), each with its own weights, overhead,
    context and at least one full-length row."""


@dataclass(frozen=True)
class Candidate:
    values: dict[str, Any]
    """The memory keys of this candidate, dotted."""
    breakdown: Breakdown
    learner_s: float
    """Predicted learner seconds per step ("Step-time model")."""
    fits: bool


@dataclass(frozen=True)
class Plan:
    config: RunConfig
    """The config planned for (before the plan's values)."""
    gpu: GpuKind
    best: Candidate | None
    candidates: list[Candidate]
    values: dict[str, Any]
    """What the plan changes against the config: dotted key -> value."""
    kept: list[str]
    """Pinned memory keys (set in the recipe or the overrides)."""


PLAN_KEYS = ("learner.backend", "learner.num_ranks", "learner.zero_stage", "learner.reshard_after_forward",
             "learner.offload_optimizer", "learner.offload_params", "learner.gradient_checkpointing",
             "learner.micro_batch_size", "learner.max_tokens_per_micro_batch",
             "generation.gpu_memory_utilization")


def row_tokens(cfg: RunConfig) -> int:
    """Longest sequence of a step (the planner's unit): prompt + completion, or DPO's max_length."""
    if cfg.algorithm == "dpo":
        return cfg.dpo.max_length
    return cfg.data.max_prompt_tokens + cfg.generation.max_new_tokens


def step_rows(cfg: RunConfig) -> int:
    """Sequences the learners train on per step: GRPO's samples, or DPO's pairs twice."""
    if cfg.algorithm == "dpo":
        return cfg.dpo.pairs_per_step * 2
    return cfg.grpo.prompts_per_step * cfg.grpo.group_size


def micro_batch_tokens(cfg: RunConfig) -> int:
    """Tokens of the largest micro-batch: the token budget (at least one row), else rows x length."""
    budget, row = cfg.learner.max_tokens_per_micro_batch, row_tokens(cfg)
    rows_per_rank = math.ceil(step_rows(cfg) / cfg.learner.num_ranks)
    return max(budget, row) if budget else min(cfg.learner.micro_batch_size, rows_per_rank) * row


def engines(cfg: RunConfig) -> int:
    """vLLM engines of the run on GPUs, by the cluster's own rule (`rlhf.rules.engine_count`) for a
    cluster of the GPUs the run takes: split `auto` then means one generating GPU (the planner gives
    every other GPU to the learners, `_choices`)."""
    return engine_count(cfg, "cuda", run_gpus(cfg, engines_without_cluster(cfg)))


def breakdown(cfg: RunConfig, shape: ModelShape, gpu: GpuKind) -> Breakdown:
    """Per-GPU memory of `cfg` on `gpu` ("Memory model" and "Phases")."""
    l, n = cfg.learner, cfg.learner.num_ranks
    b = 4 if cfg.model.dtype == "float32" else 2
    p, layer = shape.params(), shape.layer_params()
    lora = shape.lora_params(l.lora_rank) if l.lora_rank else 0
    root = p - shape.num_hidden_layers * layer  # embeddings, head, final norm
    fsdp, stage3 = l.backend == "fsdp2", l.zero_stage == 3
    cast_once = fsdp and l.cast_once_per_step  # every layer stays gathered, gradients unsharded, all step
    whole = cast_once or (fsdp and not l.reshard_after_forward)
    gathered = b * (p if whole else root + 2 * layer) if fsdp or stage3 else 0
    kept = learner_state(l, b, p, lora)  # what the backend keeps, on this GPU:
    module = 0 if kept.module_on_host else kept.module / kept.module_shards
    masters, grads, optimizer = ((0.0, 0.0, 0.0) if kept.optimizer_on_host
                                 else (kept.masters / n, kept.gradients / (1 if cast_once else n), kept.optimizer / n))
    weights = module + gathered
    reference = (4 if fsdp else 2) * p / n if holds_reference_model(cfg) else 0
    tokens = micro_batch_tokens(cfg)
    h = shape.hidden_size
    per_layer = b * layer_activations(l, shape) * tokens
    activations = (b * h * tokens * shape.num_hidden_layers + per_layer if l.gradient_checkpointing
                   else per_layer * shape.num_hidden_layers)
    logits = head_bytes(l, shape, b, tokens)
    buffers = ZERO3_BUFFERS_GIB * GIB if stage3 and not fsdp else 0
    peak = weights + masters + grads + optimizer + reference + activations + logits + buffers
    resident = module + masters + grads + optimizer + reference + buffers
    e, tp = engines(cfg), cfg.cluster.generator_tp
    k = engines_per_device(cfg, e)  # engines on this GPU, each with its own weights, overhead and context
    vllm_weights = k * b * p / tp if e else 0
    max_seqs = cfg.generation.max_num_seqs or VLLM_DEFAULT_MAX_SEQS
    seqs = k * min(math.ceil(step_rows(cfg) / e), max_seqs) if e else 0
    kv_heads_share = max(1, shape.num_key_value_heads // tp) / shape.num_key_value_heads
    kv_needed = seqs * row_tokens(cfg) * shape.kv_bytes_per_token(b) * kv_heads_share
    mem = gpu.memory_gib * GIB
    vllm_budget = cfg.generation.gpu_memory_utilization * mem if e else 0
    vllm_kv = max(0.0, vllm_budget - vllm_weights - k * VLLM_OVERHEAD_GIB * GIB)
    margin = FRAGMENTATION * mem
    colocated = cfg.cluster.placement == "colocated" and e > 0
    asleep = k * VLLM_ASLEEP_GIB * GIB if colocated else 0
    scoring, kept = reward_memory(cfg, mem)
    beside = cfg.cluster.placement == "colocated" and device_share(cfg.reward)  # the reward worker on GPU 0
    if not beside:
        kept = 0.0
    contexts = (1 + k if colocated else 1) * CONTEXT_GIB * GIB + (CONTEXT_GIB * GIB if beside else 0)
    # colocated: the larger of training (vLLM asleep) and generating and scoring (the learner's state
    # resident); otherwise the learner's GPUs (split generator and reward GPUs: `vllm_fits`, `reward_fits`)
    need = max(peak + asleep + kept, resident + vllm_budget + (scoring if beside else 0) if colocated else 0) \
        + contexts + margin
    g = 1 / GIB
    return Breakdown(weights * g, masters * g, grads * g, optimizer * g, reference * g, activations * g,
                     logits * g, buffers * g, peak * g, resident * g, vllm_weights * g, vllm_kv * g, kv_needed * g,
                     asleep * g, contexts * g, margin * g, need * g, tokens, scoring * g, kept * g, k)


RM_ACT_HIDDEN, RM_ACT_MLP = 4, 3  # a reward model's live activations per token of one layer: 4h + 3f
RM_WORKSPACE_GIB = 1 / 32  # cuBLAS's workspace (32 MiB on Hopper), taken by the reward worker's first matmul


def reward_memory(cfg: RunConfig, gpu_bytes: float) -> tuple[float, float]:
    """(bytes while scoring, bytes kept while the learner trains) of the reward worker's device share,
    0 without one: each `{model: ...}` entry's bf16 weights (its LM head replaced by a one-output
    score head) plus the activations of one batch, forward only and without a KV cache, one layer's at
    a time (4h + 3f per token: the residual, the fp32 RMSNorm, three of the MLP's f-wide tensors) and
    the padded attention mask (rows x longest row x longest row), and cuBLAS's workspace; a
    `judge_model` entry's engine takes `judge_memory_utilization` of the GPU throughout (it never sleeps)."""
    if not device_share(cfg.reward):
        return 0.0, 0.0
    row = row_tokens(cfg) + RM_TEMPLATE_TOKENS
    weights = activations = engines = 0.0
    for f in cfg.reward.functions:
        if f.model and cfg.reward.model_device == "gpu":
            shape = model_shape(f.model)
            head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
            weights += 2 * (shape.params() - head + shape.hidden_size)
            tokens = max(cfg.reward.max_tokens_per_batch, row) if cfg.reward.max_tokens_per_batch \
                else f.batch_size * row
            per_token = RM_ACT_HIDDEN * shape.hidden_size + RM_ACT_MLP * shape.intermediate_size + row
            activations = max(activations, 2 * tokens * per_token)
        if f.judge_model:
            engines += f.judge_memory_utilization * gpu_bytes
    workspace = RM_WORKSPACE_GIB * GIB if weights else 0.0
    return weights + activations + workspace + engines, engines


RM_TEMPLATE_TOKENS = 16  # the reward model's chat template around prompt and response (Qwen2's: 13)


def reward_fits(bd: Breakdown, cfg: RunConfig, gpu: GpuKind) -> bool:
    """Split placement: the reward worker's own GPU holds it (its CUDA context and margin included)."""
    if cfg.cluster.placement != "split" or not device_share(cfg.reward):
        return True
    return bd.reward_scoring + CONTEXT_GIB + FRAGMENTATION * gpu.memory_gib <= gpu.memory_gib


def vllm_fits(bd: Breakdown, cfg: RunConfig, shape: ModelShape, gpu: GpuKind) -> bool:
    """vLLM's share holds its weights, its overhead and at least one full-length sequence."""
    if not engines(cfg):
        return True
    b = 4 if cfg.model.dtype == "float32" else 2
    one_row = row_tokens(cfg) * shape.kv_bytes_per_token(b) / cfg.cluster.generator_tp / GIB
    share = cfg.generation.gpu_memory_utilization * gpu.memory_gib
    # split: the GPU is vLLM's, whose own pool needs no fragmentation margin
    split_ok = cfg.cluster.placement == "colocated" or share + CONTEXT_GIB <= gpu.memory_gib
    return split_ok and share >= bd.vllm_weights + bd.engines_here * (VLLM_OVERHEAD_GIB + one_row)


def predicted_learner_peak_gib(cfg: RunConfig, gpu: str = "h100-80gb") -> float:
    """The learner's predicted allocated peak for `cfg` (compare with `memory/learner_peak_gib`)."""
    return breakdown(cfg, model_shape(cfg.model.path), gpu_kind(gpu)).learner_peak


def learner_seconds(cfg: RunConfig, shape: ModelShape, gpu: GpuKind) -> float:
    """Predicted learner seconds per step ("Step-time model")."""
    l, n = cfg.learner, cfg.learner.num_ranks
    row, rows = row_tokens(cfg), math.ceil(step_rows(cfg) / n)
    tokens = micro_batch_tokens(cfg)
    micro = math.ceil(rows * row / tokens)
    mfu = MFU_MAX * tokens / (tokens + MFU_HALF_TOKENS)
    flops = rows * row * train_flops_per_token(shape, row) * (RECOMPUTE if l.gradient_checkpointing else 1)
    seconds = flops / (mfu * gpu.peak_tflops * 1e12)
    b, p = (4 if cfg.model.dtype == "float32" else 2), shape.params()
    if n > 1:  # per micro-batch: gathers forward (and backward when resharded), gradient reduce-scatter
        full_shard = l.reshard_after_forward if l.backend == "fsdp2" else l.zero_stage == 3
        gathers = 2 if full_shard else 1 if l.backend == "fsdp2" else 0
        volume = (gathers * b + 4) * p * (n - 1) / n
        seconds += 0.5 * micro * volume / LINK_BYTES_S
    if l.backend == "deepspeed" and l.offload_optimizer:
        seconds += 6 * p / n / PCIE_BYTES_S + p / n / HOST_ADAM_PARAMS_S
    if l.backend == "deepspeed" and l.zero_stage == 3 and l.offload_params:
        seconds += micro * 2 * b * p / n / PCIE_BYTES_S
    return seconds


def _with(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`cfg` with dotted `values` replaced (no validation: candidates are built valid)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    replaced = {s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    return dataclasses.replace(cfg, **replaced)


def _get(cfg: RunConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _choices(cfg: RunConfig, pinned: set[str], gpus: int) -> list[dict[str, Any]]:
    """Every candidate assignment of the unpinned memory keys ("Pinned keys")."""
    free = {k for k in PLAN_KEYS if k not in pinned}
    if {"learner.micro_batch_size", "learner.max_tokens_per_micro_batch"} & pinned:
        free -= {"learner.micro_batch_size", "learner.max_tokens_per_micro_batch"}
    ranks = [cfg.learner.num_ranks]
    if gpus and "learner.num_ranks" in free:  # split: what one engine (or the pinned engines) leave free
        own = engine_gpus(cfg, engines_without_cluster(cfg))
        ranks = [max(1, gpus - own - reward_gpus(cfg)) if cfg.cluster.placement == "split" else gpus]
    options: dict[str, list[Any]] = {
        "learner.num_ranks": ranks,
        "learner.backend": ["fsdp2", "deepspeed"],
        "learner.zero_stage": [2, 3],
        "learner.reshard_after_forward": [True, False],
        "learner.offload_optimizer": [False, True],
        "learner.offload_params": [False, True],
        "learner.gradient_checkpointing": [False, True],
    }
    keys = [k for k in options if k in free]
    out = []
    for combo in itertools.product(*(options[k] for k in keys)):
        values = {k: _get(cfg, k) for k in PLAN_KEYS if k in options} | dict(zip(keys, combo))
        fsdp = values["learner.backend"] == "fsdp2"
        if fsdp and (values["learner.offload_optimizer"] or values["learner.offload_params"]):
            continue  # the FSDP2 learner has no offload
        if not fsdp and values["learner.offload_params"] and values["learner.zero_stage"] != 3:
            continue
        # a key the backend ignores keeps the recipe's value, so candidates differ in what matters
        ignored = "learner.zero_stage" if fsdp else "learner.reshard_after_forward"
        values[ignored] = _get(cfg, ignored)
        if "learner.micro_batch_size" in free:
            for rows in _row_counts(math.ceil(step_rows(cfg) / values["learner.num_ranks"])):
                out.append(values | {"learner.micro_batch_size": rows,
                                     "learner.max_tokens_per_micro_batch": rows * row_tokens(cfg)})
        else:
            out.append(values)
    unique = {tuple(v.items()): v for v in out}
    return list(unique.values())


def _row_counts(rows_per_rank: int) -> list[int]:
    """Micro-batch sizes tried, in rows: 1, 2, 3, 4, 6, 8, 12, ... (steps of 1.5x and 1.33x), up to
    the rank's whole share of the step."""
    powers = [2**k for k in range(rows_per_rank.bit_length())]
    sizes = {r for p in powers for r in (p, 3 * p // 2) if 0 < r < rows_per_rank}
    return sorted(sizes | {rows_per_rank})


def _utilization(cfg: RunConfig, bd: Breakdown, gpu: GpuKind) -> float:
    """vLLM's share: enough for its weights, overhead and the step's sequences, as far as the
    generation phase leaves room (colocated), else 0.9 (split: the GPU is vLLM's alone); in steps of
    0.05, at least 0.1 (vLLM's start-up profile and CUDA graphs need room even for a small model)."""
    if cfg.cluster.placement == "split":
        return 0.9
    room = (1 - FRAGMENTATION) * gpu.memory_gib - bd.contexts - bd.learner_resident - bd.reward_scoring
    want = bd.vllm_weights + bd.engines_here * VLLM_OVERHEAD_GIB + bd.vllm_kv_needed
    return max(0.1, min(math.ceil(20 * want / gpu.memory_gib), math.floor(20 * room / gpu.memory_gib)) / 20)


def evaluate(cfg: RunConfig, shape: ModelShape, gpu: GpuKind, values: dict[str, Any],
             set_utilization: bool) -> Candidate:
    """One candidate: its breakdown, predicted learner time, and whether it fits."""
    c = _with(cfg, values)
    if set_utilization and engines(c):
        u = _utilization(c, breakdown(c, shape, gpu), gpu)
        values = values | {"generation.gpu_memory_utilization": u}
        c = _with(c, {"generation.gpu_memory_utilization": u})
    bd = breakdown(c, shape, gpu)
    fits = bd.need <= gpu.memory_gib and vllm_fits(bd, c, shape, gpu) and reward_fits(bd, c, gpu)
    return Candidate(values, bd, learner_seconds(c, shape, gpu), fits)


def make_plan(cfg: RunConfig, shape: ModelShape, gpu: GpuKind, pinned: set[str] = frozenset(),
              gpus: int = 0) -> Plan:
    """The fastest candidate that fits `gpu` (None if none does), keeping `pinned` keys as set;
    `gpus` > 0 sets the learner ranks (when not pinned) for a run of that many GPUs."""
    free_util = "generation.gpu_memory_utilization" not in pinned
    candidates = [evaluate(cfg, shape, gpu, v, free_util) for v in _choices(cfg, pinned, gpus)]
    fitting = [c for c in candidates if c.fits]

    def changes(c: Candidate) -> int:
        return sum(v != _get(cfg, k) for k, v in c.values.items())

    best = min(fitting, key=lambda c: (round(c.learner_s, 3), changes(c), c.breakdown.need), default=None)
    values = {k: v for k, v in best.values.items() if v != _get(cfg, k)} if best else {}
    kept = [k for k in PLAN_KEYS if k in pinned]
    return Plan(cfg, gpu, best, candidates, values, kept)


def nearest_need_gib(plan: Plan) -> float:
    """The memory the nearest candidate of `plan` needs on its GPU: the `need` of the first row
    that `describe` lists among the misses, so a refusal and the table quote the same figure."""
    return min(c.breakdown.need for c in plan.candidates)


def no_fit_message(cfg: RunConfig, shape: ModelShape, gpu: GpuKind, plan: Plan, pinned: set[str],
                   gpus: int = 0) -> str:
    """One line: the memory the recipe's nearest candidate needs on `gpu` (the table's first miss)
    and the setting to change."""
    where = f"{gpu.memory_gib:g} GiB ({gpu.name})"
    needs = f"needs {nearest_need_gib(plan):.1f} GiB per GPU as set" if plan.candidates else "fits no GPU as set"
    micro = {"learner.micro_batch_size", "learner.max_tokens_per_micro_batch"}
    fixes = []  # one pinned key (the micro-batch pair counts as one) set free at a time
    for key in sorted(set(PLAN_KEYS) & pinned):
        freed = make_plan(cfg, shape, gpu, pinned - (micro if key in micro else {key}), gpus)
        if freed.best is not None:
            fixes.append((freed.best.learner_s, _settings(freed.values, pinned)))
    unpinned = make_plan(cfg, shape, gpu, set(), gpus)
    if fixes or unpinned.best is not None:
        fix = min(fixes)[1] if fixes else _settings(unpinned.values, pinned)
        return (f"the recipe {needs}, more than {where}; change the keys it sets: {fix} "
                f"(or leave them out and let memory.plan choose)")
    if engines(cfg) and cfg.cluster.placement == "split" and not any(
            vllm_fits(c.breakdown, _with(cfg, c.values), shape, gpu) for c in unpinned.candidates):
        billions = shape.params() / 1e9
        return f"vLLM cannot hold {billions:.1f}B parameters in {where}; raise cluster.generator_tp"
    return (f"the recipe needs at least {nearest_need_gib(unpinned):.1f} GiB per GPU with every memory key "
            f"free, more than {where}; raise learner.num_ranks (more GPUs shard the model), use LoRA "
            f"(learner.lora_rank) or shorten the rows (data.max_prompt_tokens, generation.max_new_tokens)")


def _settings(values: dict[str, Any], pinned: set[str]) -> str:
    """`k=v` for the pinned keys a plan changes, then `with k=v` for the rest it needs."""
    changed = " ".join(_key_value(k, v) for k, v in values.items() if k in pinned)
    rest = " ".join(_key_value(k, v) for k, v in values.items() if k not in pinned)
    return f"{changed} with {rest}" if rest else changed


_LABELS = {
    "weights": "weights (compute dtype: resident + gathered)", "masters": "fp32 master weights",
    "gradients": "gradients (fp32)", "optimizer": "optimizer state (Adam, fp32)",
    "reference": "reference model",
    "activations": "activations", "logits": "logits", "buffers": "backend buffers (ZeRO-3)",
    "learner_peak": "= learner peak",
    "learner_resident": "learner state resident while vLLM generates", "vllm_weights": "vLLM weights",
    "vllm_kv": "vLLM KV cache (its share)", "vllm_kv_needed": "vLLM KV cache the step's sequences need",
    "vllm_asleep": "vLLM asleep (kept while the learner trains)",
    "reward_scoring": "reward worker scoring (weights + one batch)",
    "reward_resident": "reward worker while the learner trains", "contexts": "CUDA contexts",
    "margin": f"fragmentation margin ({FRAGMENTATION:.0%})", "need": "= needed by the busiest phase",
}


def format_breakdown(bd: Breakdown) -> str:
    """The breakdown, one `label GiB` line each, plus the activations per token."""
    lines = [f"  {label:<46} {getattr(bd, name):8.2f} GiB" for name, label in _LABELS.items()]
    per_token = bd.activations * GIB / 2**20 / max(1, bd.tokens)
    lines.insert(6, f"  {'  per token, micro-batch of ' + str(bd.tokens):<46} {per_token:8.2f} MiB")
    return "\n".join(lines)


def describe(plan: Plan, top: int = 8) -> str:
    """A table of the fastest fitting candidates and the closest misses, then the chosen values."""
    lines = [f"gpu: {plan.gpu.name}, {plan.gpu.memory_gib:g} GiB, {plan.gpu.peak_tflops:g} TFLOP/s bf16"]
    ranked = sorted(plan.candidates, key=lambda c: (not c.fits, c.learner_s if c.fits else c.breakdown.need))
    header = f"{'fits':4} {'learner s':>9} {'need':>6} {'peak':>6}  settings"
    lines += ["candidates (fastest fitting first, then the nearest misses):", header]
    for c in ranked[:top]:
        short = " ".join(f"{k.split('.')[1]}={v}" for k, v in c.values.items() if v != _get(plan.config, k))
        lines.append(f"{'yes' if c.fits else 'no':4} {c.learner_s:9.2f} {c.breakdown.need:6.1f} "
                     f"{c.breakdown.learner_peak:6.1f}  {short or '(as the recipe)'}")
    if plan.best is not None:
        lines.append("chosen, per GPU:\n" + format_breakdown(plan.best.breakdown))
    if plan.kept:
        lines.append("kept as set: " + ", ".join(plan.kept))
    return "\n".join(lines)


def _key_value(key: str, value: Any) -> str:
    """`key=value` as an override is written (booleans as true/false)."""
    return f"{key}={json.dumps(value) if isinstance(value, bool) else value}"


def plan_lines(plan: Plan) -> list[str]:
    """The chosen plan as `key=value` lines (values that differ from the config)."""
    return [_key_value(k, v) for k, v in plan.values.items()]


def applied(cfg: RunConfig, plan: Plan) -> RunConfig:
    """`cfg` with the plan's values, validated like any override."""
    from rlhf.config import config_from_dict

    return config_from_dict(config_to_dict(cfg), plan_lines(plan))
