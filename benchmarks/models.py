"""Random-weight models with real shapes, for speed runs on machines without a model hub.

    python benchmarks/models.py random:qwen2.5-1.5b [--out outputs/bench/models] [--tokenizer PATH]

`random:qwen2.5-1.5b` is Qwen2.5-1.5B's architecture (28 layers, hidden 1536, GQA 12/2 heads,
vocab 151,936, tied embeddings) with seeded random bf16 weights, next to the Qwen2 tokenizer
(the folder or .tar.xz given by --tokenizer; default: $TOKENIZER, which tests/gpu/install.sh sets
to the staged copy, else the asset cache's, `python -m scripts.assets fetch qwen2-tokenizer`;
benchmarks/run.py and scale.py build under --workdir with it). The
vocabulary must be the real one: random weights sample any of the 151,936 ids, and every sampled id
has to decode. Built once, reused (a stamp file).
`random:qwen2.5-0.5b` and `random:qwen2.5-7b` are the same for Qwen2.5-0.5B (24 layers, hidden
896, 14/2 heads, tied) and Qwen2.5-7B (28 layers, hidden 3584, 28/4 heads, untied, vocab 152,064);
the memory planner reads their shapes from the config.json written here, the same numbers as its
KNOWN_SHAPES for the hub ids (tests/unit/test_plan_check.py checks both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlhf.data.assets import cache_dir  # noqa: E402

DEFAULT_TOKENIZER = Path(os.environ.get("TOKENIZER") or cache_dir() / "tokenizers" / "qwen2")

SHAPES = {
    "random:qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                                rope_theta=1e6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "random:qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
                                rope_theta=1e6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    # 152,064 rows, 128 more than the tokenizer's 151,936 ids: a sampled id above them decodes to
    # nothing (no error), which the speed and memory runs do not mind.
    "random:qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                              intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                              rope_theta=1e6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
}


def build_random_model(name: str, out_root: str | Path, *, tokenizer: str | Path = DEFAULT_TOKENIZER, seed: int = 0
                       ) -> Path:
    """Write `name` (a key of SHAPES) under `out_root` and return the folder; reuse a finished one."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(SHAPES)})")
    out = Path(out_root) / name.replace(":", "-")
    stamp = out / "bench_model.json"
    want = {"name": name, "seed": seed, "shape": SHAPES[name]}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return out
    tokenizer = Path(tokenizer)
    if not tokenizer.exists():
        raise FileNotFoundError(f"{name} needs the Qwen2 tokenizer: pass --tokenizer (a folder with tokenizer.json, "
                                f"or a .tar.xz of one) or `python -m scripts.assets fetch qwen2-tokenizer`; "
                                f"{tokenizer} does not exist")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if tokenizer.is_dir():
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "vocab", "merges", "special_tokens")):
                shutil.copy(f, out / f.name)
    else:
        with tarfile.open(tokenizer) as t:
            t.extractall(out, filter="data")
    torch.manual_seed(seed)
    # Built where it is fastest. On a GPU the 7B shape's 7.6B bf16 parameters are allocated and
    # randomly initialised in seconds; what costs is save_pretrained copying 15.2 GB to the host and
    # writing it (expected 30-90 s with start-up, not measured on a GPU yet). On CPU the init is
    # the cost: the 0.5B shape took 32 s end to end on the project's 2-core VM, the 7B one would
    # take many minutes, so build it on a GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[name]), dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    stamp.write_text(json.dumps(want))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument("--out", default=str(REPO / "outputs" / "bench" / "models"))
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    args = p.parse_args(argv)
    print(build_random_model(args.name, args.out, tokenizer=args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
