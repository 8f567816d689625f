"""The benchmark runner's pure parts (benchmarks/): identical work on both sides, the summary
arithmetic, the table and the JSON record. No timings: those are the benchmark's output, never a test.
"""

from __future__ import annotations

import json
import statistics
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
from rlhf.rules import run_gpus


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
    assert cfg.output_dir == str(tmp_path / "run") and cfg.save_every == -1 and cfg.eval_every == 0


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
         "timing/reward_s": 0.01, "response_len/mean": 10.0, "reward/mean": r, "memory/learner_peak_gib": 2.0,
         "perf/mfu": mfu}
        for k, (s, g, t, r, mfu) in enumerate([(30.0, 20.0, 9.0, 0.2, 0.1), (10.0, 4.0, 5.0, 0.4, 0.44),
                                               (12.0, 4.0, 7.0, 0.5, 0.47), (11.0, 5.0, 5.0, 0.6, 0.46)])
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
    # the learner's MFU: median and lowest of steps 1..3 (step 0 compiles and warms up)
    assert summary["mfu"] == 0.46 and summary["mfu_min"] == 0.44
    table = format_table({"ours": summary, "trl": {"step_s": 22.0}}, "grpo")
    assert "| learner MFU, lowest of steps 1..N-1 (higher is better) | 0.44 | - | - |" in table.splitlines()


def test_generation_running_ahead_is_timed_by_its_engines_and_without_the_last_step():
    """Asynchronous GRPO: the loop hardly waits for a generation that ran ahead, so its tokens/s are
    timed by the slowest engine's own seconds; and the last step, which no next generation overlaps,
    is left out of the medians like step 0."""
    metrics = [{**m, "async/staleness": float(k > 0), "gen/engine0_s": 8.0 + k, "gen/engine1_s": 6.0}
               for k, m in enumerate(_our_grpo_metrics())]
    metrics[-1]["timing/step_s"] = 6.0  # the last step: training only
    for m in metrics[1:]:
        m["timing/generate_s"] = 0.001
    steps = ours_grpo_steps(metrics, [400, 400, 420, 380], 16)
    assert [s["engine_s"] for s in steps] == [8.0, 9.0, 10.0, 11.0]
    summary = summarize({"steps": steps}, "grpo")
    assert summary["step_s"] == 11.0  # median of steps 1 and 2 (10 s, 12 s)
    assert summary["gen_tokens_per_s"] == pytest.approx(statistics.median([160 / 9, 160 / 10]))
    on_policy = summarize({"steps": ours_grpo_steps(_our_grpo_metrics(), [400, 400, 420, 380], 16)}, "grpo")
    assert on_policy["step_s"] == 11.0 and on_policy["steps"] == 4  # steps 1..3: 10, 12, 11


def test_under_a_deadline_the_one_gpu_baseline_runs_last():
    """Its steps are the slowest: what the faster waves leave of the deadline goes to it."""
    from benchmarks.scale import fastest_first
    from benchmarks.summary import waves

    schedule = waves({"1gpu": 1, "2gpu-fsdp2": 2, "4gpu-fsdp2": 4}, ["0", "1", "2", "3"], parallel=True)
    assert schedule == [{"1gpu": ["0"], "2gpu-fsdp2": ["1", "2"]}, {"4gpu-fsdp2": ["0", "1", "2", "3"]}]
    assert fastest_first(schedule) == [schedule[1], schedule[0]]
    in_turn = waves({"1gpu": 1, "4gpu-split-zero2": 4, "2gpu-split": 2}, ["0", "1", "2", "3"], parallel=False)
    assert [list(w) for w in fastest_first(in_turn)] == [["4gpu-split-zero2"], ["2gpu-split"], ["1gpu"]]


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


def test_combined_sides_keep_the_machine_and_commit_they_ran_on(tmp_path, capsys):
    from benchmarks.run import main

    def side_run(side, time, commit, gpu):
        steps = ours_grpo_steps(_our_grpo_metrics(), [400, 400, 420, 380], 16)
        return build_record(workload=WORKLOADS["grpo-gpu"].to_dict(), time=time, command="run", env={},
                            git={"commit": commit, "dirty": False}, machine={"gpus": [gpu]}, versions={"vllm": "x"},
                            overrides=["seed=0"], sides={side: {"ok": True, "steps": steps}}, notes=[])

    results = tmp_path / "grpo-gpu.jsonl"
    results.write_text("".join(json.dumps(side_run(*a)) + "\n" for a in [
        ("ours", "2026-01-01T00:00:00", "a" * 40, "old"), ("ours", "2026-01-02T00:00:00", "b" * 40, "H200"),
        ("trl-vllm", "2026-01-02T00:00:01", "c" * 40, "H200")]))
    assert main(["--workload", "grpo-gpu", "--combine", "--results", str(tmp_path), "--plot",
                 str(tmp_path / "steps.png")]) == 0
    assert (tmp_path / "steps.png").read_bytes()[:4] == b"\x89PNG"
    combined = json.loads(results.read_text().splitlines()[-1])
    assert set(combined["sides"]) == {"ours", "trl-vllm"} and combined["ratios"]["trl-vllm"]["step_s"] == 1.0
    # the newest side run's host and commit, not this machine's; each side's run named in the notes
    assert combined["machine"] == {"gpus": ["H200"]} and combined["git"]["commit"] == "c" * 40
    assert any("ours from the run of 2026-01-02T00:00:00 (commit bbbbbbbbbb" in n for n in combined["notes"])
    assert "| median step s, steps 1..N-1 (lower is better) | 11 | 11 | 1 |" in capsys.readouterr().out


def test_a_tree_copy_without_git_names_its_commit_in_rlhf_commit(tmp_path, monkeypatch):
    from benchmarks import run

    monkeypatch.setenv("RLHF_COMMIT", "f" * 40)
    assert run.git_info()["commit"] == "f" * 40
    monkeypatch.setattr(run, "REPO", tmp_path)  # the GPU machine's copy: no .git
    assert run.git_info() == {"commit": "f" * 40, "dirty": None}
    monkeypatch.delenv("RLHF_COMMIT")
    assert run.git_info() == {"commit": "", "dirty": None}


def test_the_gpu_suite_record_takes_the_same_commit_rule(tmp_path, monkeypatch):
    from benchmarks import run
    from tests.gpu.report import build_record as suite_record

    monkeypatch.setattr(run, "REPO", tmp_path)
    monkeypatch.delenv("RLHF_COMMIT", raising=False)
    rec = suite_record([{"test": "t", "outcome": "passed", "seconds": 1.0, "figures": {}}], "bash tests/gpu/run.sh")
    assert rec["commit"] == "unknown (no .git: set RLHF_COMMIT)" and rec["dirty"] is None
    assert (rec["passed"], rec["failed"], rec["seconds"]) == (1, 0, 1.0)
    monkeypatch.setenv("RLHF_COMMIT", "f" * 40)
    assert suite_record([], "bash tests/gpu/run.sh")["commit"] == "f" * 40


def test_a_step_by_phase_plot_of_the_sides(tmp_path):
    from benchmarks.summary import plot_step_phases

    ours = summarize({"steps": ours_grpo_steps(_our_grpo_metrics(), [400, 400, 420, 380], 16)}, "grpo")
    trl = {"step_s": 22.0, "generate_s": 15.0, "train_s": 9.0, "sync_s": 0.2}  # phases > step: other = 0
    sides = {"ours": ours, "trl-vllm": trl, "failed": {"step_s": None}}
    out = plot_step_phases(sides, tmp_path / "p.png", "t")
    assert out == tmp_path / "p.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_step_phases({"failed": {}}, tmp_path / "none.png", "t") is None
    assert not (tmp_path / "none.png").exists()


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


# ---------------------------------------------------------------------------------------------
# grpo-gpu-scale (benchmarks/scale.py): layouts, per-layout summary, speedup, targets, table


def _layout_metrics(step_s, engine_s, sync_s):
    """Hand-made metrics.jsonl of one layout: an evaluation-only record, then one record per step
    with `len(engine_s[k])` engines (each generating 100 tokens) and per-engine sync seconds."""
    out = [{"step": -1, "eval/pass@1": 0.0}]
    for k, (s, gens, syncs) in enumerate(zip(step_s, engine_s, sync_s)):
        m = {"step": k, "timing/step_s": s, "timing/generate_s": max(gens), "timing/train_s": s / 2,
             "timing/sync_s": max(syncs) + 0.05, "timing/reward_s": 0.01, "response_len/mean": 10.0,
             "reward/mean": 0.5, "memory/learner_peak_gib": 3.0 + k, "gen/engine_time_ratio": max(gens) / min(gens)}
        m.update({f"gen/engine{e}_tokens": 100.0 for e in range(len(gens))})
        m.update({f"gen/engine{e}_s": g for e, g in enumerate(gens)})
        m.update({f"sync/engine{e}_s": t for e, t in enumerate(syncs)})
        out.append(m)
    return out


def _scale_runs():
    """Two layouts' run records as benchmarks/scale.py builds them (64 samples per step)."""
    from benchmarks.scale import layout_steps

    one = _layout_metrics([30.0, 8.0, 8.0, 10.0], [[4.0]] * 4, [[0.1], [0.1], [0.2], [0.1]])
    two = _layout_metrics([20.0, 5.0, 4.0, 6.0], [[2.0, 2.5], [2.0, 2.5], [2.0, 3.0], [2.0, 2.0]],
                          [[0.1, 0.2], [0.1, 0.3], [0.1, 0.15], [0.1, 0.2]])
    cluster = {"placement": "colocated", "engines": 2, "tp": 1, "ranks": 2, "backend": "deepspeed", "zero_stage": 2}
    return {
        "1gpu": {"ok": True, "steps": layout_steps(one, [200] * 4, 64), "peak_gpu_gib": 70.0,
                 "cluster": {**cluster, "engines": 1, "ranks": 1, "backend": "fsdp2", "zero_stage": 3}},
        "2gpu-zero2": {"ok": True, "steps": layout_steps(two, [200] * 4, 64), "peak_gpu_gib": 120.0,
                       "cluster": cluster},
        "2gpu-split": {"ok": False, "steps": [], "error": "Traceback ...\nRuntimeError: NCCL error\n\n"},
    }


def test_scale_steps_carry_per_engine_figures():
    runs = _scale_runs()
    steps = runs["2gpu-zero2"]["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]  # the evaluation-only record is skipped
    assert [s["engines"] for s in steps] == [2, 2, 2, 2] and runs["1gpu"]["steps"][0]["engines"] == 1
    assert [s["engine_time_ratio"] for s in steps] == [1.25, 1.25, 1.5, 1.0]
    assert [s["sync_engine_max_s"] for s in steps] == [0.2, 0.3, 0.15, 0.2]
    assert steps[1]["gen_tokens"] == 640.0 and steps[1]["step_s"] == 5.0  # summary.ours_grpo_steps' fields


def test_scale_summary_and_speedup():
    from benchmarks.scale import summarize_layout, with_speedups

    runs = _scale_runs()
    summaries = with_speedups({name: summarize_layout(runs[name], gpus=gpus, samples_per_step=64)
                               for name, gpus in (("1gpu", 1), ("2gpu-zero2", 2))})
    one, two = summaries["1gpu"], summaries["2gpu-zero2"]
    assert one["step_s"] == 8.0 and two["step_s"] == 5.0  # medians of steps 1..3
    assert one["samples_per_s"] == 8.0 and one["samples_per_s_per_gpu"] == 8.0 and one["speedup"] == 1.0
    assert two["samples_per_s"] == 12.8 and two["samples_per_s_per_gpu"] == 6.4
    assert two["speedup"] == pytest.approx(1.6)
    assert two["generate_s"] == 2.5 and two["train_s"] == 2.5
    assert two["sync_s"] == pytest.approx(0.25)  # median of 0.35, 0.2, 0.25
    assert two["sync_engine_max_s"] == 0.3  # the slowest engine of steps 1..3
    assert two["engine_time_ratio"] == 1.25  # median of 1.25, 1.5, 1.0
    assert two["learner_peak_gib"] == 6.0 and two["peak_gpu_gib"] == 120.0  # max over all steps; nvidia-smi
    assert (two["gpus"], two["engines"], two["learners"]) == (2, 2, "2 deepspeed ZeRO-2")
    assert (one["engines"], one["learners"]) == (1, "1 fsdp2")
    assert two["reward_mean"] == 0.5
    # Without a cluster line (it never printed), the engines come from the per-engine metrics.
    no_line = summarize_layout({**runs["2gpu-zero2"], "cluster": None}, gpus=2, samples_per_step=64)
    assert no_line["engines"] == 2 and no_line["learners"] is None
    assert with_speedups({"2gpu-zero2": two})["2gpu-zero2"]["speedup"] is None  # no 1gpu baseline


def test_scale_targets_table_and_record():
    from benchmarks.scale import SCALE_RECORD_KEYS, build_scale_record, format_scale_table, last_line

    runs = _scale_runs()
    layouts = {"1gpu": {"gpus": 1, "overrides": []}, "2gpu-zero2": {"gpus": 2, "overrides": []},
               "2gpu-split": {"gpus": 2, "overrides": []}}
    record = build_scale_record(
        workload={**WORKLOADS["grpo-gpu-scale"].to_dict(), "prompts_per_step": 16, "group_size": 4}, time="t",
        command="c", git={"commit": "abc"}, machine={"gpus": ["H100"]}, versions={}, env={}, overrides=["a=b"],
        layouts=layouts, sides=runs, notes=[])
    assert tuple(record) == SCALE_RECORD_KEYS
    assert set(record["summary"]) == {"1gpu", "2gpu-zero2"}  # a failed layout keeps its record, no summary
    assert record["summary"]["2gpu-zero2"]["speedup"] == pytest.approx(1.6)
    assert record["targets"] == [
        "2 GPUs vs 1: best 2-GPU layout 2gpu-zero2 gives 1.60x samples/s (target >= 1.8x): missed",
        "4 GPUs vs 1: not measured (needs 1gpu and a 4-GPU layout that ran)",
        "sync: max 0.25 s (target <= 0.3 s): met (median of steps 1..N-1, layout 2gpu-zero2)",
    ]
    json.dumps(record)  # one JSON line
    # Weak scaling: the 2-GPU layout ran twice the prompts, so its samples/s per GPU is 1gpu's x 1.6.
    weak = build_scale_record(
        workload={**WORKLOADS["grpo-gpu-scale"].to_dict(), "prompts_per_step": 16, "group_size": 4}, time="t",
        command="c", git={}, machine={}, versions={}, env={}, overrides=[], notes=[], weak=True,
        layouts={**layouts, "2gpu-zero2": {"gpus": 2, "prompts_per_step": 32, "overrides": []}}, sides=runs)
    assert weak["scaling"] == "weak" and weak["summary"]["2gpu-zero2"]["samples_per_s_per_gpu"] == 12.8
    assert weak["targets"][0] == "2 GPUs vs 1, weak: 2gpu-zero2 keeps 160% of 1 GPU's samples/s per GPU (target >= 90%): met"
    errors = {"2gpu-split": last_line(runs["2gpu-split"]["error"])}
    lines = format_scale_table(list(layouts), record["summary"], errors).splitlines()
    assert lines[0] == "| metric | 1gpu | 2gpu-zero2 | 2gpu-split |"
    assert "| GPUs | 1 | 2 | failed |" in lines
    assert "| learner ranks, backend | 1 fsdp2 | 2 deepspeed ZeRO-2 | failed |" in lines
    assert "| samples/s: prompts x group / step s | 8 | 12.8 | failed |" in lines
    assert "| speedup vs 1gpu (samples/s) | 1 | 1.6 | failed |" in lines
    assert "| max engine sync s (sync/engine*_s) | 0.2 | 0.3 | failed |" in lines
    assert not any(line.startswith("| peak host memory") for line in lines)  # no layout has a value
    assert lines[-1] == "2gpu-split failed: RuntimeError: NCCL error"


def test_a_stopped_layout_counts_with_the_steps_it_finished():
    """A layout stopped at its time limit after steps 0-2 of 4 is summarized from steps 1-2 and says
    so under the table; one stopped before step 1 finished is a failure."""
    from benchmarks.scale import build_scale_record, stopped_line, usable

    runs = _scale_runs()
    stopped = {**runs["2gpu-zero2"], "ok": False, "timed_out": True, "timeout_s": 330.0, "error": "log tail",
               "steps": runs["2gpu-zero2"]["steps"][:3]}
    assert usable(stopped) and not usable({**stopped, "steps": stopped["steps"][:1]})
    record = build_scale_record(
        workload={**WORKLOADS["grpo-gpu-scale"].to_dict(), "prompts_per_step": 16, "group_size": 4}, time="t",
        command="c", git={}, machine={}, versions={}, env={}, overrides=[], notes=[],
        layouts={"1gpu": {"gpus": 1, "overrides": []}, "2gpu-zero2": {"gpus": 2, "overrides": []}},
        sides={"1gpu": runs["1gpu"], "2gpu-zero2": stopped})
    assert record["summary"]["2gpu-zero2"]["step_s"] == 4.5  # the median of steps 1 and 2 (5.0, 4.0)
    assert record["summary"]["2gpu-zero2"]["speedup"] == pytest.approx(8.0 / 4.5)  # 64 samples a step on both
    assert stopped_line("2gpu-zero2", stopped, 4) == (
        "2gpu-zero2 was stopped at its 330 s limit after 3 of 4 steps: its figures are steps 1-2")
    crashed = {**stopped, "timed_out": False, "error": "Traceback ...\nRuntimeError: NCCL error\n"}
    assert stopped_line("2gpu-zero2", crashed, 4).startswith("2gpu-zero2 was stopped (RuntimeError: NCCL error)")


@pytest.mark.parametrize("first_wave_s", [400.0, 100.0])
def test_scale_deadline_shares_the_time_between_waves(tmp_path, monkeypatch, capsys, first_wave_s):
    """--deadline 500 on 4 GPUs, two waves, the 4-GPU one first (`fastest_first`): it may run 235 s,
    half of the 470 s left (30 s are kept to stop the last layouts and write the record). When it
    takes 400 s (a fake clock), the one-GPU baseline's wave (70 s left, under 90) is not started and
    the record still comes out with all three layouts; when it takes 100 s, that wave gets the 370 s
    that are left."""
    import threading
    import time
    from types import SimpleNamespace

    from benchmarks import run, scale

    clock = {"now": 1000.0}
    fake = SimpleNamespace(monotonic=lambda: clock["now"], time=time.time, sleep=time.sleep)
    monkeypatch.setattr(scale, "time", fake)
    monkeypatch.setattr(run, "time", fake)  # run.wave_timeout: the shares
    monkeypatch.setattr(scale, "visible_gpus", lambda env: ["0", "1", "2", "3"])
    monkeypatch.setattr(scale, "prepare_model", lambda w, workdir: str(tmp_path / "model"))
    monkeypatch.setattr(scale, "step_prompt_tokens", lambda w, common: [20] * w.steps)
    limits, second_wave = {}, threading.Barrier(2, timeout=30)

    def fake_run_layout(w, name, side_dir, env, *, timeout, **kw):
        limits[name] = timeout
        if name == "4gpu-fsdp2":
            clock["now"] = 1000.0 + first_wave_s
        else:
            second_wave.wait()  # the second wave's two layouts run at once
        return {**_scale_runs()["1gpu"], "side": name, "wall_s": 1.0, "timeout_s": timeout}

    monkeypatch.setattr(scale, "run_layout", fake_run_layout)
    rc = scale.main(["--layouts", "1gpu,2gpu-fsdp2,4gpu-fsdp2", "--prompts", "256", "--deadline", "500",
                     "--no-pin", "--workdir", str(tmp_path / "work"), "--results", str(tmp_path / "results")])
    lines = (tmp_path / "results" / "grpo-gpu-scale.jsonl").read_text().splitlines()
    [record] = [json.loads(line) for line in lines]
    assert set(record["sides"]) == {"1gpu", "2gpu-fsdp2", "4gpu-fsdp2"}
    assert limits["4gpu-fsdp2"] == 235.0
    assert list(record["schedule"][0]) == ["4gpu-fsdp2"]
    kept = [json.loads(line) for line in (tmp_path / "results" / "grpo-gpu-scale.sides.jsonl").read_text().splitlines()]
    assert kept[0]["sides"].keys() == {"4gpu-fsdp2"} and kept[0]["overrides"][0] == "cluster.placement=colocated"
    assert {name for k in kept for name in k["sides"]} == set(limits)  # each layout that ran, as it ended
    if first_wave_s == 400.0:
        assert rc == 1 and "1gpu" not in limits and "2gpu-fsdp2" not in limits
        assert "[scale] 1gpu, 2gpu-fsdp2: not started: 70 s of --deadline 500 left" in capsys.readouterr().out
        assert record["sides"]["1gpu"]["error"] == "not started: 70 s of --deadline 500 left"
        assert set(record["summary"]) == {"4gpu-fsdp2"}
    else:
        assert rc == 0 and limits["1gpu"] == limits["2gpu-fsdp2"] == 370.0 and len(record["summary"]) == 3


def test_scale_cluster_line_and_layout_choice():
    from benchmarks.scale import LAYOUTS, choose_layouts, parse_cluster_line, visible_gpus

    log = ("noise\ncluster: split, 1 engine(s) x TP 1, 1 fsdp2 learner rank(s) on 1 node(s), 2 GPUs, 32 CPUs\n"
           "placement: engines 0@node0 | learner ranks 0@node0")
    assert parse_cluster_line(log) == {"placement": "split", "engines": 1, "tp": 1, "ranks": 1, "backend": "fsdp2"}
    assert parse_cluster_line("Traceback: died early") is None
    assert choose_layouts(None, 1, on_gpu=True) == (
        ["1gpu"], ["2gpu-fsdp2 skipped: needs 2 GPUs, 1 visible", "4gpu-fsdp2 skipped: needs 4 GPUs, 1 visible",
                   "8gpu-fsdp2 skipped: needs 8 GPUs, 1 visible"])
    assert choose_layouts(None, 4, on_gpu=True)[0] == ["1gpu", "2gpu-fsdp2", "4gpu-fsdp2"]
    assert choose_layouts(list(LAYOUTS), 8, on_gpu=True) == (list(LAYOUTS), [])
    assert choose_layouts(["2gpu-split"], 0, on_gpu=False) == (["2gpu-split"], [])  # CPU: GPUs are nominal
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize("on_gpu", [True, False])
def test_scale_layouts_resolve(tmp_path, on_gpu):
    from benchmarks.scale import LAYOUTS, layout_overrides

    w = WORKLOADS["grpo-gpu-scale"]
    assert (w.prompts_per_step, w.group_size, w.max_new_tokens, w.ignore_eos, w.trl_sides) == (64, 8, 256, True, ())
    assert w.extra == WORKLOADS["grpo-gpu"].extra
    want = {"1gpu": ("colocated", 1, "fsdp2", 0), "2gpu-fsdp2": ("colocated", 2, "fsdp2", 0),
            "2gpu-zero2": ("colocated", 2, "deepspeed", 0), "2gpu-split": ("split", 1, "fsdp2", 0),
            "2gpu-split-async": ("split", 1, "fsdp2", 1), "4gpu-fsdp2": ("colocated", 4, "fsdp2", 0),
            "4gpu-zero2": ("colocated", 4, "deepspeed", 0),
            "4gpu-zero3": ("colocated", 4, "deepspeed", 0), "4gpu-split-zero2": ("split", 3, "deepspeed", 0),
            "4gpu-split-zero2-async": ("split", 3, "deepspeed", 1), "4gpu-split-fsdp2": ("split", 2, "fsdp2", 0),
            "4gpu-split-fsdp2-async": ("split", 2, "fsdp2", 1), "8gpu-fsdp2": ("colocated", 8, "fsdp2", 0),
            "8gpu-split-zero2": ("split", 7, "deepspeed", 0), "8gpu-split-zero3": ("split", 7, "deepspeed", 0)}
    assert want.keys() == LAYOUTS.keys()
    for name, layout in LAYOUTS.items():
        base = our_overrides(w, output_dir=str(tmp_path / name), model_path=str(tmp_path / "model"))
        cfg = load_config(w.recipe, [*base, *layout_overrides(layout, on_gpu=on_gpu, prompts=256)])
        got = (cfg.cluster.placement, cfg.learner.num_ranks, cfg.learner.backend, cfg.grpo.max_staleness)
        assert got == want[name], name
        assert cfg.generation.max_new_tokens == 256 and cfg.generation.ignore_eos and cfg.grpo.prompts_per_step == 256
        # Colocated on a GPU, `auto` resolves the engines at launch; split layouts and CPU name the count.
        auto = on_gpu and cfg.cluster.placement == "colocated"
        assert cfg.cluster.generator_engines == ("auto" if auto else layout.engines)
        assert layout.gpus == (layout.engines + cfg.learner.num_ranks if cfg.cluster.placement == "split"
                               else cfg.learner.num_ranks)
    assert load_config(w.recipe, list(LAYOUTS["2gpu-zero2"].overrides)).learner.zero_stage == 2
    assert load_config(w.recipe, list(LAYOUTS["8gpu-split-zero3"].overrides)).learner.zero_stage == 3
    # Two engines beside each learner rank, or on each generating GPU of a split layout (the GPUs
    # stay the layout's): named on GPU and CPU alike.
    for name, ranks in (("1gpu", 1), ("4gpu-fsdp2", 4), ("4gpu-split-zero2", 3), ("4gpu-split-fsdp2-async", 2)):
        base = our_overrides(w, output_dir=str(tmp_path / name), model_path=str(tmp_path / "model"))
        layout = LAYOUTS[name]
        cfg = load_config(w.recipe, [*base, *layout_overrides(layout, on_gpu=on_gpu, engines_per_gpu=2)])
        assert (cfg.cluster.generator_engines, cfg.learner.num_ranks) == (2 * layout.engines, ranks)
        assert cfg.cluster.engines_per_gpu == (1 if layout.colocated else 2)
        assert run_gpus(cfg, cfg.cluster.generator_engines) == layout.gpus


def test_scale_layouts_on_disjoint_gpus_run_at_once_and_plot(tmp_path):
    """On 4 GPUs the default line runs in two waves: 1gpu beside 2gpu-fsdp2, then 4gpu-fsdp2; the
    plot has the measured points and the ideal line."""
    from benchmarks.scale import LAYOUTS, plot_scaling, summarize_layout, with_speedups
    from benchmarks.summary import waves

    names = ["1gpu", "2gpu-fsdp2", "4gpu-fsdp2"]
    assert waves({n: LAYOUTS[n].gpus for n in names}, ["0", "1", "2", "3"], parallel=True) == [
        {"1gpu": ["0"], "2gpu-fsdp2": ["1", "2"]}, {"4gpu-fsdp2": ["0", "1", "2", "3"]}]
    assert len(waves({n: LAYOUTS[n].gpus for n in names}, ["0", "1", "2", "3"], parallel=False)) == 3
    runs = _scale_runs()
    summaries = with_speedups({name: summarize_layout(runs[name], gpus=gpus, samples_per_step=64)
                               for name, gpus in (("1gpu", 1), ("2gpu-zero2", 2))})
    out = plot_scaling(summaries, tmp_path / "scale.png", "grpo-gpu-scale, strong scaling")
    assert out == tmp_path / "scale.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_scaling({}, tmp_path / "none.png", "nothing ran") is None and not (tmp_path / "none.png").exists()


def test_profiled_kernels_are_grouped_by_kind():
    """A profile's GPU time by kernel kind, shares of the kernels' total, and the span's idle time."""
    from benchmarks.sidecommon import kernel_kinds

    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 4.0),
               ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 1.0),
               ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>", 1.5),
               ("_rms_norm_forward_kernel", 0.25), ("_swiglu_forward_kernel", 0.25),
               ("ncclDevKernel_AllGather_RING_LL", 0.5), ("void at::native::reduce_kernel<512, 1>", 0.5),
               ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>", 2.0)]
    out = kernel_kinds(kernels, wall_s=12.0)
    assert out["kinds_s"] == {"matmul": 4.0, "optimizer": 2.0, "copy/cast": 1.5, "attention": 1.0,
                              "collective": 0.5, "reduction/softmax": 0.75, "triton": 0.25}
    assert out["kernel_s"] == 10.0 and out["idle_s"] == 2.0 and out["kinds_share"]["matmul"] == 0.4


def test_random_models_find_the_tokenizer_through_its_variable(tmp_path):
    """$TOKENIZER reaches the builder of the random models that benchmarks/run.py and scale.py run under
    --workdir (it once looked only in .gpubundle/ and stopped the run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "from benchmarks.models import DEFAULT_TOKENIZER; print(DEFAULT_TOKENIZER)"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "TOKENIZER": str(tmp_path / "qwen2")})
    assert run.stdout.strip() == str(tmp_path / "qwen2")


def test_engine_sweep_variants_name_their_engine_count_and_overrides():
    """`NAME[@K][:key=v,...]`: K engines (1 unless given) and the variant's overrides; a count that is
    not a whole number >= 1 is refused in one line."""
    import argparse

    from benchmarks.engine_sweep import _variant, table

    assert _variant("base") == ("base", 1, [])
    assert _variant("two@2:generation.max_num_seqs=256,generation.enforce_eager=true") == (
        "two@2", 2, ["generation.max_num_seqs=256", "generation.enforce_eager=true"])
    for bad in ("x@0", "x@", "x@two"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1"):
            _variant(bad)
    rows = [{"variant": "one", "engines": 1, "startup_s": 4.2, "median_tok_s": 2000.0,
             "calls": [{"tok_s": 1500.0}, {"tok_s": 2000.0}]},
            {"variant": "two@2", "engines": 2, "startup_s": 15.0, "median_tok_s": 3000.0,
             "calls": [{"tok_s": 1000.0}, {"tok_s": 3000.0}]}]
    assert table(rows).splitlines()[-1] == "| two@2 | 2 | 15 | 3,000 | 1.50 | 1.0k, 3.0k |"


def test_loop_overhead_times_every_function_between_the_loops_phases(capsys):
    """benchmarks/loop_overhead.py at a tiny shape: one line per function the loop calls between its
    timed phases, then their total; the stand-in rollouts have the shape asked for. Bad sizes are
    refused in one line."""
    from benchmarks.loop_overhead import main, stand_in_rollouts

    r = stand_in_rollouts(3, 2, 5)
    assert len(r.completions) == 6 and {len(c.token_ids) for c in r.completions} == {5} and r.rewards.shape == (6,)
    assert main(["--prompts", "3", "--group", "2", "--tokens", "5", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "3 prompts x 2 x 5 tokens, median of 1 (ms):"
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["learning_signal", "SignalWatch.check", "grpo_advantages", "rollouts_to_batch",
                     "filter_overlong", "step_metrics", "total"]
    values = [float(line.split()[1]) for line in lines[1:]]
    assert all(v >= 0 for v in values) and values[-1] == pytest.approx(sum(values[:-1]), abs=0.02)
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_a_failed_scale_layout_prints_why(monkeypatch, tmp_path, capsys):
    """A layout that fails prints the tail of its error as it ends (as benchmarks/run.py's sides do)."""
    from benchmarks import scale

    w = WORKLOADS["grpo-gpu-scale"].tiny()
    monkeypatch.setattr(scale, "run_ours", lambda *a: {"ok": False, "metrics": [], "wall_s": 3.0, "log": str(tmp_path / "log"),
                                                       "error": "Traceback\nValueError: boom"})
    monkeypatch.setattr(scale, "run_cluster", lambda side_dir, log: "")
    run = scale.run_layout(w, "1gpu", tmp_path / "1gpu", {}, model_path=None, prompt_tokens=[10] * w.steps,
                           timeout=60.0, layout_keys=[])
    out = capsys.readouterr().out
    assert not run["ok"] and "[scale] 1gpu: FAILED in 3 s" in out and "[scale] 1gpu | ValueError: boom" in out


def test_the_long_tail_workload_runs_our_three_rollout_modes_on_the_same_lengths():
    """grpo-gpu-long: ours in batch, stream and partial rollouts, each config valid, only the rollout
    keys apart, every side forcing the same long-tailed lengths."""
    from pathlib import Path

    from benchmarks.run import sides_of
    from benchmarks.workloads import WORKLOADS, side_plan
    from rlhf.config import load_config

    root, w = Path(__file__).resolve().parents[2], WORKLOADS["grpo-gpu-long"]
    assert sides_of(w, None) == ["ours", "ours-stream", "ours-partial", "trl-vllm"]
    plans = {side: side_plan(w, side, "out", "model")[1] for side in sides_of(w, None)[:3]}
    cfgs = {side: load_config(root / w.recipe, o) for side, o in plans.items()}
    assert {c.grpo.rollouts for c in cfgs.values()} == {"batch", "stream", "partial"}
    assert all(c.generation.forced_lengths == "long_tail" and c.generation.max_new_tokens == 16384
               for c in cfgs.values())
    assert cfgs["ours-partial"].grpo.max_staleness == 2
    for side in ("ours-stream", "ours-partial"):
        assert plans[side][:len(plans["ours"])] == plans["ours"]
    tiny = w.tiny()
    assert load_config(root / tiny.recipe, side_plan(tiny, "ours-partial", "out", "m")[1]).generation.max_new_tokens == 16


def test_trl_gets_our_forced_length_for_every_completion():
    """benchmarks/trl_grpo.force_lengths: TRL's colocated vLLM call (one prompt copy per completion)
    samples completion i of the run with our limit for sample i % G of group i // G, across calls."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from benchmarks.trl_grpo import force_lengths
    from rlhf.config import load_config
    from rlhf.data.lengths import forced_lengths

    cfg = load_config(None, ["generation.forced_lengths=long_tail", "generation.max_new_tokens=4096",
                             "grpo.group_size=4", "seed=3"])
    seen = []

    class FakeLLM:
        def generate(self, prompts, sampling_params=None, **kwargs):
            seen.extend(p.max_tokens for p in sampling_params)
            return ["out"] * len(prompts)

    llm = FakeLLM()
    force_lengths(llm, cfg)
    base = SamplingParams(max_tokens=4096, temperature=1.0)
    assert llm.generate([[1]] * 8, sampling_params=base, use_tqdm=False) == ["out"] * 8
    llm.generate([[1]] * 4, sampling_params=base)
    assert seen == [n for g in range(3) for n in forced_lengths("long_tail", 4096, 3, g, 4)]
    assert base.max_tokens == 4096 and len(set(seen)) > 1
