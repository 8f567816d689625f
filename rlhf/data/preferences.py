"""Preference pairs for DPO: raw rows of prompt / chosen / rejected -> tokenized `PreferencePair`s.

    data = load_preference_data(cfg, tokenizer)     # data.train, data.eval: list[PreferencePair]
    print(data.stats)                               # rows read, kept, truncated, dropped, skipped

Sources (`dpo.dataset`): `arithmetic_pairs`, `countdown_pairs` and `gsm_symbolic_pairs` (built
offline from those tasks: a correct answer against the same with a wrong result or operator, or
stopped a step early), `hhh_alignment` (BIG-bench's helpful/honest/harmless pairs, `python -m
scripts.assets fetch hhh-alignment`), and `jsonl:<path>`, `parquet:<path>`,
`hf:<dataset>[:<split>]`. Row layouts, detected per row: plain (`prompt`, `chosen`, `rejected`),
messages (`chosen`/`rejected` are chat conversations, UltraFeedback-binarized) and hh-rlhf
("\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts).
docs/design/data.md has both in full.

Decisions (docs/design/data.md, "Preference pairs"):
- Chat-template tokenization: the prompt with the generation prompt, the response as the tokens the
  full conversation adds after it (the template's end-of-turn included), so the model learns to
  stop. `data.use_chat_template=false` uses raw text plus EOS.
- Over-long pairs (prompt + longer response > `dpo.max_length`): `dpo.truncation=truncate` keeps
  the prompt, cut to its last `dpo.max_prompt_length` tokens if longer, and cuts both responses to
  the room left; `drop` removes the pair. Either way the count is in `stats`.
- Malformed rows (a missing field, a non-text response, an empty response, chosen == rejected):
  `dpo.on_malformed=error` raises naming where the row is (`file.jsonl:LINE`, `file.parquet row
  N`, as the user finds it, not its place after shuffling); `skip` counts them.
- Pair splits: built-in task sets draw train and eval from the task's disjoint splits; fixed
  sources are shuffled with `data.seed`, eval = the first `dpo.num_eval` rows, train = the next
  `dpo.num_train` (0 = all), so the eval pairs stay the same when num_train changes.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from rlhf.config import DataConfig, RunConfig
from rlhf.types import PreferencePair, PromptRow

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PreferenceRow:
    """One pair before tokenization: the prompt as chat messages, the two responses as text."""

    prompt: Messages
    chosen: str
    rejected: str


@dataclass
class PreferenceData:
    """Tokenized train and held-out pairs, and what happened to the rows on the way."""

    train: list[PreferencePair]
    eval: list[PreferencePair]
    stats: dict[str, int] = field(default_factory=dict)


class MalformedRow(ValueError):
    """A row that is not a preference pair; the message names the source and the row."""


# ---------------------------------------------------------------------------------------------
# Row layouts


_HH_ASSISTANT = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")


def _hh_messages(transcript: str) -> Messages:
    """'\\n\\nHuman: a\\n\\nAssistant: b ...' -> [{"role": "user", "content": "a"}, ...]."""
    text = transcript if transcript.startswith("\n\n") else "\n\n" + transcript.lstrip("\n")
    parts = _HH_TURN.split(text)  # ["", role, content, role, content, ...]
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts) - 1, 2)]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise MalformedRow(f"{what} is {type(value).__name__}, not text")
    if not value.strip():
        raise MalformedRow(f"{what} is empty")
    return value


def _as_messages(prompt: Any) -> Messages:
    if isinstance(prompt, str):
        return [{"role": "user", "content": _text(prompt, "prompt")}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise MalformedRow("prompt is neither text nor a list of {role, content} messages")


def _split_conversation(conv: Any, what: str) -> tuple[Messages, str]:
    """A chat conversation -> (messages before the final assistant turn, that turn's text)."""
    msgs = _as_messages(conv) if isinstance(conv, list) else None
    if not msgs or msgs[-1]["role"] != "assistant":
        raise MalformedRow(f"{what} does not end with an assistant message")
    return msgs[:-1], _text(msgs[-1]["content"], f"{what}'s assistant message")


def parse_row(rec: Any) -> PreferenceRow:
    """One raw record in any layout of the module docstring -> PreferenceRow (or MalformedRow)."""
    if not isinstance(rec, dict):
        raise MalformedRow(f"is a {type(rec).__name__}, not a mapping")
    missing = [k for k in ("chosen", "rejected") if k not in rec or rec[k] is None]
    if missing:
        raise MalformedRow(f"has no {' or '.join(missing)} (columns: {', '.join(sorted(rec))})")
    chosen, rejected = rec["chosen"], rec["rejected"]
    if isinstance(chosen, list) or isinstance(rejected, list):  # messages layout
        context_c, chosen = _split_conversation(chosen, "chosen")
        context_r, rejected = _split_conversation(rejected, "rejected")
        if rec.get("prompt") is not None and not isinstance(rec["prompt"], str):
            prompt = _as_messages(rec["prompt"])
        elif context_c:
            prompt = context_c
        else:
            prompt = _as_messages(rec.get("prompt"))
        if context_c and context_r and context_c != context_r:
            raise MalformedRow("chosen and rejected conversations have different prompts")
    elif rec.get("prompt") is None:  # hh-rlhf transcripts
        c, r = _text(chosen, "chosen"), _text(rejected, "rejected")
        cut_c, cut_r = c.rfind(_HH_ASSISTANT), r.rfind(_HH_ASSISTANT)
        if cut_c < 0 or cut_r < 0:
            raise MalformedRow("has no prompt and its responses are not Human/Assistant transcripts")
        if c[:cut_c] != r[:cut_r]:
            raise MalformedRow("chosen and rejected transcripts have different prompts")
        prompt = _hh_messages(c[:cut_c])
        chosen, rejected = c[cut_c + len(_HH_ASSISTANT):].strip(), r[cut_r + len(_HH_ASSISTANT):].strip()
        if not prompt:
            raise MalformedRow("has an empty prompt")
    else:
        prompt = _as_messages(rec["prompt"])
    chosen, rejected = _text(chosen, "chosen"), _text(rejected, "rejected")
    if chosen == rejected:
        raise MalformedRow("chosen and rejected are the same text")
    return PreferenceRow(prompt=prompt, chosen=chosen, rejected=rejected)


# ---------------------------------------------------------------------------------------------
# Built-in pair sets from the shipped tasks


def _task_rows(cfg: RunConfig, task: str, split: str) -> list[PromptRow]:
    from rlhf.data.prompts import load_prompts

    n = cfg.dpo.num_train or 512
    data_cfg = replace(cfg.data, task=task, num_train=n, num_eval=cfg.dpo.num_eval)
    return load_prompts(data_cfg, split)  # type: ignore[arg-type]


def _row_messages(row: PromptRow) -> Messages:
    return row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]


def arithmetic_pairs(cfg: RunConfig, split: str) -> list[dict[str, Any]]:
    """Chosen: the worked correct result; rejected: the same sentence with a result off by 1-9."""
    records = []
    for row in _task_rows(cfg, "arithmetic", split):
        expr, answer = row.meta["expression"], int(str(row.answer))
        rng = random.Random(f"{cfg.data.seed}:{split}:{expr}")
        wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 9)
        records.append({"prompt": _row_messages(row),
                        "chosen": f"{expr} = {answer}. The answer is {answer}.",
                        "rejected": f"{expr} = {wrong}. The answer is {wrong}."})
    return records


def _evaluate(expression: str) -> Fraction | None:
    from rewards.tasks import evaluate_arithmetic

    try:
        return evaluate_arithmetic(expression)[0]
    except (ValueError, ZeroDivisionError):
        return None


def countdown_pairs(cfg: RunConfig, split: str) -> list[dict[str, Any]]:
    """Chosen: an expression reaching the target; rejected: one operator changed so it misses."""
    records = []
    for row in _task_rows(cfg, "countdown", split):
        expr, target = str(row.answer), Fraction(row.meta["target"])
        rng = random.Random(f"{cfg.data.seed}:{split}:{expr}")
        positions = [i for i, ch in enumerate(expr) if ch in "+-*/"]
        rng.shuffle(positions)
        wrong = next((w for i in positions for op in "+-*/" if op != expr[i]
                      for w in [expr[:i] + op + expr[i + 1:]] if _evaluate(w) not in (None, target)), None)
        if wrong is not None:
            records.append({"prompt": _row_messages(row), "chosen": expr, "rejected": wrong})
    return records


_NUMBER = re.compile(r"(?<![\d.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d.,]\d)")


def gsm_symbolic_pairs(cfg: RunConfig, split: str) -> list[dict[str, Any]]:
    """Chosen: the problem's worked solution, ending `#### N`; rejected: the same solution stopped one
    step early, giving the result of the step before the last (an intermediate quantity) as the answer."""
    records = []
    for row in _task_rows(cfg, "gsm_symbolic", split):
        solution = str(row.meta.get("answer_cot", "")).strip()
        steps, sep, final = solution.rpartition("\n#### ")
        before = steps.split("\n")[:-1]
        numbers = _NUMBER.findall(before[-1]) if before else []
        early = numbers[-1].replace(",", "") if numbers else None
        if not sep or early is None or re.sub(r"\.0+$", "", early) == re.sub(r"\.0+$", "", final):
            continue
        records.append({"prompt": _row_messages(row), "chosen": solution,
                        "rejected": "\n".join([*before, f"#### {early}"])})
    return records


def hhh_alignment(cfg: RunConfig, split: str) -> list[dict[str, Any]]:
    """BIG-bench hhh_alignment, converted by `scripts.assets` to prompt/chosen/rejected JSONL."""
    from rlhf.data.assets import data_file, is_fetched

    path = data_file("hhh_alignment.jsonl")
    if not is_fetched(path):
        raise FileNotFoundError("dpo.dataset=hhh_alignment needs "
                                "`python -m scripts.assets fetch hhh-alignment` "
                                "(extracts BIG-bench's pairs from its source package)")
    return [rec for _, rec in _seeded_split(_read_file("jsonl", path), cfg, split)]


BUILTIN: dict[str, Callable[[RunConfig, str], list[dict[str, Any]]]] = {
    "arithmetic_pairs": arithmetic_pairs,
    "countdown_pairs": countdown_pairs,
    "gsm_symbolic_pairs": gsm_symbolic_pairs,
    "hhh_alignment": hhh_alignment,
}


# ---------------------------------------------------------------------------------------------
# Files and the hub


def _read_file(kind: str, path: Path) -> list[tuple[str, Any]]:
    """(where, record) pairs of a jsonl/parquet file: where is `file:line` (rlhf.data.prompts.Located)."""
    from rlhf.data.prompts import FILE_FORMATS

    return FILE_FORMATS[kind](path)


def _seeded_split(records: list[Any], cfg: RunConfig, split: str) -> list[Any]:
    order = list(records)
    random.Random(cfg.data.seed).shuffle(order)
    if split == "eval":
        return order[: cfg.dpo.num_eval]
    rest = order[cfg.dpo.num_eval:]
    return rest[: cfg.dpo.num_train] if cfg.dpo.num_train else rest


def _load_records(cfg: RunConfig, split: str) -> tuple[list[dict[str, Any]], str]:
    """(raw records of `split`, a source name for messages)."""
    located, source = _load_located(cfg, split)
    return [rec for _, rec in located], source


def _load_located(cfg: RunConfig, split: str) -> tuple[list[tuple[str, Any]], str]:
    """((where, raw record) of `split`, a source name for messages); where is `file:line` for a
    file, `<set> (<split>) row i` for a built-in set, `<dataset>:<split> row i` for the hub."""
    name = cfg.dpo.dataset
    if name in BUILTIN:
        return [(f"{name} ({split}) row {i}", rec) for i, rec in enumerate(BUILTIN[name](cfg, split))], name
    kind, sep, rest = name.partition(":")
    if sep and kind in ("jsonl", "parquet"):
        path = Path(rest).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"dpo.dataset={name!r}: file {path} does not exist")
        return _seeded_split(_read_file(kind, path), cfg, split), str(path)
    if sep and kind == "hf":
        import datasets  # lazy: heavy, and only hub sets need it

        hub_name, _, hub_split = rest.partition(":")
        try:
            records = list(datasets.load_dataset(hub_name, split=hub_split or "train"))
        except Exception as e:  # no hub: ConnectionError, OSError, DatasetNotFoundError...
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"dpo.dataset={name!r}: could not load it from the hub: {first}; without a "
                               f"hub, save it as a file and use dpo.dataset=jsonl:<path>") from None
        source = f"{hub_name}:{hub_split or 'train'}"
        located = [(f"{source} row {i}", rec) for i, rec in enumerate(records)]
        return _seeded_split(located, cfg, split), source
    known = ", ".join([*BUILTIN, "jsonl:<path>", "parquet:<path>", "hf:<dataset>[:<split>]"])
    raise ValueError(f"unknown dpo.dataset {name!r} (known: {known})")


# ---------------------------------------------------------------------------------------------
# Tokenization


def tokenize_row(row: PreferenceRow, tokenizer: Any, data_cfg: DataConfig) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids), through the chat template ("Chat-template tokenization")."""
    from rlhf.data.prompts import render_prompt

    prompt_ids = render_prompt(PromptRow(prompt=row.prompt), tokenizer, data_cfg)
    if not data_cfg.use_chat_template:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return (prompt_ids, tokenizer(row.chosen, add_special_tokens=False)["input_ids"] + eos,
                tokenizer(row.rejected, add_special_tokens=False)["input_ids"] + eos)
    messages = row.prompt
    if data_cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": data_cfg.system_prompt}, *messages]

    def response(text: str) -> list[int]:
        full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": text}], tokenize=False)
        ids = list(tokenizer(full, add_special_tokens=False)["input_ids"])
        if ids[: len(prompt_ids)] != prompt_ids:  # a template that rewrites earlier turns
            raise ValueError("the chat template renders the prompt differently once a response follows; "
                             "set data.use_chat_template=false or use a template without that behaviour")
        return ids[len(prompt_ids):]

    return prompt_ids, response(row.chosen), response(row.rejected)


def fit_length(prompt: list[int], chosen: list[int], rejected: list[int], max_length: int,
               max_prompt_length: int) -> tuple[list[int], list[int], list[int]]:
    """Over-long pairs, truncated: prompt cut to its last max_prompt_length tokens if longer, then both
    responses cut to the room left under max_length."""
    if len(prompt) + max(len(chosen), len(rejected)) <= max_length:
        return prompt, chosen, rejected
    if len(prompt) > max_prompt_length:
        prompt = prompt[-max_prompt_length:]
    room = max_length - len(prompt)
    return prompt, chosen[:room], rejected[:room]


def build_pairs(records: Sequence[tuple[str, Any]], tokenizer: Any, cfg: RunConfig,
                stats: dict[str, int]) -> list[PreferencePair]:
    """Parse, tokenize and length-fit located `records` ((where, record) pairs: a malformed one is
    named by where it is), counting what happened in `stats`."""
    d = cfg.dpo
    pairs = []
    for where, rec in records:
        stats["rows"] = stats.get("rows", 0) + 1
        try:
            row = parse_row(rec)
        except MalformedRow as e:
            if d.on_malformed == "error":
                raise MalformedRow(f"{where}: {e} (dpo.on_malformed=skip skips such rows)") from None
            stats["skipped_malformed"] = stats.get("skipped_malformed", 0) + 1
            continue
        prompt, chosen, rejected = tokenize_row(row, tokenizer, cfg.data)
        if len(prompt) + max(len(chosen), len(rejected)) > d.max_length:
            if d.truncation == "drop":
                stats["dropped_too_long"] = stats.get("dropped_too_long", 0) + 1
                continue
            stats["truncated"] = stats.get("truncated", 0) + 1
            prompt, chosen, rejected = fit_length(prompt, chosen, rejected, d.max_length, d.max_prompt_length)
        pairs.append(PreferencePair(prompt, chosen, rejected))
    return pairs


def load_preference_data(cfg: RunConfig, tokenizer: Any) -> PreferenceData:
    """Train and held-out pairs of `cfg.dpo.dataset`, tokenized and length-fitted."""
    stats: dict[str, int] = {}
    train_records, _ = _load_located(cfg, "train")
    eval_records, _ = _load_located(cfg, "eval") if cfg.dpo.num_eval else ([], None)
    train = build_pairs(train_records, tokenizer, cfg, stats)
    eval_pairs = build_pairs(eval_records, tokenizer, cfg, stats)
    if not train:
        raise ValueError(f"dpo.dataset={cfg.dpo.dataset!r}: no training pairs left ({json.dumps(stats)})")
    stats.update(train=len(train), eval=len(eval_pairs))
    return PreferenceData(train=train, eval=eval_pairs, stats=stats)
