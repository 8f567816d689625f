"""vLLM engine settings, measured: our VLLMGenerator alone on one GRPO step's batch, one engine per variant.

    python benchmarks/engine_sweep.py --workload grpo-gpu-scale --model outputs/bench/models/random-qwen2.5-1.5b \
        --calls 4 --variant base --variant per-prompt-seeds:generation.per_prompt_seeds=true \
        --variant no-prefix-cache:generation.enable_prefix_caching=false ... [key=value ...]

Every variant is the recipe (`--recipe`, or the workload's recipe and overrides, with `--model` as its
model) plus the shared `key=value` overrides plus its own (`name:key=v,key=v`),
built fresh in this process (the previous engine shut down first), then asked `--calls` times for
the same step-0 batch with a new seed per call, as the loop does. The first call pays the warm-up
and is reported apart. Per call: tokens/s and what Python's garbage collector did during it (to
tell host-side slowdowns from the GPU's). One JSON line per variant goes to `--results`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    return name, [s for s in sets.split(",") if s]


def _gc_counts() -> list[int]:
    return [s["collections"] for s in gc.get_stats()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="our YAML recipe (or --workload)")
    p.add_argument("--workload", help="a benchmarks/workloads.py workload: its recipe and overrides")
    p.add_argument("--model", help="with --workload: the model folder to use (e.g. a prebuilt random model)")
    p.add_argument("--variant", action="append", type=_variant, required=True, metavar="NAME[:KEY=V,...]")
    p.add_argument("--calls", type=int, default=4, help="generate calls per variant, the first one warm-up")
    p.add_argument("--ignore-eos", action="store_true", help="fixed-length completions (random weights)")
    p.add_argument("--results", default="benchmarks/results/engine-sweep.jsonl")
    p.add_argument("overrides", nargs="*", help="key=value overrides shared by every variant")
    args = p.parse_args(argv)
    if bool(args.recipe) == bool(args.workload):
        p.error("give one of --recipe and --workload")

    from transformers import AutoTokenizer

    from actors.device import detect, gpu_identity
    from actors.vllm_generator import VLLMGenerator, engine_settings
    from benchmarks.sidecommon import load_run_config
    from benchmarks.workloads import grpo_step_prompts
    from rlhf.data.assets import resolve_model_path
    from rlhf.types import SamplingSpec

    recipe, shared = args.recipe, list(args.overrides)
    if args.workload:
        from benchmarks.workloads import WORKLOADS, our_overrides

        w = WORKLOADS[args.workload]
        recipe = w.recipe
        shared = [*our_overrides(w, output_dir="outputs/bench/engine-sweep", model_path=args.model), *shared]
        args.ignore_eos = args.ignore_eos or w.ignore_eos
    rows = []
    for name, sets in args.variant:
        cfg = load_run_config(recipe, [*shared, *sets])
        model_path = resolve_model_path(cfg.model.path)
        prompts = [ids for _, ids in grpo_step_prompts(cfg, AutoTokenizer.from_pretrained(model_path))[0]]
        g = cfg.generation
        t0 = time.perf_counter()
        gen = VLLMGenerator(model_path, g, dtype=cfg.model.dtype, seed=cfg.seed, enable_sleep=False)
        startup = time.perf_counter() - t0
        calls = []
        try:
            for call in range(args.calls):
                spec = SamplingSpec(n=cfg.grpo.group_size, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                    top_p=g.top_p, top_k=g.top_k, seed=cfg.seed * 1_000_003 + call,
                                    ignore_eos=args.ignore_eos)
                before, t = _gc_counts(), time.perf_counter()
                out = gen.generate(prompts, spec)
                seconds = time.perf_counter() - t
                tokens = sum(len(c.token_ids) for c in out)
                collections = [b - a for a, b in zip(before, _gc_counts())]
                calls.append({"s": seconds, "tokens": tokens, "tok_s": tokens / seconds, "gc": collections})
                print(f"[sweep] {name} call {call}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s "
                      f"(gc collections by generation {collections})", flush=True)
                del out
        finally:
            gen.shutdown()
            detect().empty_cache()
        timed = [c["tok_s"] for c in calls[1:]] or [calls[0]["tok_s"]]
        row = {"variant": name, "sets": sets, "overrides": args.overrides, "startup_s": startup,
               "median_tok_s": statistics.median(timed), "calls": calls,
               "settings": engine_settings(model_path, g, on_cpu=False),
               "device": (gpu_identity() or ("cpu",))[0],
               "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
        rows.append(row)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    base = rows[0]["median_tok_s"]
    print(f"\n| variant | startup s | tokens/s, calls 2..N (median) | vs {rows[0]['variant']} | per call |")
    print("|---|---|---|---|---|")
    for r in rows:
        per_call = ", ".join(f"{c['tok_s'] / 1000:.1f}k" for c in r["calls"])
        print(f"| {r['variant']} | {r['startup_s']:.0f} | {r['median_tok_s']:,.0f} | {r['median_tok_s'] / base:.2f} "
              f"| {per_call} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
