"""Reward-model throughput: samples scored per second on the device at hand, the served path (the
reward worker's: bf16 on a GPU share, token-budget batches, with and without host offload) against
the CPU path (fp32, `batch_size` rows), on the same samples; and the stand-in reward model the
1-GPU recipe and the GPU test score with.

    python3 benchmarks/reward_model.py --build outputs/reward_models/smollm2-135m   # the stand-in RM
    python3 benchmarks/reward_model.py --model outputs/reward_models/smollm2-135m --samples 1024
    python3 benchmarks/reward_model.py --model tiny --samples 64 --cpu-samples 64     # CPU smoke run

The stand-in is SmolLM2-135M-Instruct's decoder with a fresh one-output score head (seeded): real
weights, shape and cost of a small reward model, meaningless scores (no hub here to fetch a trained
one). Samples: the arithmetic task's prompts with random responses of `--response-tokens` tokens.
Prints one line per path (samples/s, seconds, the device's peak memory) and the largest score gap
between the paths (bf16 against fp32); `--out` appends them as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_stand_in(out: Path, source: str = "smollm2-135m-instruct", seed: int = 0) -> Path:
    """A sequence classifier with one output from the causal LM `source` (its decoder, a fresh head)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.data.assets import resolve_model_path

    path = resolve_model_path(source)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def samples(n: int, response_tokens: int, tokenizer, seed: int = 0):
    """`n` (row, response) pairs: arithmetic prompts, responses of about `response_tokens` random words."""
    from rlhf.types import PromptRow

    rng = random.Random(seed)
    # sorted: a fast tokenizer's vocabulary comes back in a different order in every process
    words = [w for w in sorted(tokenizer.get_vocab()) if w.isalpha() and 2 < len(w) < 8][:2000]
    words = words or ["number"]
    rows = [PromptRow(prompt=f"Calculate {rng.randint(1, 99)} + {rng.randint(1, 99)}.", answer="0")
            for _ in range(n)]
    responses = [" ".join(rng.choice(words) for _ in range(rng.randint(response_tokens // 2, response_tokens)))
                 for _ in range(n)]
    return rows, responses


def timed(rm, rows, responses, device) -> tuple[list[float], float, float]:
    """Scores, seconds (after one warm-up batch) and the device's peak memory (GiB) of one `score`."""
    rm.score(rows[:4], responses[:4])
    device.synchronize()
    device.reset_peak()
    start = time.perf_counter()
    scores = rm.score(rows, responses)
    device.synchronize()
    return scores, time.perf_counter() - start, device.peak_memory_gib()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", type=Path, help="write the stand-in reward model here and exit")
    p.add_argument("--model", default="outputs/reward_models/smollm2-135m",
                   help="reward model folder ('tiny': a tiny random one, built in a temporary folder)")
    p.add_argument("--samples", type=int, default=1024, help="samples scored on the served path")
    p.add_argument("--cpu-samples", type=int, default=128, help="samples scored on the CPU path (slower)")
    p.add_argument("--response-tokens", type=int, default=192)
    p.add_argument("--max-tokens-per-batch", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch of the CPU path")
    p.add_argument("--out", type=Path, help="append the results as JSON lines")
    args = p.parse_args(argv)
    if args.build:
        print(f"stand-in reward model: {build_stand_in(args.build)}")
        return 0

    import tempfile

    import torch

    from actors.device import CpuDevice, detect
    from rlhf.reward_model import RewardModel

    model = args.model
    if model == "tiny":
        from rlhf.data.tiny_models import build_tiny_reward_model

        model = str(build_tiny_reward_model(tempfile.mkdtemp(prefix="rm-bench-")))
    device = detect()
    on_gpu = device.kind != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    cpu = RewardModel(model, batch_size=args.batch_size)
    rows, responses = samples(max(args.samples, args.cpu_samples), args.response_tokens, cpu.tokenizer)
    results = []
    cpu_scores, seconds, _ = timed(cpu, rows[:args.cpu_samples], responses[:args.cpu_samples], CpuDevice())
    results.append(dict(path="cpu fp32", samples=args.cpu_samples, seconds=seconds, peak_gib=None))
    del cpu
    for offload in (False, True) if on_gpu else (False,):
        served = RewardModel(model, max_tokens_per_batch=args.max_tokens_per_batch, device=device.torch_device(0),
                             dtype=dtype, offload=offload)
        scores, seconds, peak = timed(served, rows[:args.samples], responses[:args.samples], device)
        gap = max(abs(a - b) for a, b in zip(scores, cpu_scores))
        results.append(dict(path=f"{device.kind} {str(dtype).removeprefix('torch.')}"
                                 + (" offloaded" if offload else " resident"),
                            samples=args.samples, seconds=seconds, peak_gib=peak if on_gpu else None,
                            max_abs_gap_vs_cpu=gap))
        del served
        device.empty_cache()
    for r in results:
        r.update(model=model, response_tokens=args.response_tokens, samples_per_s=r["samples"] / r["seconds"],
                 max_tokens_per_batch=args.max_tokens_per_batch)
        peak = f", peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else ""
        gap = f", max |score - cpu| {r['max_abs_gap_vs_cpu']:.3g}" if "max_abs_gap_vs_cpu" in r else ""
        print(f"{r['path']:<24} {r['samples_per_s']:10.1f} samples/s ({r['samples']} in {r['seconds']:.2f} s{peak}{gap})")
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
