"""The benchmark runner's pure parts (benchmarks/): identical work on both sides, the summary
arithmetic, the table and the JSON record. No timings: those are the benchmark's output, never a test.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.summary import (
    RECORD_KEYS,
    build_record,
    format_table,
    ours_dpo_steps,
    ours_grpo_steps,
    ratios,
    summarize,
)
from benchmarks.workloads import (
    WORKLOADS,
    grpo_step_prompts,
    our_overrides,
    reward_columns,
    trl_dpo_kwargs,
    trl_grpo_kwargs,
    trl_prompt,
)
from rlhf.config import load_config


def resolve(workload, tmp_path, **model):
    return load_config(workload.recipe, our_overrides(workload, output_dir=str(tmp_path / "run"), **model))


# ---------------------------------------------------------------------------------------------
# Spec -> our config -> TRL config


def test_grpo_cpu_spec_reaches_our_config(tmp_path):
    w = WORKLOADS["grpo-cpu"]
    cfg = resolve(w, tmp_path)
    assert (cfg.model.path, cfg.data.task, cfg.seed, cfg.data.seed) == ("smollm2-135m-instruct", "arithmetic_1digit", 0, 0)
    assert (cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.steps) == (8, 8, 5)
    assert (cfg.generation.max_new_tokens, cfg.learner.lr, cfg.learner.micro_batch_size) == (32, 2e-5, 64)
    assert cfg.output_dir == str(tmp_path / "run") and cfg.save_every == 0 and cfg.eval_every == 0


@pytest.mark.parametrize("use_vllm", [False, True])
def test_trl_grpo_config_matches_ours(tmp_path, use_vllm):
    from trl import GRPOConfig

    cfg = resolve(WORKLOADS["grpo-cpu"], tmp_path)
    trl = GRPOConfig(**trl_grpo_kwargs(cfg, use_vllm=use_vllm, ignore_eos=False, output_dir=str(tmp_path / "trl"),
                                       use_cpu=True))
    g = cfg.grpo
    assert trl.num_generations == g.group_size == 8
    assert trl.generation_batch_size == g.prompts_per_step * g.group_size == 64  # one generation per optimizer step
    assert trl.per_device_train_batch_size * trl.gradient_accumulation_steps == 64
    assert trl.steps_per_generation == trl.gradient_accumulation_steps and trl.num_iterations == 1
    assert trl.max_completion_length == cfg.generation.max_new_tokens == 32
    assert trl.max_steps == g.steps and trl.seed == cfg.seed
    assert trl.learning_rate == cfg.learner.lr and trl.lr_scheduler_type == "constant"
    assert (trl.adam_beta1, trl.adam_beta2, trl.weight_decay) == (*cfg.learner.betas, cfg.learner.weight_decay)
    assert trl.max_grad_norm == cfg.learner.max_grad_norm
    assert (trl.temperature, trl.top_p, trl.top_k) == (cfg.generation.temperature, cfg.generation.top_p, 0)
    assert (trl.beta, trl.epsilon, trl.epsilon_high) == (0.0, g.clip_low, g.clip_high)
    assert trl.loss_type == "dapo" and trl.scale_rewards == "group"  # token-mean, std-scaled group advantages
    assert trl.bf16 and trl.model_init_kwargs == {"dtype": "float32"}  # fp32 master weights, bf16 compute
    assert not trl.gradient_checkpointing and not trl.shuffle_dataset
    assert trl.use_vllm == use_vllm and not trl.vllm_importance_sampling_correction


def test_gpu_workload_fixes_lengths_on_the_trl_side(tmp_path):
    w = WORKLOADS["grpo-gpu"]
    cfg = resolve(w, tmp_path, model_path=str(tmp_path / "model"))
    assert (cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.generation.max_new_tokens) == (64, 8, 512)
    assert cfg.model.path == str(tmp_path / "model")
    vllm = trl_grpo_kwargs(cfg, use_vllm=True, ignore_eos=True, output_dir="x", use_cpu=False)
    assert vllm["generation_kwargs"] == {"ignore_eos": True} and vllm["vllm_mode"] == "colocate"
    assert vllm["vllm_gpu_memory_utilization"] == cfg.generation.gpu_memory_utilization
    assert vllm["vllm_enable_sleep_mode"]  # ours sleeps the colocated engine while training too
    assert (vllm["per_device_train_batch_size"], vllm["gradient_accumulation_steps"]) == (16, 32)
    hf = trl_grpo_kwargs(cfg, use_vllm=False, ignore_eos=True, output_dir="x", use_cpu=False)
    assert hf["generation_kwargs"] == {"min_new_tokens": 512}


def test_dpo_spec_reaches_both_configs(tmp_path):
    from trl import DPOConfig

    cfg = resolve(WORKLOADS["dpo-cpu"], tmp_path)
    d = cfg.dpo
    assert (d.dataset, d.pairs_per_step, d.max_steps, d.beta, d.loss_type, d.precompute_ref) == \
        ("arithmetic_pairs", 8, 5, 0.1, "sigmoid", False)
    trl = DPOConfig(**trl_dpo_kwargs(cfg, output_dir=str(tmp_path / "trl"), use_cpu=True))
    assert trl.per_device_train_batch_size * trl.gradient_accumulation_steps == d.pairs_per_step
    assert trl.per_device_train_batch_size == cfg.learner.micro_batch_size // 2  # our micro-batch counts sequences
    assert (trl.beta, trl.loss_type, trl.max_length, trl.max_steps) == (d.beta, ["sigmoid"], d.max_length, 5)
    assert trl.learning_rate == cfg.learner.lr and not trl.precompute_ref_log_probs
    assert trl.train_sampling_strategy == "sequential"  # our pair order


def test_trl_mapping_refuses_what_trl_cannot_do_the_same_way(tmp_path):
    base = resolve(WORKLOADS["grpo-cpu"], tmp_path)
    with pytest.raises(ValueError, match="k3"):
        trl_grpo_kwargs(replace(base, grpo=replace(base.grpo, kl_coef=0.1, kl_estimator="k2")),
                        use_vllm=False, ignore_eos=False, output_dir="x", use_cpu=True)
    with pytest.raises(ValueError, match="num_ranks"):
        trl_grpo_kwargs(replace(base, learner=replace(base.learner, num_ranks=2)),
                        use_vllm=False, ignore_eos=False, output_dir="x", use_cpu=True)
    with pytest.raises(ValueError, match="micro-batch"):
        trl_grpo_kwargs(replace(base, learner=replace(base.learner, micro_batch_size=48)),
                        use_vllm=False, ignore_eos=False, output_dir="x", use_cpu=True)
    dpo = resolve(WORKLOADS["dpo-cpu"], tmp_path)
    with pytest.raises(ValueError, match="simpo"):
        trl_dpo_kwargs(replace(dpo, dpo=replace(dpo.dpo, loss_type="simpo")), output_dir="x", use_cpu=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        trl_dpo_kwargs(replace(dpo, dpo=replace(dpo.dpo, label_smoothing=0.1)), output_dir="x", use_cpu=True)


def test_tiny_variants_resolve(tmp_path):
    for w in WORKLOADS.values():
        tiny = w.tiny()
        cfg = resolve(tiny, tmp_path)
        assert cfg.model.path == "tiny-qwen2" and tiny.name == f"{w.name}-tiny"
        if w.algorithm == "grpo":
            trl_grpo_kwargs(cfg, use_vllm=True, ignore_eos=tiny.ignore_eos, output_dir="x", use_cpu=True)
        else:
            trl_dpo_kwargs(cfg, output_dir="x", use_cpu=True)


# ---------------------------------------------------------------------------------------------
# Same prompts, same reward


def test_trl_tokenizes_exactly_our_step_prompts(tiny_qwen2, tmp_path):
    from transformers import AutoTokenizer

    w = replace(WORKLOADS["grpo-cpu"].tiny(), extra=("data.num_train=16", "data.num_eval=4"),
                model=str(tiny_qwen2))
    cfg = resolve(w, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    steps = grpo_step_prompts(cfg, tokenizer)
    assert len(steps) == cfg.grpo.steps and all(len(s) == cfg.grpo.prompts_per_step for s in steps)
    for row, ours in [pair for step in steps for pair in step]:
        # What GRPOTrainer._tokenize_prompts does with a conversational prompt.
        theirs = tokenizer.apply_chat_template(conversation=[trl_prompt(row, cfg)], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"][0]
        assert list(theirs) == ours


def test_trl_reward_scores_like_our_reward(tmp_path):
    from benchmarks.trl_grpo import make_reward
    from rlhf.types import PromptRow

    cfg = resolve(WORKLOADS["grpo-cpu"], tmp_path)  # reward: rewards.tasks:arithmetic
    reward = make_reward(cfg)
    row = PromptRow(prompt="Calculate 3 + 5. Reply with only the number.", answer="8", meta={"expression": "3 + 5"})
    completions = [[{"role": "assistant", "content": text}] for text in ("8", "9", "3 + 5 = 8")]
    scores = reward(prompts=None, completions=completions, prompt_text=[row.prompt] * 3,
                    row_json=[reward_columns(row)] * 3)
    assert scores == [1.0, 0.0, 1.0]
    assert json.loads(reward_columns(row)) == {"answer": "8", "expression": "3 + 5"}


# ---------------------------------------------------------------------------------------------
# Summary, table, record


def _our_grpo_metrics():
    return [
        {"step": k, "timing/step_s": s, "timing/generate_s": g, "timing/train_s": t, "timing/sync_s": 0.5,
         "timing/reward_s": 0.01, "response_len/mean": 10.0, "reward/mean": r, "memory/learner_peak_gib": 2.0}
        for k, (s, g, t, r) in enumerate([(30.0, 20.0, 9.0, 0.2), (10.0, 4.0, 5.0, 0.4), (12.0, 4.0, 7.0, 0.5),
                                          (11.0, 5.0, 5.0, 0.6)])
    ]


def test_our_metrics_become_step_records_and_summary():
    steps = ours_grpo_steps([{"step": -1, "eval/pass@1": 0.1}, *_our_grpo_metrics()], [400, 400, 420, 380], 16)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]  # the evaluation-only record is skipped
    assert steps[1]["gen_tokens"] == 160.0 and steps[2]["train_tokens"] == 580.0
    summary = summarize({"steps": steps, "startup_s": 40.0, "peak_mem_gib": 3.0}, "grpo")
    assert summary["step_s"] == 11.0  # median of steps 1..3: step 0 (30 s) is start-up-heavy
    assert summary["generate_s"] == 4.0 and summary["gen_tokens_per_s"] == 40.0  # median of 40, 40, 32
    assert summary["train_tokens_per_s"] == pytest.approx(540 / 5)  # median of 560/5, 580/7, 540/5
    assert summary["reward_per_step"] == [0.2, 0.4, 0.5, 0.6] and summary["reward_mean"] == pytest.approx(0.425)
    assert summary["startup_s"] == 40.0 and summary["peak_mem_gib"] == 3.0


def test_ratios_and_table():
    ours = {"step_s": 10.0, "gen_tokens_per_s": 300.0, "peak_mem_gib": 4.0, "reward_per_step": [0.2, 0.5]}
    trl = {"step_s": 40.0, "gen_tokens_per_s": 100.0, "peak_mem_gib": 0.0, "reward_per_step": [0.1, 0.3]}
    r = ratios(ours, trl, "grpo")
    assert r["step_s"] == 0.25 and r["gen_tokens_per_s"] == 3.0 and r["peak_mem_gib"] is None
    table = format_table({"ours": ours, "trl": trl}, "grpo", errors={"trl-vllm": "AttributeError: x"})
    lines = table.splitlines()
    assert lines[0] == "| metric | ours | trl | ours/trl |"
    assert "| median step s, steps 1..N-1 (lower is better) | 10 | 40 | 0.25 |" in lines
    assert "| generation tokens/s (higher is better) | 300 | 100 | 3 |" in lines
    assert any(line.startswith("| reward/mean per step | 0.2 0.5 | 0.1 0.3 |") for line in lines)
    assert "trl-vllm failed: AttributeError: x" in table


def test_dpo_steps_summary_and_record():
    metrics = [{"step": -1, "eval/loss": 0.69}] + [
        {"step": k, "timing/step_s": s, "throughput/tokens_per_s": 100.0, "loss": l, "rewards/accuracy": a,
         "rewards/margin": m} for k, (s, l, a, m) in enumerate([(8.0, 0.69, 0.0, 0.0), (4.0, 0.6, 0.5, 0.2),
                                                                (6.0, 0.5, 1.0, 0.5)])]
    steps = ours_dpo_steps(metrics)
    assert [s["step"] for s in steps] == [0, 1, 2] and steps[1]["train_tokens"] == 400.0
    trl_steps = [{"step": k, "step_s": 10.0, "train_s": 10.0, "train_tokens": 500.0, "loss": 0.6, "accuracy": 0.5,
                  "margin": 0.1} for k in range(3)]
    record = build_record(workload=WORKLOADS["dpo-cpu"].to_dict(), time="t", command="c", git={"commit": "abc"},
                          machine={"cpu": "x"}, versions={"trl": "1.16.0"}, env={}, overrides=["a=b"],
                          sides={"ours": {"steps": steps}, "trl": {"steps": trl_steps},
                                 "trl-vllm": {"steps": [], "ok": False}}, notes=[])
    assert tuple(record) == RECORD_KEYS
    assert record["summary"]["ours"]["step_s"] == 5.0 and record["summary"]["ours"]["accuracy_mean"] == 0.5
    assert record["ratios"]["trl"]["step_s"] == 0.5 and record["ratios"]["trl"]["train_tokens_per_s"] == 2.0
    assert "trl-vllm" not in record["summary"]  # a side with no steps has no summary, only its record
    json.dumps(record)  # one JSON line
    table = format_table({k: record["summary"][k] for k in ("ours", "trl")}, "dpo")
    assert "| loss per step | 0.69 0.6 0.5 | 0.6 0.6 0.6 |" in table
