"""Typed config: recipes load, overrides apply, bad input gets one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.config import ConfigError, RunConfig, config_keys, config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))

# The reviewed config surface (STYLE G8): adding a key means adding it here too.
ALLOWED_KEYS = {
    "algorithm", "seed", "output_dir", "save_every", "keep_checkpoints", "resume", "overwrite", "eval_every",
    "model.path", "model.dtype",
    "data.task", "data.prompt_template", "data.system_prompt", "data.use_chat_template", "data.num_train",
    "data.num_eval", "data.max_prompt_tokens", "data.seed",
    "generation.backend", "generation.max_new_tokens", "generation.temperature", "generation.top_p",
    "generation.top_k", "generation.gpu_memory_utilization", "generation.cpu_kvcache_gib",
    "generation.enforce_eager", "generation.engine_process", "generation.ignore_eos", "generation.forced_lengths", "generation.max_num_seqs",
    "generation.max_num_batched_tokens", "generation.per_prompt_seeds", "generation.enable_prefix_caching", "generation.async_scheduling",
    "generation.quantization",
    "reward.functions", "reward.timeout_s", "reward.num_workers", "reward.max_failed_steps",
    "reward.warn_failed_frac", "reward.model_device", "reward.max_tokens_per_batch",
    "grpo.steps", "grpo.prompts_per_step", "grpo.group_size", "grpo.scale_by_std", "grpo.clip_low",
    "grpo.clip_high", "grpo.loss_agg", "grpo.kl_coef", "grpo.kl_estimator", "grpo.updates_per_step",
    "dpo.beta", "dpo.loss_type", "dpo.label_smoothing", "dpo.simpo_gamma", "dpo.epochs", "dpo.pairs_per_step",
    "dpo.max_steps", "dpo.dataset", "dpo.num_train", "dpo.num_eval", "dpo.max_length", "dpo.max_prompt_length",
    "dpo.truncation", "dpo.on_malformed", "dpo.precompute_ref",
    "learner.backend", "learner.num_ranks", "learner.zero_stage", "learner.offload_optimizer",
    "learner.offload_params", "learner.lr", "learner.weight_decay", "learner.betas", "learner.warmup_steps",
    "learner.max_grad_norm", "learner.max_nonfinite_steps", "learner.micro_batch_size", "learner.max_tokens_per_micro_batch",
    "learner.gradient_checkpointing", "learner.reshard_after_forward", "learner.fused_head",
    "learner.pack_sequences", "learner.attention", "learner.share_prompts", "learner.deepspeed_config",
    "learner.padding_mask", "learner.liger", "learner.compile", "learner.cast_once_per_step", "learner.head_kernels",
    "learner.head_keep_logits",
    "env.sandbox",
    "learner.lora_rank", "learner.lora_alpha", "learner.lora_dropout", "learner.lora_target_modules",
    "learner.lora_sync", "memory.plan", "memory.gpu", "memory.gpu_memory_gib",
    "grpo.max_staleness", "grpo.is_correction", "grpo.is_cap", "grpo.rollouts", "grpo.overprovision",
    "grpo.overlong", "grpo.overlong_buffer", "grpo.overlong_penalty_factor", "grpo.dynamic_sampling",
    "grpo.max_sampling_rounds",
    "eval.n", "eval.k", "eval.temperature", "eval.max_new_tokens", "eval.num_prompts",
    "cluster.placement", "cluster.generator_engines", "cluster.generator_tp", "cluster.engines_per_gpu",
    "cluster.weight_sync",
    "cluster.placement_strategy", "cluster.timeout_s", "cluster.address", "cluster.pin_cores",
    "logging.backends", "logging.project", "logging.verbose",
    "env.tools", "env.environment", "env.max_turns", "env.tool_timeout_s", "env.max_tool_output_chars",
}


def test_config_surface_is_reviewed():
    assert set(config_keys()) == ALLOWED_KEYS


def test_defaults_and_frozen():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig) and cfg.grpo.group_size == 8 and cfg.learner.backend == "fsdp2"
    with pytest.raises(AttributeError):
        cfg.grpo.group_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_validates_and_documents_its_command(recipe: Path):
    cfg = load_config(recipe)
    assert cfg.algorithm in ("grpo", "dpo")
    assert f"--config configs/{recipe.name}" in recipe.read_text() or f"submit.sh configs/{recipe.name}" in recipe.read_text()


def test_overrides_parse_types():
    cfg = load_config(ROOT / "configs/grpo_tiny_cpu.yaml",
                      ["grpo.group_size=6", "learner.lr=3e-5", "grpo.scale_by_std=false", "data.system_prompt=null",
                       "learner.betas=[0.8, 0.9]", "reward.functions=[{function: 'rewards.answers:exact_answer', weight: 2}]"])
    assert cfg.grpo.group_size == 6 and cfg.learner.lr == 3e-5 and cfg.grpo.scale_by_std is False
    assert cfg.data.system_prompt is None and cfg.learner.betas == (0.8, 0.9)
    assert cfg.reward.functions[0].weight == 2.0
    assert isinstance(cfg.learner.lr, float)


def test_round_trip_through_plain_data():
    cfg = load_config(ROOT / "configs/grpo_tiny_cpu.yaml")
    from rlhf.config import config_from_dict

    assert config_from_dict(config_to_dict(cfg)) == cfg


BAD = [
    (["grpo.gropu_size=3"], "unknown key 'grpo.gropu_size' (allowed: steps, prompts_per_step, group_size"),
    (["nosuch=1"], "unknown key 'nosuch'"),
    (["grpo.group_size=1"], "grpo.group_size=1 is not allowed: an integer >= 2"),
    (["learner.lr=-1e-5"], "learner.lr=-1e-05 is not allowed: a finite number > 0"),
    (["learner.lr=abc"], "learner.lr='abc' has the wrong type: expected a number"),
    (["dpo.beta=0"], "dpo.beta=0.0 is not allowed: a number > 0"),
    (["dpo.beta=-0.5"], "dpo.beta=-0.5 is not allowed: a number > 0"),
    (["grpo.steps=2.5"], "grpo.steps=2.5 has the wrong type: expected an integer"),
    (["generation.backend=sglang"], "generation.backend='sglang' is not allowed: one of 'vllm', 'hf'"),
    (["generation.top_p=0"], "generation.top_p=0.0 is not allowed: a number in (0, 1]"),
    (["grpo.loss_agg=sum"], "grpo.loss_agg='sum' is not allowed: one of 'token-mean'"),
    (["resume=maybe"], "resume='maybe' has the wrong type: expected true or false"),
    (["grpo=3"], "grpo must be a mapping"),
    (["grpo.steps"], "override 'grpo.steps' must look like key=value"),
    (["reward.functions=[{weight: 1}]"], "reward.functions[0].function is required"),
    (["reward.functions=[{function: no_colon}]"], "reward.functions[0].function='no_colon' is not allowed"),
    (["learner.betas=[0.9]"], "learner.betas=[0.9] must have 2 items"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_values_raise_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.yaml' does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: not valid YAML \(expected ',' or ']'"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


@pytest.mark.parametrize(
    "args,message",
    [
        (["grpo.gropu_size=3"], "error: unknown key 'grpo.gropu_size'"),
        (["learner.lr=-1"], "error: learner.lr=-1.0 is not allowed"),
        (["--config", "configs/missing.yaml"], "error: config file 'configs/missing.yaml' does not exist"),
    ],
)
def test_cli_prints_one_line_and_exits_2(args, message):
    argv = [a for a in args if a.startswith("--") or "/" in a]
    overrides = [a for a in args if a not in argv]
    proc = subprocess.run(
        [sys.executable, "scripts/train_grpo.py", *(argv or ["--config", "configs/grpo_tiny_cpu.yaml"]), *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(message), proc.stderr


# A recipe error names the file and the line the key is written on, as an editor numbers lines.
LOCATED = [
    ("grpo:\n  steps: 3\n  gropu_size: 4\n", "3: unknown key 'grpo.gropu_size'"),
    ("algorithm: grpo\n\ngrpo:\n  group_size: 1\n", "4: grpo.group_size=1 is not allowed"),
    ("learner:\n  lr: fast\n", "2: learner.lr='fast' has the wrong type"),
    ("reward:\n  functions:\n    - function: rewards.answers:exact_answer\n    - weight: 2\n",
     "4: reward.functions[1].function is required"),
    ("reward:\n  functions:\n    - {function: a:b, weight: 1, wieght: 2}\n", "3: unknown key 'reward.functions[0].wieght'"),
    ("generation:\n  temperature: 0\n", "2: generation.temperature=0.0 is not allowed: > 0 for GRPO"),
    ("grpo:\n  steps: 3\n  steps: 4\n", "3: 'grpo.steps' is set twice (first on line 2); keep one"),
    ("grpo:\n  steps: 3\n grpo_size: 2\n", "3: not valid YAML ("),
    ("grpo: 3\n", "1: grpo must be a mapping"),
]


@pytest.mark.parametrize("text,message", LOCATED, ids=[m.split(": ", 1)[1][:40] for _, m in LOCATED])
def test_recipe_errors_name_the_file_and_line(text, message, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value).startswith(f"{recipe}:{message}"), str(err.value)
    assert "\n" not in str(err.value)


def test_an_override_error_names_no_recipe_line(tmp_path):
    """The value an override sets is the override's, not the recipe line's."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("grpo:\n  group_size: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["grpo.group_size=1"])
    assert str(err.value).startswith("grpo.group_size=1 is not allowed")
    with pytest.raises(ConfigError) as err:  # about keys the recipe never wrote: no line either
        load_config(recipe, ["grpo.clip_low=0", "grpo.clip_high=0", "grpo.updates_per_step=2"])
    assert str(err.value).startswith("grpo.clip_high=0.0 is not allowed")
    assert load_config(recipe, ["grpo.group_size=2"]).grpo.group_size == 2


def test_what_grpo_cannot_learn_from_is_no_concern_of_dpo():
    cfg = load_config(ROOT / "configs/dpo_tiny_cpu.yaml", ["generation.temperature=0", "generation.top_k=1"])
    assert cfg.algorithm == "dpo" and cfg.generation.temperature == 0
    with pytest.raises(ConfigError, match="generation.top_k=1 is not allowed: not 1 for GRPO"):
        load_config(ROOT / "configs/grpo_tiny_cpu.yaml", ["generation.top_k=1"])
    # one clip side open is enough; with one update per step the clip range never binds the first update
    assert load_config(None, ["grpo.clip_low=0", "grpo.updates_per_step=2"]).grpo.clip_low == 0
    assert load_config(None, ["grpo.clip_low=0", "grpo.clip_high=0"]).grpo.clip_high == 0


def test_config_error_keeps_its_key_through_pickle():
    import pickle

    err = pickle.loads(pickle.dumps(ConfigError("grpo.steps=0 is not allowed", key="grpo.steps")))
    assert str(err) == "grpo.steps=0 is not allowed" and err.key == "grpo.steps"


def test_reward_workers_auto_follows_the_cores_and_bad_counts_are_refused():
    """`reward.num_workers: auto` (the default): a quarter of the scoring process's cores, 2 to 8; a
    number is kept; anything else is refused in one line."""
    import os

    from rlhf.rules import reward_workers
    from rlhf.scoring import PoolScorer

    assert load_config(None).reward.num_workers == "auto"
    assert [reward_workers("auto", c) for c in (1, 2, 8, 16, 32, 64)] == [2, 2, 2, 4, 8, 8]
    assert reward_workers(3, 64) == 3 and load_config(None, ["reward.num_workers=3"]).reward.num_workers == 3
    with pytest.raises(ConfigError, match=r"^reward\.num_workers=0 is not allowed: 'auto' or an integer >= 1$"):
        load_config(None, ["reward.num_workers=0"])
    with pytest.raises(ConfigError, match=r"^reward\.num_workers='many' has the wrong type: expected an integer"):
        load_config(None, ["reward.num_workers=many"])
    scorer = PoolScorer(["rewards.answers:exact_answer"], tokenizer=None, timeout_s=5, num_workers="auto")
    try:
        assert scorer.pool.num_workers == reward_workers("auto", len(os.sched_getaffinity(0)))
    finally:
        scorer.close()
