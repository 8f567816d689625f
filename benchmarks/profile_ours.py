"""torch.profiler traces of our system's two hot paths, built in-process from the workload's config.

    python benchmarks/profile_ours.py --recipe <recipe> --out side.json --trace-dir DIR key=value ...
    (usually through: benchmarks/run.py --workload grpo-cpu --profile)

In the real run the generator and the learner live in Ray actors; tracing inside them would
need the profiler in actor code. Instead this builds the same pieces the actors hold, as the
tests do (VLLMGenerator, LearnerRank (FSDP2) with world_size 1 over gloo), from the same RunConfig:
  GRPO  one generation step (vLLM, step 1's prompts x group_size) and one learner step
        (`train_step` on step 1's rollouts, scored and turned into a batch exactly as the loop does)
  DPO   one learner step (reference log-probs on the learner, then `train_step`)
Traces: DIR/ours_generate.json, DIR/ours_train_step.json (GRPO), DIR/ours_dpo_step.json (DPO).
Each traced call follows one untraced call of the same kind, so compilation, lazy init and the
optimizer's first state allocation are not in the trace. On CPU the thread counts match the
actors': benchmarks/run.py sets OMP_NUM_THREADS=1 (what Ray gives an actor with a fractional CPU
share: the generator's count) unless --threads is given, and the learner sizes its pool as in a
run (`Device.share_host_threads`). Traces are Chrome-trace JSON: open them in
https://ui.perfetto.dev; a `.txt` next to each holds the top ops by self time.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.sidecommon import Profiler, load_run_config, run_side, side_parser  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner(cfg: Any, model_path: str, *, with_reference: bool):
    from actors.learner_base import LearnerRank

    return LearnerRank(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(),
                        model_path=model_path, model_cfg=cfg.model, learner_cfg=cfg.learner,
                        temperature=cfg.generation.temperature or 1.0, with_reference=with_reference, seed=cfg.seed)


def _timed(record: dict[str, Any], key: str, fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    record.setdefault("seconds", {})[key] = time.perf_counter() - t
    return out


def profile_grpo(cfg: Any, model_path: str, tokenizer: Any, trace: str, record: dict[str, Any],
                 ignore_eos: bool) -> None:
    import torch

    from actors.vllm_generator import VLLMGenerator
    from benchmarks.workloads import grpo_step_prompts
    from rewards.api import combine
    from rlhf.algo.advantages import grpo_advantages
    from rlhf.algo.objectives import GRPOObjective
    from rlhf.data.batching import rollouts_to_batch
    from rlhf.scoring import decode_completions
    from rlhf.types import RolloutBatch, SamplingSpec

    steps = grpo_step_prompts(cfg, tokenizer)[:2]
    scorer = combine(cfg.reward.functions)
    gen, g = VLLMGenerator(model_path, cfg.generation, dtype=cfg.model.dtype, seed=cfg.seed, enable_sleep=False), \
        cfg.generation
    batches = []
    try:
        for k, step in enumerate(steps):
            rows, ids = [r for r, _ in step], [i for _, i in step]
            sampling = SamplingSpec(n=cfg.grpo.group_size, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                    top_p=g.top_p, top_k=g.top_k, seed=cfg.seed * 1_000_003 + k, ignore_eos=ignore_eos)
            prof = Profiler(f"{trace}/ours_generate.json") if k == 1 else None
            if prof:
                prof.start()
            completions = _timed(record, f"generate_{k}", gen.generate, ids, sampling)
            if prof:
                record["traces"].append(prof.stop())
            rollouts = RolloutBatch(rows=rows, prompt_ids=ids, completions=completions, group_size=cfg.grpo.group_size)
            group = cfg.grpo.group_size
            texts = decode_completions(tokenizer, [c.token_ids for c in completions])
            rollouts.rewards = torch.tensor([
                scorer(rows[i // group].user_text(), text, **rows[i // group].reward_kwargs())
                for i, text in enumerate(texts)], dtype=torch.float32)
            adv = grpo_advantages(rollouts.rewards, group, scale_by_std=cfg.grpo.scale_by_std)
            batches.append(rollouts_to_batch(rollouts, adv, tokenizer.pad_token_id))
    finally:
        gen.shutdown()
    learner = _learner(cfg, model_path, with_reference=cfg.grpo.kl_coef > 0)
    objective = GRPOObjective.from_config(cfg.grpo, max_len=g.max_new_tokens)
    try:
        for k, batch in enumerate(batches):
            prof = Profiler(f"{trace}/ours_train_step.json") if k == 1 else None
            if prof:
                prof.start()
            if cfg.grpo.kl_coef > 0:
                batch.ref_logprobs = learner.logprobs(batch, reference=True)
            metrics = _timed(record, f"train_step_{k}", learner.train_step, batch, objective)
            if prof:
                record["traces"].append(prof.stop())
            record["steps"].append({"step": k, "loss": metrics.loss, "tokens": int(batch.attention_mask.sum())})
    finally:
        learner.shutdown()


def profile_dpo(cfg: Any, model_path: str, tokenizer: Any, trace: str, record: dict[str, Any]) -> None:
    from rlhf.algo.objectives import DPOObjective
    from rlhf.data.batching import pairs_to_batch
    from rlhf.data.preferences import load_preference_data
    from rlhf.data.stream import PromptStream
    from rlhf.dpo import needs_reference_model

    data = load_preference_data(cfg, tokenizer)
    stream = PromptStream(data.train, seed=cfg.seed)
    learner = _learner(cfg, model_path, with_reference=needs_reference_model(cfg))
    objective = DPOObjective.from_config(cfg.dpo)
    try:
        for k in range(2):
            batch = pairs_to_batch(stream.take(cfg.dpo.pairs_per_step), tokenizer.pad_token_id)
            prof = Profiler(f"{trace}/ours_dpo_step.json") if k == 1 else None
            if prof:
                prof.start()
            t = time.perf_counter()
            lp = learner.logprobs(batch, reference=True)
            batch.ref_chosen_logps, batch.ref_rejected_logps = DPOObjective.sequence_logps(lp, batch)
            metrics = learner.train_step(batch, objective)
            record.setdefault("seconds", {})[f"dpo_step_{k}"] = time.perf_counter() - t
            if prof:
                record["traces"].append(prof.stop())
            record["steps"].append({"step": k, "loss": metrics.loss, "tokens": int(batch.attention_mask.sum())})
    finally:
        learner.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = side_parser(__doc__).parse_args(argv)
    return run_side("ours-profile", args.out, lambda record: profile(args, record))


def profile(args: Any, record: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer

    from rlhf.data.assets import resolve_model_path

    cfg = load_run_config(args.recipe, args.overrides)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    record["torch_threads"] = torch.get_num_threads()
    record["traces"] = []
    if cfg.algorithm == "grpo":
        profile_grpo(cfg, model_path, tokenizer, args.trace_dir, record, args.ignore_eos)
    else:
        profile_dpo(cfg, model_path, tokenizer, args.trace_dir, record)


def profile_sides(w: Any, sides: list[str], *, model_path: str | None, workdir: Path, env: dict[str, str]) -> int:
    """benchmarks/run.py --profile: our traces, and each TRL side's trace of its step 1 (a two-step
    run), all under benchmarks/results/traces/<workload>/."""
    import json
    from dataclasses import replace

    from benchmarks.run import REPO, launch
    from benchmarks.workloads import our_overrides

    w = replace(w, steps=2)
    trace_dir = REPO / "benchmarks" / "results" / "traces" / w.name
    status = 0
    for side in sides:
        if side == "ours-gen":
            continue
        side_dir = workdir / w.name / f"profile-{side}"
        overrides = our_overrides(w, output_dir=str(side_dir / "run"), model_path=model_path)
        out = side_dir / "side.json"
        common = ["--recipe", w.recipe, "--out", str(out), "--trace-dir", str(trace_dir),
                  *(["--ignore-eos"] if w.ignore_eos else [])]
        if side == "ours":
            cmd = [sys.executable, "benchmarks/profile_ours.py", *common, *overrides]
            side_env = env if "OMP_NUM_THREADS" in env or w.device == "cuda" else {**env, "OMP_NUM_THREADS": "1"}
        else:
            script = "benchmarks/trl_grpo.py" if w.algorithm == "grpo" else "benchmarks/trl_dpo.py"
            gen = ["--generation", "vllm" if side == "trl-vllm" else "hf"] if w.algorithm == "grpo" else []
            cmd = [sys.executable, script, *common, *gen, "--profile-step", "1", *overrides]
            side_env = env
        print(f"[profile] {side}: running (log: {side_dir / 'log.txt'})", flush=True)
        launch(cmd, env=side_env, log=side_dir / "log.txt", metrics=None, timeout=3600)
        record = json.loads(out.read_text()) if out.is_file() else {"ok": False, "error": "no record written"}
        traces = record.get("traces") or ([record["trace"]] if record.get("trace") else [])
        if not record.get("ok"):
            status = 1
            print(f"[profile] {side}: FAILED: {(record.get('error') or '').splitlines()[-1:]}")
        for t in traces:
            print(f"[profile] {side}: {t} (top ops: {Path(t).with_suffix('.txt')})")
        if record.get("seconds"):
            print(f"[profile] {side}: seconds {json.dumps({k: round(v, 2) for k, v in record['seconds'].items()})}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
