"""Benchmark workloads: one spec per workload, the single source every side reads.

A `Workload` names one of our recipes plus the values the comparison fixes (model, task, prompts
per step, group size, completion length, learning rate, steps, seed). `our_overrides` turns it
into the `key=value` overrides our scripts take, and every side (our training script, the TRL
scripts, the standalone generator) resolves the *same* `RunConfig` from them with
`rlhf.config.load_config(recipe, overrides)`. So the two systems also agree on everything the spec
does not spell out: prompt template and system prompt, reward functions and weights, clip range,
Adam betas, gradient clipping, temperature, data seed.

`trl_grpo_kwargs(cfg, ...)` and `trl_dpo_kwargs(cfg, ...)` map that config onto TRL 1.16's
`GRPOConfig` / `DPOConfig` and raise `ValueError` for anything TRL cannot express the same way,
rather than benchmark two different algorithms.

Choices for the TRL side (each keeps the work identical to ours; see benchmarks/README.md):
1. fp32 master weights with bf16 autocast (`model_init_kwargs.dtype=float32`, `bf16=True`), as our
   learners (fp32 parameters, bf16 compute). Loading the bf16 checkpoint as is would make TRL train
   bf16 parameters, where AdamW steps of lr 2e-5 round away.
2. No gradient checkpointing (TRL's default is on; ours is off unless `learner.gradient_checkpointing`).
3. Constant learning rate (TRL's default schedule decays linearly to 0 over `max_steps`).
4. No vLLM importance-sampling correction: it costs TRL an extra forward pass per step that our
   on-policy loop does not make (ours only measures the mismatch from the sampler's log-probs).
5. Data in our order: the dataset is the exact sequence of prompts (pairs) our `PromptStream`
   yields, with TRL's shuffling off, so step k of both systems sees the same prompts (pairs).
6. Everything else is TRL's default, e.g. its fused AdamW and, without vLLM, `model.generate` on
   the training model (which runs outside autocast, i.e. in fp32 on the fp32 master weights).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from benchmarks.summary import TUNED
from rlhf.config import RunConfig, config_keys

REPO_MODELS = {"random:qwen2.5-0.5b", "random:qwen2.5-1.5b", "random:qwen2.5-7b"}
"""Models the runner builds itself (benchmarks/models.py) before the sides start."""

TRL_LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
"""Our `grpo.loss_agg` -> TRL's `loss_type` with the same normalisation (one optimizer step per
generation batch, so DAPO's "active tokens of the global accumulated batch" is our token-mean)."""

TRL_DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")


@dataclass(frozen=True)
class Workload:
    """What both systems run. GRPO fields and DPO fields share names where the meaning matches."""

    name: str
    algorithm: Literal["grpo", "dpo"]
    recipe: str
    """Our YAML recipe; the base of every value the fields below do not set."""
    model: str
    """`model.path`: a built-in name, an HF folder, or one of REPO_MODELS."""
    task: str
    """GRPO: `data.task`. DPO: `dpo.dataset`."""
    prompts_per_step: int
    """GRPO: prompts per step. DPO: preference pairs per step."""
    steps: int
    lr: float
    group_size: int = 8
    """GRPO: completions per prompt."""
    max_new_tokens: int = 32
    """GRPO: completion length cap."""
    max_length: int = 512
    """DPO: tokens of prompt + response per sequence."""
    micro_batch_size: int = 64
    """Sequences per forward/backward, both systems (a DPO pair is two sequences)."""
    seed: int = 0
    ignore_eos: bool = False
    """Fixed-length completions (GPU speed runs on random weights)."""
    extra: tuple[str, ...] = ()
    """More `key=value` overrides of our recipe (reward spec, data sizes...)."""
    gpu_extra: tuple[str, ...] = ()
    """Overrides of our recipe on a GPU only (`LEARNER_KERNELS`: GPU kernels), left out by `tiny()`."""
    trl_sides: tuple[str, ...] = ("trl",)
    """TRL configurations to run: `trl` (GRPO: transformers generation), `trl-vllm` (vLLM colocate)."""
    standalone_generation: bool = False
    """Also measure our VLLMGenerator alone on step 0's batch (in-loop generation efficiency)."""
    device: Literal["cpu", "cuda"] = "cpu"
    description: str = ""
    planned_recipe: str = ""
    """Our recipe for the tuned row (`memory.plan: auto`, no memory key set); empty: `recipe`."""
    our_modes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """More sides of ours: (side name, overrides on top of ours'), e.g. the rollout modes of one workload."""

    def tiny(self) -> Workload:
        """The same workload on the tiny random Qwen2 at a few prompts and tokens: minutes on a CPU,
        to check that everything runs (numbers mean nothing)."""
        return replace(self, name=f"{self.name}-tiny", model="tiny-qwen2", prompts_per_step=4, group_size=4,
                       max_new_tokens=16, max_length=128, steps=3, micro_batch_size=16, device="cpu",
                       extra=(*self.extra, "generation.enforce_eager=true"), gpu_extra=(),
                       description=f"tiny random Qwen2 on CPU, the code path of {self.name}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


LEARNER_KERNELS = ("learner.liger=true", "learner.cast_once_per_step=true", "learner.pack_sequences=true",
                   "learner.attention=varlen", "learner.max_tokens_per_micro_batch=16384",
                   "learner.head_kernels=fused", "learner.head_keep_logits=true")
"""The learner kernel keys of our GPU rows: the set measured fastest for the 1.5B shape (the learner
kernel tables in benchmarks/README.md). Each is off by default in rlhf/config.py; the tuned row
leaves the token budget to the planner (`tuned_overrides`)."""

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(
        name="grpo-cpu", algorithm="grpo", recipe="configs/grpo_smollm2_cpu.yaml",
        model="smollm2-135m-instruct", task="arithmetic_1digit", prompts_per_step=8, group_size=8,
        max_new_tokens=32, steps=5, lr=2e-5, micro_batch_size=64,
        trl_sides=("trl", "trl-vllm"),
        description="SmolLM2-135M-Instruct, single-digit sums, 8 prompts x 8 samples, <= 32 tokens, CPU",
    ),
    Workload(
        name="dpo-cpu", algorithm="dpo", recipe="configs/dpo_smollm2_cpu.yaml",
        model="smollm2-135m-instruct", task="arithmetic_pairs", prompts_per_step=8, steps=5, lr=5e-6,
        max_length=128, micro_batch_size=16,
        extra=("dpo.beta=0.1", "dpo.loss_type=sigmoid", "dpo.precompute_ref=false", "dpo.num_train=512",
               "dpo.num_eval=0"),
        description="SmolLM2-135M-Instruct, the shipped arithmetic preference pairs, 8 pairs per step, CPU",
    ),
    Workload(
        name="grpo-gpu", algorithm="grpo", recipe="configs/grpo_gsm8k_qwen2.5-1.5b_1gpu.yaml",
        model="random:qwen2.5-1.5b", task="arithmetic", prompts_per_step=64, group_size=8,
        max_new_tokens=512, steps=5, lr=1e-6, micro_batch_size=16, ignore_eos=True,
        extra=("data.num_train=1024", "data.num_eval=16",
               "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"),
        gpu_extra=(*LEARNER_KERNELS, "cluster.generator_engines=2"),  # two engines: the host-bound decode
        trl_sides=("trl-vllm",), standalone_generation=True, device="cuda",
        planned_recipe="configs/grpo_gsm8k_qwen2.5-1.5b_1gpu_planned.yaml",
        description="Qwen2.5-1.5B-shaped random weights, 64 prompts x 8 samples, 512 tokens (ignore_eos), "
                    "colocated on 1 GPU; dense reward so every step has non-zero advantages",
    ),
    Workload(
        name="grpo-gpu-long", algorithm="grpo", recipe="configs/grpo_gsm8k_qwen2.5-1.5b_1gpu.yaml",
        model="random:qwen2.5-1.5b", task="arithmetic", prompts_per_step=64, group_size=8,
        max_new_tokens=16384, steps=5, lr=1e-6, micro_batch_size=16, ignore_eos=True,
        extra=("data.num_train=1024", "data.num_eval=16", "generation.forced_lengths=long_tail",
               "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"),
        gpu_extra=(*LEARNER_KERNELS, "cluster.generator_engines=2"),
        our_modes=(("ours-stream", ("grpo.rollouts=stream",)),
                   ("ours-partial", ("grpo.rollouts=partial", "grpo.max_staleness=2", "grpo.overprovision=1.5"))),
        trl_sides=("trl-vllm",), device="cuda",
        description="Qwen2.5-1.5B-shaped random weights, 64 prompts x 8 samples of long-tailed lengths (median "
                    "1.5k, 1% above 12k, cap 16k: generation.forced_lengths), colocated on 1 GPU; ours in batch, "
                    "stream and partial rollouts",
    ),
    Workload(
        name="grpo-gpu-scale", algorithm="grpo", recipe="configs/grpo_gsm8k_qwen2.5-1.5b_1gpu.yaml",
        model="random:qwen2.5-1.5b", task="arithmetic", prompts_per_step=64, group_size=8,
        max_new_tokens=256, steps=5, lr=1e-6, micro_batch_size=16, ignore_eos=True,
        extra=("data.num_train=1024", "data.num_eval=16",
               "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"),
        gpu_extra=LEARNER_KERNELS,  # engines per GPU: scale.py's --engines-per-gpu
        trl_sides=(), device="cuda",
        description="Qwen2.5-1.5B-shaped random weights, 64 prompts x 8 samples, 256 tokens (ignore_eos), "
                    "ours alone on 1, 2, 4 (and 8) GPUs (benchmarks/scale.py: one run per cluster layout)",
    ),
)}


def our_overrides(w: Workload, *, output_dir: str, model_path: str | None = None) -> list[str]:
    """`key=value` overrides of `w.recipe` that make our run the workload.

    `model_path` replaces `w.model` (the runner's folder for REPO_MODELS). `generation.ignore_eos`
    is only passed when our config has that key (see `ours_supports_ignore_eos`); `w.gpu_extra` on
    a GPU workload only."""
    model = model_path or w.model
    common = [f"model.path={model}", f"seed={w.seed}", f"learner.lr={w.lr}",
              f"learner.micro_batch_size={w.micro_batch_size}", f"output_dir={output_dir}",
              "save_every=-1", "eval_every=0", "resume=false"]
    if w.algorithm == "grpo":
        out = [*common, f"data.task={w.task}", f"data.seed={w.seed}", f"grpo.prompts_per_step={w.prompts_per_step}",
               f"grpo.group_size={w.group_size}", f"grpo.steps={w.steps}",
               f"generation.max_new_tokens={w.max_new_tokens}"]
        if w.ignore_eos and ours_supports_ignore_eos():
            out.append("generation.ignore_eos=true")
    else:
        out = [*common, f"dpo.dataset={w.task}", f"dpo.pairs_per_step={w.prompts_per_step}",
               f"dpo.max_steps={w.steps}", f"dpo.max_length={w.max_length}"]
    return [*out, *(w.gpu_extra if w.device == "cuda" else ()), *w.extra]


def ours_supports_ignore_eos() -> bool:
    """Whether our config has a `generation.ignore_eos` key (rlhf/config.py)."""
    return "generation.ignore_eos" in config_keys()


# ---------------------------------------------------------------------------------------------
# The tuned row: ours under the memory planner, TRL at the largest per-device batch that fits

TRL_START_BATCH: tuple[tuple[float, int], ...] = ((70.0, 32),)
"""(GPU memory GiB at least, first per-device batch tried) for the tuned TRL side: one step above
the batch grpo-gpu's TRL side is known to fit on an 80 GiB H100 (16: the grpo-gpu results in
benchmarks/README.md); 32 on an H200 too, where 64 ran out of memory (2026-11-29). Smaller GPUs
and CPU start at the workload's micro-batch."""


def trl_batch(w: Workload) -> tuple[int, int]:
    """(items per optimizer step, the workload's per-device batch) in TRL's units: completions for
    GRPO, preference pairs for DPO (our DPO micro-batch counts sequences, two per pair)."""
    if w.algorithm == "grpo":
        return w.prompts_per_step * w.group_size, w.micro_batch_size
    return w.prompts_per_step, max(1, w.micro_batch_size // 2)


def trl_batch_candidates(w: Workload, gpu_gib: float | None, fixed: int = 0) -> list[int]:
    """Per-device batches for the tuned TRL side, in the order to try them: the rule is "start at
    TRL_START_BATCH for the GPU's memory, halve on CUDA out-of-memory", over the batches that
    divide the step (so the accumulation keeps the samples per step). `fixed` > 0: that one only."""
    total, micro = trl_batch(w)
    if fixed:
        if total % fixed:
            raise ValueError(f"per-device batch {fixed} does not divide the {total} items of a step")
        return [fixed]
    start = next((b for gib, b in TRL_START_BATCH if gpu_gib and gpu_gib >= gib), micro)
    out, b = [], min(max(start, micro), total)
    while b >= 1:
        if total % b == 0:
            out.append(b)
        b //= 2
    return out


def without_keys(overrides: list[str], keys: set[str] | tuple[str, ...]) -> list[str]:
    """`overrides` less those that set one of `keys`."""
    return [o for o in overrides if o.split("=", 1)[0] not in keys]


def tuned_overrides(overrides: list[str], *, on_gpu: bool) -> list[str]:
    """Ours in the tuned row: the workload's overrides less every key the memory planner sets
    (`rlhf.planner.memory.PLAN_KEYS`: a key set is kept as set), with `memory.plan=auto`. Off GPU
    the plan is for an H100 (`memory.gpu` names a kind, so it applies without a device)."""
    from rlhf.planner.memory import PLAN_KEYS

    return [*without_keys(overrides, PLAN_KEYS), "memory.plan=auto", *([] if on_gpu else ["memory.gpu=h100-80gb"])]


def trl_tuned_overrides(w: Workload, overrides: list[str], batch: int) -> list[str]:
    """The TRL side's overrides at per-device batch `batch` (TRL's units, see `trl_batch`):
    `trl_grpo_kwargs` / `trl_dpo_kwargs` derive the accumulation from the same samples per step."""
    micro = batch if w.algorithm == "grpo" else 2 * batch
    return [*without_keys(overrides, ("learner.micro_batch_size",)), f"learner.micro_batch_size={micro}"]


# ---------------------------------------------------------------------------------------------
# Prompts, in the order our loop takes them


def grpo_step_prompts(cfg: RunConfig, tokenizer: Any) -> list[list[tuple[Any, list[int]]]]:
    """[(PromptRow, prompt token ids)] of every step, exactly as our loop takes them: the
    `rlhf.data.prompts` pipeline of scripts/train_grpo.py, then `prompts_per_step` per step."""
    from rlhf.data.prompts import load_prompts, tokenize_prompts
    from rlhf.data.stream import PromptStream

    rows, ids, _ = tokenize_prompts(load_prompts(cfg.data, "train"), tokenizer, cfg.data)
    stream = PromptStream(list(zip(rows, ids)), seed=cfg.data.seed)
    return [stream.take(cfg.grpo.prompts_per_step) for _ in range(cfg.grpo.steps)]


def step_prompt_tokens(w: Workload, overrides: list[str]) -> list[int]:
    """Prompt tokens the learner sees per step (every prompt counted group_size times), from the
    same pipeline our loop uses."""
    from transformers import AutoTokenizer

    from rlhf.config import load_config
    from rlhf.data.assets import resolve_model_path

    cfg = load_config(Path(__file__).resolve().parents[1] / w.recipe, overrides)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
    return [sum(len(ids) for _, ids in step) * cfg.grpo.group_size for step in grpo_step_prompts(cfg, tokenizer)]


def trl_prompt(row: Any, cfg: RunConfig) -> str | list[dict[str, str]]:
    """The TRL dataset `prompt` for our PromptRow: chat messages (TRL applies the chat template
    with the generation prompt, as we do) or, without a chat template, the same raw text."""
    messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
    if cfg.data.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.data.system_prompt}, *messages]
    if cfg.data.use_chat_template:
        return messages
    return "\n\n".join(m["content"] for m in messages)


def reward_columns(row: Any) -> str:
    """The keyword arguments our reward pool passes for a row (answer + meta), as JSON."""
    return json.dumps(row.reward_kwargs(), default=str)


# ---------------------------------------------------------------------------------------------
# TRL configs


def _batching(total: int, micro: int, what: str) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) for one optimizer step of `total`
    items in micro-batches of `micro` items, as our learner splits it."""
    micro = min(micro, total)
    if total % micro:
        raise ValueError(f"{what}={total} is not a multiple of the micro-batch ({micro}, from "
                         f"learner.micro_batch_size): TRL needs equal micro-batches")
    return micro, total // micro


def _common_trl_kwargs(cfg: RunConfig, *, output_dir: str, use_cpu: bool) -> dict[str, Any]:
    lrn = cfg.learner
    if lrn.num_ranks != 1:
        raise ValueError("the TRL side runs one process: set learner.num_ranks=1")
    return dict(
        output_dir=output_dir, seed=cfg.seed, data_seed=cfg.seed, use_cpu=use_cpu,
        learning_rate=lrn.lr, adam_beta1=lrn.betas[0], adam_beta2=lrn.betas[1], weight_decay=lrn.weight_decay,
        max_grad_norm=lrn.max_grad_norm, warmup_steps=lrn.warmup_steps,
        lr_scheduler_type="constant_with_warmup" if lrn.warmup_steps else "constant",
        bf16=cfg.model.dtype == "bfloat16", model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=cfg.learner.gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True,
    )


def trl_grpo_kwargs(cfg: RunConfig, *, use_vllm: bool, ignore_eos: bool, output_dir: str, use_cpu: bool
                    ) -> dict[str, Any]:
    """GRPOConfig keyword arguments for the same run as `cfg` (see the module docstring)."""
    g, gen = cfg.grpo, cfg.generation
    if g.kl_coef > 0 and g.kl_estimator != "k3":
        raise ValueError(f"TRL's GRPO KL is k3 only; grpo.kl_estimator={g.kl_estimator!r}")
    per_device, accumulation = _batching(g.prompts_per_step * g.group_size, cfg.learner.micro_batch_size,
                                         "grpo.prompts_per_step * grpo.group_size")
    kwargs = _common_trl_kwargs(cfg, output_dir=output_dir, use_cpu=use_cpu)
    kwargs.update(
        max_steps=g.steps, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        num_generations=g.group_size, max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature, top_p=gen.top_p, top_k=0 if gen.top_k < 0 else gen.top_k,
        beta=g.kl_coef, use_bias_correction_kl=False, epsilon=g.clip_low, epsilon_high=g.clip_high,
        num_iterations=g.updates_per_step, loss_type=TRL_LOSS_TYPES[g.loss_agg],
        scale_rewards="group" if g.scale_by_std else "none", mask_truncated_completions=False,
        shuffle_dataset=False, use_vllm=use_vllm, vllm_importance_sampling_correction=False,
    )
    if use_vllm:
        kwargs.update(vllm_mode="colocate", vllm_gpu_memory_utilization=gen.gpu_memory_utilization,
                      vllm_enable_sleep_mode=not use_cpu and cfg.cluster.placement == "colocated")
        if ignore_eos:
            kwargs["generation_kwargs"] = {"ignore_eos": True}
    elif ignore_eos:  # transformers.generate has no ignore_eos: forbid stopping before the cap instead
        kwargs["generation_kwargs"] = {"min_new_tokens": gen.max_new_tokens}
    return kwargs


def trl_dpo_kwargs(cfg: RunConfig, *, output_dir: str, use_cpu: bool) -> dict[str, Any]:
    """DPOConfig keyword arguments for the same run as `cfg`."""
    d = cfg.dpo
    if d.loss_type not in TRL_DPO_LOSSES:
        raise ValueError(f"dpo.loss_type={d.loss_type!r} has no DPOTrainer counterpart (TRL has {TRL_DPO_LOSSES})")
    if d.label_smoothing and d.loss_type == "sigmoid":
        raise ValueError("TRL 1.16's DPO sigmoid loss ignores label_smoothing: set dpo.label_smoothing=0")
    # Our micro-batches count sequences and keep a pair's two rows together; TRL's count pairs.
    per_device, accumulation = _batching(d.pairs_per_step, max(1, cfg.learner.micro_batch_size // 2),
                                         "dpo.pairs_per_step")
    kwargs = _common_trl_kwargs(cfg, output_dir=output_dir, use_cpu=use_cpu)
    kwargs.update(
        max_steps=d.max_steps if d.max_steps else -1, num_train_epochs=d.epochs,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        beta=d.beta, loss_type=[d.loss_type], label_smoothing=d.label_smoothing, max_length=d.max_length,
        precompute_ref_log_probs=d.precompute_ref, train_sampling_strategy="sequential",
    )
    return kwargs


# ---------------------------------------------------------------------------------------------
# What a side of benchmarks/run.py runs


def side_plan(w: Workload, side: str, output_dir: str, model_path: str | None) -> tuple[Workload, list[str]]:
    """(workload, overrides) a side runs: the workload's, plus a mode's (`our_modes`); ours in the tuned
    row runs the planned recipe under `memory.plan=auto` (`tuned_overrides`)."""
    overrides = our_overrides(w, output_dir=output_dir, model_path=model_path)
    if side in dict(w.our_modes):
        return w, [*overrides, *dict(w.our_modes)[side]]
    if side != f"ours{TUNED}":
        return w, overrides
    return replace(w, recipe=w.planned_recipe or w.recipe), tuned_overrides(overrides, on_gpu=w.device == "cuda")


def gpus_needed(w: Workload, overrides: list[str], side: str) -> int:
    """GPUs a side takes: a TRL side one (one process); ours-gen its engine's TP; ours what its
    config places (`rlhf.rules.run_gpus`, split `auto` engines on one GPU). A config that does not
    load counts one: the side then fails in its own run, with its record."""
    from rlhf.config import load_config
    from rlhf.rules import engines_without_cluster, run_gpus

    if side.startswith("trl"):
        return 1
    try:
        cfg = load_config(Path(__file__).resolve().parents[1] / w.recipe, overrides)
    except (ValueError, OSError):
        return 1
    if side == "ours-gen":
        return cfg.cluster.generator_tp
    return run_gpus(cfg, engines_without_cluster(cfg))


def resolved_memory_keys(config: Path) -> dict[str, Any]:
    """The memory planner's keys (`PLAN_KEYS`) in a run's resolved config.yaml: what the plan chose,
    or the recipe's values; {} without the file."""
    import yaml

    from rlhf.planner.memory import PLAN_KEYS

    if not config.is_file():
        return {}
    cfg = yaml.safe_load(config.read_text())
    return {key: cfg.get(key.split(".")[0], {}).get(key.split(".")[1]) for key in PLAN_KEYS}
