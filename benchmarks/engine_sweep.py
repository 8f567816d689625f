"""vLLM engine settings, measured: our VLLMGenerator alone on one GRPO step's batch, one engine per variant.

    python benchmarks/engine_sweep.py --workload grpo-gpu-scale --model outputs/bench/models/random-qwen2.5-1.5b \
        --calls 4 --variant base --variant per-prompt-seeds:generation.per_prompt_seeds=true \
        --variant no-prefix-cache:generation.enable_prefix_caching=false --variant two-engines@2 ... [key=value ...]

Every variant is the recipe (`--recipe`, or the workload's recipe and overrides, with `--model` as its
model) plus the shared `key=value` overrides plus its own (`name[@K]:key=v,key=v`),
built fresh (the previous engine shut down first), then asked `--calls` times for the same step-0
batch with a new seed per call, as the loop does. The first call pays the warm-up and is reported
apart. Per call: tokens/s and what Python's garbage collector did during it (to tell host-side
slowdowns from the GPU's). One JSON line per variant goes to `--results`.

`NAME@K` runs K engines on the same device, each in a process of its own with 1/K of the memory
share and its `rlhf.data.batching.even_shards` share of the prompts (whole groups), started one
after the other (vLLM sizes its KV cache from the memory it finds free) and released together for
each call; a call's time is the slowest engine's. It asks whether a decode bound by one host
thread goes faster when two host threads feed the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

WAIT_S = 1800.0  # bound on an engine process's start-up or one call


def _variant(text: str) -> tuple[str, int, list[str]]:
    """`NAME[@K][:key=v,...]` -> (NAME[@K], K engines, overrides)."""
    head, _, sets = text.partition(":")
    _, at, count = head.partition("@")
    if at and not (count.isdigit() and int(count) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: the engine count after @ must be a whole number >= 1")
    return head, int(count) if at else 1, [s for s in sets.split(",") if s]


def _gc_counts() -> list[int]:
    return [s["collections"] for s in gc.get_stats()]


def _spec(cfg: Any, call: int, ignore_eos: bool) -> Any:
    """The SamplingSpec of call `call`: the recipe's sampling with a new seed per call, as the loop does."""
    from rlhf.types import SamplingSpec

    g = cfg.generation
    return SamplingSpec(n=cfg.grpo.group_size, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                        top_p=g.top_p, top_k=g.top_k, seed=cfg.seed * 1_000_003 + call, ignore_eos=ignore_eos)


def _generator(cfg: Any, engines: int = 1) -> Any:
    """A fresh VLLMGenerator for `cfg` holding 1/`engines` of its memory share, no sleep mode."""
    from actors.vllm_generator import VLLMGenerator
    from rlhf.data.assets import resolve_model_path
    from rlhf.rules import engine_generation

    g = engine_generation(cfg.generation, engines)
    return VLLMGenerator(resolve_model_path(cfg.model.path), g, dtype=cfg.model.dtype, seed=cfg.seed,
                         enable_sleep=False)


def in_process(cfg: Any, name: str, prompts: list[list[int]], calls: int, ignore_eos: bool
               ) -> tuple[float, list[dict[str, Any]]]:
    """One engine in this process: (start-up s, one record per call)."""
    from actors.device import detect

    t0 = time.perf_counter()
    gen = _generator(cfg)
    startup, out_calls = time.perf_counter() - t0, []
    try:
        for call in range(calls):
            before, t = _gc_counts(), time.perf_counter()
            out = gen.generate(prompts, _spec(cfg, call, ignore_eos))
            seconds = time.perf_counter() - t
            tokens = sum(len(c.token_ids) for c in out)
            collections = [b - a for a, b in zip(before, _gc_counts())]
            out_calls.append({"s": seconds, "tokens": tokens, "tok_s": tokens / seconds, "gc": collections})
            print(f"[sweep] {name} call {call}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s "
                  f"(gc collections by generation {collections})", flush=True)
            del out
    finally:
        gen.shutdown()
        detect().empty_cache()
    return startup, out_calls


def _engine_process(index: int, engines: int, recipe: str, overrides: list[str], prompts: list[list[int]],
                    calls: int, ignore_eos: bool, ready: Any, go: Any, results: Any) -> None:
    """One of `engines` engine processes: start, say so, then one generate per release of `go`."""
    from benchmarks.sidecommon import load_run_config

    cfg = load_run_config(recipe, overrides)
    gen = _generator(cfg, engines)
    ready.put(index)
    try:
        for call in range(calls):
            go.wait(WAIT_S)
            t = time.perf_counter()
            out = gen.generate(prompts, _spec(cfg, call, ignore_eos))
            results.put((index, time.perf_counter() - t, sum(len(c.token_ids) for c in out)))
    finally:
        gen.shutdown()


def _take(queue: Any, procs: list[Any]) -> Any:
    """The next item of `queue`; a RuntimeError naming the engine process that died instead."""
    import queue as queue_mod

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"engine process {dead[0][0]} exited with {dead[0][1]}") from None
    raise TimeoutError(f"no engine process answered in {WAIT_S:.0f} s")


def in_processes(recipe: str, overrides: list[str], name: str, engines: int, prompts: list[list[int]],
                 calls: int, ignore_eos: bool) -> tuple[float, list[dict[str, Any]]]:
    """`engines` engines sharing the device, one process each (the module docstring's `NAME@K`):
    (start-up s of all of them, one record per call, timed from their common release)."""
    import multiprocessing as mp

    from rlhf.data.batching import even_shards

    ctx = mp.get_context("spawn")  # a CUDA context does not survive fork
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Barrier(engines + 1)
    procs: list[Any] = []
    t0 = time.perf_counter()
    try:
        for index, shard in enumerate(even_shards(len(prompts), engines)):
            procs.append(ctx.Process(target=_engine_process, args=(
                index, engines, recipe, overrides, [prompts[i] for i in shard], calls, ignore_eos, ready, go,
                results)))
            procs[-1].start()
            _take(ready, procs)  # one at a time: vLLM sizes its KV cache from the memory it finds free
        startup, out_calls = time.perf_counter() - t0, []
        for call in range(calls):
            go.wait(WAIT_S)
            t = time.perf_counter()
            answers = sorted(_take(results, procs) for _ in range(engines))
            seconds, tokens = time.perf_counter() - t, sum(a[2] for a in answers)
            out_calls.append({"s": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                              "engine_s": [round(a[1], 3) for a in answers]})
            print(f"[sweep] {name} call {call}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s "
                  f"(engines {', '.join(f'{a[1]:.2f}' for a in answers)} s)", flush=True)
        for p in procs:
            p.join(WAIT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return startup, out_calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="our YAML recipe (or --workload)")
    p.add_argument("--workload", help="a benchmarks/workloads.py workload: its recipe and overrides")
    p.add_argument("--model", help="with --workload: the model folder to use (e.g. a prebuilt random model)")
    p.add_argument("--variant", action="append", type=_variant, required=True, metavar="NAME[@K][:KEY=V,...]")
    p.add_argument("--calls", type=int, default=4, help="generate calls per variant, the first one warm-up")
    p.add_argument("--ignore-eos", action="store_true", help="fixed-length completions (random weights)")
    p.add_argument("--results", default="benchmarks/results/engine-sweep.jsonl")
    p.add_argument("overrides", nargs="*", help="key=value overrides shared by every variant")
    args = p.parse_args(argv)
    if bool(args.recipe) == bool(args.workload):
        p.error("give one of --recipe and --workload")

    from transformers import AutoTokenizer

    from actors.device import gpu_identity
    from actors.vllm_generator import engine_settings
    from benchmarks.sidecommon import load_run_config
    from benchmarks.workloads import grpo_step_prompts
    from rlhf.data.assets import resolve_model_path

    recipe, shared = args.recipe, list(args.overrides)
    if args.workload:
        from benchmarks.workloads import WORKLOADS, our_overrides

        w = WORKLOADS[args.workload]
        recipe = w.recipe
        shared = [*our_overrides(w, output_dir="outputs/bench/engine-sweep", model_path=args.model), *shared]
        args.ignore_eos = args.ignore_eos or w.ignore_eos
    rows = []
    for name, engines, sets in args.variant:
        cfg = load_run_config(recipe, [*shared, *sets])
        model_path = resolve_model_path(cfg.model.path)
        prompts = [ids for _, ids in grpo_step_prompts(cfg, AutoTokenizer.from_pretrained(model_path))[0]]
        startup, calls = (in_process(cfg, name, prompts, args.calls, args.ignore_eos) if engines == 1 else
                          in_processes(recipe, [*shared, *sets], name, engines, prompts, args.calls, args.ignore_eos))
        timed = [c["tok_s"] for c in calls[1:]] or [calls[0]["tok_s"]]
        row = {"variant": name, "engines": engines, "sets": sets, "overrides": args.overrides, "startup_s": startup,
               "median_tok_s": statistics.median(timed), "calls": calls,
               "settings": engine_settings(model_path, cfg.generation, on_cpu=False),
               "device": (gpu_identity() or ("cpu",))[0],
               "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
        rows.append(row)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """The variants side by side, each against the first one."""
    base = rows[0]["median_tok_s"]
    lines = [f"\n| variant | engines | startup s | tokens/s, calls 2..N (median) | vs {rows[0]['variant']} | per call |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        per_call = ", ".join(f"{c['tok_s'] / 1000:.1f}k" for c in r["calls"])
        lines.append(f"| {r['variant']} | {r.get('engines', 1)} | {r['startup_s']:.0f} | {r['median_tok_s']:,.0f} "
                     f"| {r['median_tok_s'] / base:.2f} | {per_call} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
