"""One GRPO learner step of grpo-gpu's shape under each of the learner's kernel switches, on a GPU.

    python3 benchmarks/learner_kernels.py --out results.jsonl                  # every variant, in turn
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/learner_kernels.py --only liger  # one (a host's GPUs in parallel)

A random-weight Qwen2.5-1.5B (built once under --models), 64 prompts x 8 completions of 512 tokens
after prompts of 60-130 tokens (grpo-gpu's step), bf16 under FSDP2 on one rank: our `LearnerRank` in
this process, as the actor runs it. Each variant runs in its own process (Liger patches transformers'
module globals), takes `--steps` train steps and reports the median of all but the first (which pays
compilation), `perf/mfu`, and the learner's peak memory; one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BASE = {"micro_batch_size": 16, "lr": 1e-6}
VARIANTS: dict[str, dict] = {
    "mask": {"padding_mask": True},  # the learner before the kernel switches
    "nomask": {},
    "nomask-mb32": {"micro_batch_size": 32},
    "liger": {"liger": True},
    "liger-cast": {"liger": True, "cast_once_per_step": True},
    "compile-cast": {"compile": True, "cast_once_per_step": True},
    "varlen-liger-cast": {"pack_sequences": True, "attention": "varlen", "max_tokens_per_micro_batch": 16384,
                          "liger": True, "cast_once_per_step": True},
    "varlen-liger-cast-32k": {"pack_sequences": True, "attention": "varlen", "max_tokens_per_micro_batch": 32768,
                              "liger": True, "cast_once_per_step": True},
    "varlen-liger-cast-head": {"pack_sequences": True, "attention": "varlen", "max_tokens_per_micro_batch": 16384,
                               "liger": True, "cast_once_per_step": True, "head_kernels": "fused"},
    "varlen-compile-cast-head": {"pack_sequences": True, "attention": "varlen", "max_tokens_per_micro_batch": 16384,
                                 "compile": True, "cast_once_per_step": True, "head_kernels": "fused"},
}


def build_model(folder: Path) -> Path:
    """Qwen2.5-1.5B's configuration with random weights, saved once."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (folder / "config.json").exists():
        return folder
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1e6, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def make_batch(seed: int = 0):
    import torch

    from rlhf.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(60, 131, (64,), generator=g).repeat_interleave(8)
    lengths = prompts + 512
    t = int(lengths.max())
    ids = torch.randint(3, 150000, (len(lengths), t), generator=g)
    attn = torch.arange(t)[None, :] < lengths[:, None]
    ids[~attn] = 0
    loss_mask = attn & (torch.arange(t)[None, :] >= prompts[:, None])
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask,
                      advantages=torch.randn(len(lengths), generator=g))


def run_variant(name: str, model: Path, steps: int, profile: str | None = None, extra: dict | None = None) -> dict:
    import torch.distributed as dist

    from actors.device import gpu_identity
    from actors.learner_base import LearnerRank
    from rlhf.algo.objectives import GRPOObjective
    from rlhf.config import LearnerConfig, ModelConfig

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, use_libuv=True)
    learner = LearnerRank(rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port,
                          model_path=str(model), model_cfg=ModelConfig(dtype="bfloat16"),
                          learner_cfg=LearnerConfig(**(BASE | VARIANTS[name] | (extra or {}))), temperature=1.0,
                          with_reference=False, seed=0, driver_store=True)
    batch, seconds, records = make_batch(), [], []
    for step in range(steps):
        profiler = None
        if profile and step == steps - 1 and steps > 1:  # the last step, compiled and warm
            from benchmarks.sidecommon import Profiler

            profiler = Profiler(Path(profile) / f"learner-{name}.json")
            profiler.start()
        start = time.perf_counter()
        metrics = learner.train_step(batch, GRPOObjective())
        seconds.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.stop()
        records.append({"s": round(seconds[-1], 3), "mfu": round(metrics.values.get("perf/mfu", 0.0), 4),
                        "peak_gib": round(metrics.values["memory/learner_peak_gib"], 2),
                        "loss": metrics.loss, "grad_norm": metrics.grad_norm})
    learner.shutdown()
    steady = seconds[1:] or seconds
    return {"variant": name, "keys": VARIANTS[name] | (extra or {}), "median_s": round(statistics.median(steady), 3),
            "mfu": statistics.median(r["mfu"] for r in records[1:] or records),
            "peak_gib": max(r["peak_gib"] for r in records), "tokens": int(batch.attention_mask.sum()),
            "gpu": (gpu_identity() or ("cpu", 0.0))[0], "steps": records}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=sorted(VARIANTS), help="variants to run (default: all)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--out", default="benchmarks/results/learner-kernels.jsonl")
    p.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    p.add_argument("--profile", metavar="DIR", help="profile each variant's last step: DIR/learner-<variant>.{json,txt,"
                   "kernels.json} (the trace, the top ops, the GPU's time by kernel kind)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a learner key on top of every variant run, e.g. --set max_tokens_per_micro_batch=24576")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's one variant
    args = p.parse_args()
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    model = build_model(Path(args.models) / "qwen2.5-1.5b-random")
    if args.variant:
        print(json.dumps(run_variant(args.variant, model, args.steps, args.profile, extra)), flush=True)
        return
    for name in args.only or list(VARIANTS):
        cmd = [sys.executable, __file__, "--variant", name, "--steps", str(args.steps), "--models", args.models,
               *(["--profile", args.profile] if args.profile else []), *(f"--set={item}" for item in args.set)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ | {"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "variant": name, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        except subprocess.TimeoutExpired:
            row = {"variant": name, "error": f"timed out after {args.timeout:.0f} s"}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name:24s} " + (f"{row['median_s']:7.2f} s  mfu {row['mfu']:.3f}  peak {row['peak_gib']:.1f} GiB"
                                if "error" not in row else f"error: {row['error']}"), flush=True)


if __name__ == "__main__":
    main()
