"""Our VLLMGenerator alone, on the batch of step 0: the ceiling for in-loop generation speed.

    python benchmarks/gen_standalone.py --recipe <recipe> --out side.json [--ignore-eos] [--repeats 3] key=value ...

The same RunConfig, prompts and sampling as step 0 of our run (`rlhf.rollouts.sampling_spec`
builds the same SamplingSpec), the same generation config (memory share, eager mode, dtype), but
in this process with nothing else on the device: no Ray, no learner, no sleep mode. The first
call is step 0 (it pays the engine's warm-up and is left out of the medians); each repeat is one
more "step" record with generate_s and gen_tokens. `generation tokens/s` of our run divided by
this one is the loop's generation efficiency.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.sidecommon import T0, load_run_config, run_side, side_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = side_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls after the first (%(default)s)")
    args = p.parse_args(argv)
    return run_side("ours-gen", args.out, lambda record: generate(args, record))


def generate(args: Any, record: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer

    from actors.vllm_generator import VLLMGenerator
    from benchmarks.workloads import grpo_step_prompts
    from rlhf.data.assets import resolve_model_path
    from rlhf.types import SamplingSpec

    cfg = load_run_config(args.recipe, args.overrides)
    model_path = resolve_model_path(cfg.model.path)
    prompts = [ids for _, ids in grpo_step_prompts(cfg, AutoTokenizer.from_pretrained(model_path))[0]]
    record["torch_threads"] = torch.get_num_threads()
    gen = VLLMGenerator(model_path, cfg.generation, dtype=cfg.model.dtype, seed=cfg.seed, enable_sleep=False)
    record["startup_s"] = time.time() - T0
    g = cfg.generation
    try:
        for step in range(args.repeats + 1):
            sampling = SamplingSpec(n=cfg.grpo.group_size, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                    top_p=g.top_p, top_k=g.top_k, seed=cfg.seed * 1_000_003 + step,
                                    ignore_eos=args.ignore_eos)
            t = time.perf_counter()
            completions = gen.generate(prompts, sampling)
            seconds = time.perf_counter() - t
            tokens = float(sum(len(c.token_ids) for c in completions))
            record["steps"].append({"step": step, "step_s": seconds, "generate_s": seconds, "gen_tokens": tokens,
                                    "response_len_mean": tokens / len(completions)})
            print(f"[ours-gen] call {step}: {tokens:.0f} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s",
                  flush=True)
    finally:
        gen.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
