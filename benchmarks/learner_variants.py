"""Where a GRPO learner step's time goes, and what two changes to it would buy: a micro-benchmark.

    .venv/bin/python benchmarks/learner_variants.py [--threads 1] [--model smollm2-135m-instruct]

One forward + backward of the policy-gradient loss on a grpo-cpu-shaped batch (8 prompts x 8
completions; every prompt is the real chat-templated length of the workload's prompts, completions
of 3..32 random tokens), bf16, in this process, in three ways that give the same loss:
  full            logits and an fp32 log-softmax at every position (our learner before 0964536)
  completion      logits only where a completion token is predicted (`logits_to_keep`): what
                  actors/learner_base.py does now
  shared-prompt   each group's prompt once, its completions after it under a block mask
                  (completion j attends to the prompt and to itself), logits as in `completion`
The order is interleaved and repeated, because timings on a shared machine drift.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout


def make_batch(prompt_len: int, prompts: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(100, 40000, (prompt_len,), generator=g) for _ in range(prompts)]
    completions = [torch.randint(100, 40000, (int(n),), generator=g)
                   for n in torch.randint(3, 33, (prompts * group,), generator=g)]
    seqs = [torch.cat([prompt_ids[i // group], c]) for i, c in enumerate(completions)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], attn[i, :len(s)] = s, True
    loss_mask = attn.clone()
    loss_mask[:, :prompt_len] = False
    return prompt_ids, completions, ids, attn, loss_mask


def completion_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def loss_full(model, batch) -> torch.Tensor:
    from rlhf.algo.logprobs import token_logprobs

    _, _, ids, attn, loss_mask = batch
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    return -token_logprobs(logits, ids, loss_mask).sum() / loss_mask.sum()


def loss_completion(model, batch) -> torch.Tensor:
    _, _, ids, attn, loss_mask = batch
    hidden = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    predicts = torch.zeros_like(loss_mask)
    predicts[:, :-1] = loss_mask[:, 1:]  # position t predicts token t+1
    return -completion_logprobs(model, hidden[predicts], ids[:, 1:][loss_mask[:, 1:]]).sum() / loss_mask.sum()


def loss_shared_prompt(model, batch) -> torch.Tensor:
    prompt_ids, completions, _, _, loss_mask = batch
    group = len(completions) // len(prompt_ids)
    rows, masks, positions, picks, targets = [], [], [], [], []
    for p, prompt in enumerate(prompt_ids):
        lp = len(prompt)
        parts = [prompt, *completions[p * group:(p + 1) * group]]
        n = sum(len(x) for x in parts)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:lp, :lp] = torch.ones(lp, lp, dtype=torch.bool).tril()
        pos, pick, start = list(range(lp)), [], lp
        for c in parts[1:]:
            k = len(c)
            mask[start:start + k, :lp] = True
            mask[start:start + k, start:start + k] = torch.ones(k, k, dtype=torch.bool).tril()
            pos += range(lp, lp + k)
            pick += [lp - 1, *range(start, start + k - 1)]  # the position predicting each completion token
            targets.append(c)
            start += k
        rows.append(torch.cat(parts))
        masks.append(mask)
        positions.append(torch.tensor(pos))
        picks.append(torch.tensor(pick))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask4d = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1, 1)  # padding attends to itself
    pos_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, m, pos) in enumerate(zip(rows, masks, positions)):
        ids[i, :len(r)], mask4d[i, 0, :len(r), :len(r)], pos_ids[i, :len(r)] = r, m, pos
    hidden = model.model(input_ids=ids, attention_mask=mask4d, position_ids=pos_ids, use_cache=False).last_hidden_state
    h = torch.cat([hidden[i, pick] for i, pick in enumerate(picks)])
    return -completion_logprobs(model, h, torch.cat(targets)).sum() / loss_mask.sum()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=44, help="grpo-cpu's chat-templated prompts: 40-46 tokens")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from rlhf.data.assets import resolve_model_path

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.bfloat16)
    model.train()
    batch = make_batch(args.prompt_len, prompts=8, group=8)
    _, _, ids, attn, loss_mask = batch
    print(f"batch {tuple(ids.shape)}: {int(attn.sum())} tokens, {int(loss_mask.sum())} completion tokens; "
          f"{args.threads} thread(s)", flush=True)
    variants = {"full": loss_full, "completion": loss_completion, "shared-prompt": loss_shared_prompt}
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            loss = fn(model, batch)
            loss.backward()
            seconds[name].append(time.perf_counter() - t)
            print(f"{name:>14}: {seconds[name][-1]:6.1f} s  loss {loss.item():.5f}", flush=True)
    best = {k: min(v) for k, v in seconds.items()}
    print("best of each: " + ", ".join(f"{k} {v:.1f} s ({best['full'] / v:.2f}x)" for k, v in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
