"""TRL 1.16 `DPOTrainer` on a benchmark workload: the TRL side of benchmarks/run.py for DPO.

    python benchmarks/trl_dpo.py --recipe configs/dpo_smollm2_cpu.yaml --out side.json key=value ...

Resolves the same RunConfig as our run, builds `DPOConfig` from it
(`benchmarks.workloads.trl_dpo_kwargs`), and trains on our preference pairs in the order our DPO
loop takes them (TRL's sampler set to sequential). TRL tokenizes the text rows itself; the record
says whether its token ids equal ours pair by pair (`pairs_match`). Per optimizer step it records
step_s (wall time since the previous step), train_tokens (chosen + rejected tokens, no padding),
and TRL's own logged loss, reward accuracy and reward margin.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.sidecommon import load_run_config, run_side, side_parser, step_clock  # noqa: E402


def our_rows_in_order(cfg: Any, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """(PreferenceRow per pair our loop trains on, in step order; our tokenized pairs in the same order).

    Rows are matched to our tokenized pairs one by one (rows our loader skipped or dropped are
    skipped here too), then ordered by the epoch-shuffled stream `rlhf.dpo.run_dpo` takes them from."""
    from rlhf.data.preferences import (
        MalformedRow,
        _load_records,
        fit_length,
        load_preference_data,
        parse_row,
        tokenize_row,
    )
    from rlhf.data.stream import PromptStream
    from rlhf.dpo import dpo_steps

    data = load_preference_data(cfg, tokenizer)
    records, _ = _load_records(cfg, "train")
    rows = []
    for rec in records:
        if len(rows) == len(data.train):
            break
        try:
            row = parse_row(rec)
        except MalformedRow:
            continue
        ids = fit_length(*tokenize_row(row, tokenizer, cfg.data), cfg.dpo.max_length, cfg.dpo.max_prompt_length)
        pair = data.train[len(rows)]
        if ids == (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids):
            rows.append(row)
    if len(rows) != len(data.train):
        raise RuntimeError(f"matched {len(rows)} of our {len(data.train)} training pairs to their text rows")
    stream = PromptStream(list(range(len(rows))), seed=cfg.seed)
    order = [i for _ in range(dpo_steps(cfg.dpo, len(rows))) for i in stream.take(cfg.dpo.pairs_per_step)]
    return [rows[i] for i in order], [data.train[i] for i in order]


def main(argv: list[str] | None = None) -> int:
    args = side_parser(__doc__).parse_args(argv)
    return run_side("trl", args.out, lambda record: train(args, record))


def train(args: Any, record: dict[str, Any]) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from benchmarks.workloads import trl_dpo_kwargs
    from rlhf.data.assets import resolve_model_path

    cfg = load_run_config(args.recipe, args.overrides)
    if not cfg.data.use_chat_template:
        raise ValueError("the TRL DPO side feeds chat rows: data.use_chat_template must be true")
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows, pairs = our_rows_in_order(cfg, tokenizer)
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt is not None else []
    dataset = Dataset.from_list([{
        "prompt": (system if r.prompt[0]["role"] != "system" else []) + r.prompt,
        "chosen": [{"role": "assistant", "content": r.chosen}],
        "rejected": [{"role": "assistant", "content": r.rejected}],
    } for r in rows])
    kwargs = trl_dpo_kwargs(cfg, output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
                            use_cpu=not torch.cuda.is_available())
    record["trl_config"] = kwargs
    record["torch_threads"] = torch.get_num_threads()
    tokens = {"train": 0.0}

    class TimedDPOTrainer(DPOTrainer):
        def training_step(self, model, inputs, *a, **kw):
            tokens["train"] += float(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *a, **kw)

    def close_step(step_s: float) -> None:
        record["steps"].append({"step": len(record["steps"]), "step_s": step_s, "train_s": step_s,
                                "train_tokens": tokens["train"]})
        tokens["train"] = 0.0

    class StepClock(step_clock(record, args, close_step)):
        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "loss" in logs and record["steps"]:
                record["steps"][-1].update(loss=float(logs["loss"]), accuracy=float(logs["rewards/accuracies"]),
                                           margin=float(logs["rewards/margins"]))

    trainer = TimedDPOTrainer(model=model_path, args=DPOConfig(**kwargs), train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepClock()])
    theirs = trainer.train_dataset
    same = [(list(t["prompt_ids"]), list(t["chosen_ids"]), list(t["rejected_ids"]))
            == (p.prompt_ids, p.chosen_ids, p.rejected_ids) for t, p in zip(theirs, pairs)]
    record["pairs_match"] = sum(same) / len(same)
    record["notes"].append(f"TRL tokenized {sum(same)}/{len(same)} pairs exactly as we did")
    trainer.train()


if __name__ == "__main__":
    raise SystemExit(main())
