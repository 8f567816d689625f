"""Prompt datasets: a task name -> `list[PromptRow]`, deterministic given the seed, splits disjoint.

    rows = load_prompts(cfg.data, "train")
    kept, prompt_ids, dropped = tokenize_prompts(rows, tokenizer, cfg.data)
    stream = PromptStream(list(zip(kept, prompt_ids)), seed=cfg.data.seed)  # rlhf.data.stream
    batch = stream.take(cfg.grpo.prompts_per_step)      # stream.state_dict() goes in checkpoints

Tasks (`data.task`): `arithmetic`, `gsm_symbolic`, `countdown` (reasoning-gym generators),
`game24` (the Tree-of-Thoughts puzzles fetched by `python -m scripts.assets fetch`),
`tool_products` (2x2-digit products for the calculator tool, after a worked call), `champ`
(competition math shipped in the `champ-dataset` package), `gsm8k` and `math` (model hub), and
`jsonl:<path>` / `parquet:<path>` for local files.

Decisions (each a section of docs/design/data.md):
- Generated splits: reasoning-gym's seeds s and s+1 share all but one item, so the eval split draws
  from seed `s + EVAL_SEED_OFFSET` and skips any prompt of the train split.
- Fixed-size sources (game24, local files) are shuffled once with the seed; eval takes the first
  `num_eval` rows and train the next `num_train`, so the eval set stays the same when num_train
  changes. Hub datasets use their own test split for eval.
- Prompt template: `data.prompt_template` is formatted with `question` and the row's `meta` fields.
- Local files in any layout the hub loaders know, detected from the columns; a bad row is one
  error line naming `file.jsonl:LINE` (`file.parquet row N`), where the user finds it.
- Hub datasets: `gsm8k` is openai/gsm8k; `math` trains on EleutherAI/hendrycks_math and evaluates
  on HuggingFaceH4/MATH-500, disjoint from MATH's train split.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from rlhf.config import DataConfig
from rlhf.types import PromptRow

Split = Literal["train", "eval"]
EVAL_SEED_OFFSET = 1_000_000_007
"""Distance between the train and eval seeds of procedural tasks (far beyond any split size)."""
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Row building


def render_template(template: str, question: str, meta: dict[str, Any]) -> str:
    """`template` formatted with `question` and the meta fields; a bad field name is one line."""
    try:
        return template.format_map({**meta, "question": question})
    except (KeyError, IndexError) as e:
        fields = ", ".join(["question", *meta])
        raise ValueError(f"data.prompt_template {template!r} uses a field this task does not have "
                         f"({e}); available: {fields}") from None


def _row(template: str, question: Any, answer: Any, meta: dict[str, Any]) -> PromptRow:
    """A PromptRow; a chat-message list is kept as is (the template applies to text only)."""
    prompt = question if isinstance(question, list) else render_template(template, str(question), meta)
    return PromptRow(prompt=prompt, answer=None if answer is None else str(answer), meta=meta)


def _seeded_split(rows: list[T], cfg: DataConfig, split: Split) -> list[T]:
    """Shuffle with the seed; eval = first num_eval, train = the next num_train ("Fixed-size sources")."""
    order = list(rows)
    random.Random(cfg.seed).shuffle(order)
    if split == "eval":
        return order[: cfg.num_eval]
    return order[cfg.num_eval : cfg.num_eval + cfg.num_train]


# ---------------------------------------------------------------------------------------------
# reasoning-gym tasks

# reasoning-gym metadata that only echoes the generator's config (the task name goes in meta["task"]).
_GYM_DROP = ("difficulty", "source_dataset")


@dataclass(frozen=True)
class GymTask:
    """A reasoning-gym generator with the options that set its difficulty."""

    dataset: str
    """reasoning-gym dataset name (`reasoning_gym.create_dataset(dataset, ...)`)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Config fields of that dataset, e.g. `max_terms`, `max_digits` for basic_arithmetic."""

    def __call__(self, cfg: DataConfig, split: Split) -> list[PromptRow]:
        train = list(self._generate(cfg, cfg.seed, cfg.num_train))
        if split == "train":
            return train
        seen = {row.prompt for row in train}
        eval_rows: list[PromptRow] = []
        limit = 20 * cfg.num_eval + 1000
        for row in self._generate(cfg, cfg.seed + EVAL_SEED_OFFSET, limit):
            if len(eval_rows) == cfg.num_eval:
                return eval_rows
            if row.prompt not in seen:
                seen.add(row.prompt)
                eval_rows.append(row)
        if len(eval_rows) < cfg.num_eval:
            raise ValueError(f"task {cfg.task!r}: only {len(eval_rows)} of {cfg.num_eval} eval prompts "
                             f"are not in the train split; lower data.num_eval or data.num_train")
        return eval_rows

    def _generate(self, cfg: DataConfig, seed: int, size: int) -> Iterator[PromptRow]:
        if size == 0:
            return
        import reasoning_gym  # lazy: it imports sympy and every generator (~3 s)

        dataset = reasoning_gym.create_dataset(self.dataset, size=size, seed=seed, **self.options)
        for i in range(size):  # lazily: the eval loop stops early
            entry = dataset[i]
            meta = {"task": cfg.task, **{k: v for k, v in entry["metadata"].items() if k not in _GYM_DROP}}
            yield _row(cfg.prompt_template, entry["question"], entry["answer"], meta)


# ---------------------------------------------------------------------------------------------
# Game of 24

GAME24_QUESTION = ("Use the numbers {numbers} and basic arithmetic operations (+ - * /) to obtain 24. "
                   "Use each number exactly once.")


def load_game24(cfg: DataConfig, split: Split) -> list[PromptRow]:
    """The 1,362 puzzles of Tree of Thoughts (meta: numbers, target=24, rank by human solve time)."""
    from rlhf.data.assets import data_file

    path = data_file("game24.csv")
    if not path.is_file():
        raise FileNotFoundError(f"task 'game24' needs {path}; run `bash scripts/setup.sh` "
                                f"(or `python -m scripts.assets fetch game24`)")
    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            numbers = [int(x) for x in rec["Puzzles"].split()]
            meta = {"task": "game24", "numbers": numbers, "target": 24, "rank": int(rec["Rank"])}
            question = GAME24_QUESTION.format(numbers=" ".join(map(str, numbers)))
            rows.append(_row(cfg.prompt_template, question, None, meta))
    return _seeded_split(rows, cfg, split)


# ---------------------------------------------------------------------------------------------
# CHAMP: competition math shipped in a package

CHAMP_PACKAGE = "champ-dataset==1.0.0"
# Answers CHAMP states in words ("0 is the only possible value", "The sequence does not exist") or
# as yes/no are dropped: a checker cannot grade the first, a coin toss passes the second.
_CHAMP_WORDY = re.compile(r"[A-Za-z]{3,}|^\s*(?:yes|no)\s*$", re.IGNORECASE)


TOOL_EXAMPLE = [  # one worked calculator call, as earlier chat turns (tool_products)
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]


def load_tool_products(cfg: DataConfig, split: Split, size: int = 3000) -> list[PromptRow]:
    """`size` distinct 2x2-digit products "What is A * B?" (A, B in 10..99, in the order Random(0)
    draws them), each after TOOL_EXAMPLE: a task a small model cannot do alone and can with the
    calculator tool (configs/grpo_tools_smollm2_cpu.yaml). A fixed-size source."""
    draw, seen, rows = random.Random(0), set(), []
    while len(rows) < size:
        a, b = draw.randint(10, 99), draw.randint(10, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            question = render_template(cfg.prompt_template, f"What is {a} * {b}?", {})
            rows.append(PromptRow(prompt=[*TOOL_EXAMPLE, {"role": "user", "content": question}], answer=str(a * b),
                                  meta={"task": "tool_products"}))
    return _seeded_split(rows, cfg, split)


def champ_file() -> Path:
    """The dataset file of the installed `champ-dataset` package (found without importing it)."""
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"task 'champ' needs the champ-dataset package: pip install {CHAMP_PACKAGE}")
    return Path(spec.origin).parent / "dataset_files" / "v0.json"


def load_champ(cfg: DataConfig, split: Split) -> list[PromptRow]:
    """CHAMP (Mao et al., 2024): 270 competition problems (number theory, polynomials, inequalities,
    sequences, combinatorics) with a reference solution and a short final answer. The 127 whose
    answer is a number or a formula are kept (meta: identifier, category, solution)."""
    problems = json.loads(champ_file().read_text())["problems"]
    rows = []
    for identifier, rec in problems.items():
        if _CHAMP_WORDY.search(rec["_answer"]):
            continue
        solution = " ".join(step["_text"] for step in rec["solution"]["steps"])
        meta = {"task": cfg.task, "identifier": identifier, "category": rec["category"], "solution": solution}
        rows.append(_row(cfg.prompt_template, rec["_text"], rec["_answer"], meta))
    return _seeded_split(rows, cfg, split)


# ---------------------------------------------------------------------------------------------
# Dataset layouts (hub datasets and local files)


def gsm8k_final_answer(answer: str) -> str:
    """The number after GSM8K's '####' marker, thousands separators removed ('#### 1,200' -> '1200')."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces kept;
    also the brace-less `\\boxed 5$` form. None when there is no complete box."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):
        return text[i:].split("$")[0].strip() or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced braces


def _parse_prompt_answer(rec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    meta = {k: v for k, v in rec.items() if k not in ("prompt", "answer")}
    return rec["prompt"], rec.get("answer"), meta


def _parse_gsm8k(rec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    meta = {k: v for k, v in rec.items() if k not in ("question", "answer")}
    full = str(rec["answer"])
    if "####" not in full:  # a plain question/answer file
        return rec["question"], full.strip(), meta
    meta["solution"] = full.rsplit("####", 1)[0].strip()
    return rec["question"], gsm8k_final_answer(full), meta


def _parse_math(rec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """MATH (problem/solution/level/type) and MATH-500 (problem/solution/answer/subject/...)."""
    meta = {k: v for k, v in rec.items() if k not in ("problem", "answer")}
    answer = rec.get("answer")
    if answer is None or answer == "":
        answer = last_boxed(str(rec["solution"]))
    return rec["problem"], answer, meta


# Checked in order; the first whose columns a row has decides the layout.
LAYOUTS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], tuple[Any, Any, dict[str, Any]]]]] = {
    "prompt": (("prompt",), _parse_prompt_answer),
    "math": (("problem", "solution"), _parse_math),
    "gsm8k": (("question", "answer"), _parse_gsm8k),
}


Located = tuple[str, Any]
"""A raw record and where it is, as the user finds it: `file.jsonl:12` (its line), `file.parquet
row 3` (0-based, as pandas shows it), `openai/gsm8k/main:train row 7`."""


def records_to_rows(records: Sequence[Located], cfg: DataConfig, source: str) -> list[PromptRow]:
    """PromptRows from located raw records in any of LAYOUTS (detected from the first record's
    columns); a record that is not in that layout is one line naming where it is."""
    if not records:
        raise ValueError(f"{source} has no rows")
    first_at, first = records[0]
    columns = first.keys() if isinstance(first, dict) else ()
    layout = next((name for name, (need, _) in LAYOUTS.items() if all(c in columns for c in need)), None)
    if layout is None and isinstance(first, dict):
        known = "; ".join(f"{name}: {'/'.join(need)}" for name, (need, _) in LAYOUTS.items())
        raise ValueError(f"{first_at}: unknown column layout {sorted(columns)} (known: {known})")
    need, parse = LAYOUTS.get(layout, ((), None))
    rows = []
    for at, rec in records:
        if not isinstance(rec, dict):
            raise ValueError(f"{at}: a row must be a mapping of columns (a JSON object), "
                             f"not a {type(rec).__name__}")
        missing = [c for c in need if rec.get(c) is None]
        if missing:
            raise ValueError(f"{at}: no {' or '.join(repr(c) for c in missing)} (columns: "
                             f"{', '.join(sorted(rec))}); rows here have the {layout} layout "
                             f"({'/'.join(need)}), from {first_at}")
        question, answer, meta = parse(rec)
        _check_prompt(question, at)
        rows.append(_row(cfg.prompt_template, question, answer, {"task": cfg.task, **meta}))
    return rows


def _check_prompt(question: Any, at: str) -> None:
    """A prompt is non-empty text or a list of {role, content} chat messages."""
    if isinstance(question, list):
        if not question or not all(isinstance(m, dict) and "role" in m and "content" in m for m in question):
            raise ValueError(f"{at}: the prompt is a list but not of {{role, content}} chat messages")
    elif not str(question).strip():
        raise ValueError(f"{at}: the prompt is empty")


def _read_jsonl(path: Path) -> list[Located]:
    records = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode()
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{n}: not UTF-8 text") from None
            if line.strip():
                try:
                    records.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: invalid JSON ({e.msg}, column {e.colno})") from None
    return records


def _read_parquet(path: Path) -> list[Located]:
    import pyarrow.parquet as pq  # lazy: only parquet tasks need it

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid, OSError, ...: not a parquet file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a readable parquet file ({first})") from None
    return [(f"{path} row {i}", rec) for i, rec in enumerate(table.to_pylist())]


FILE_FORMATS: dict[str, Callable[[Path], list[Located]]] = {
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
}


def load_local_file(cfg: DataConfig, split: Split) -> list[PromptRow]:
    """`jsonl:<path>` / `parquet:<path>`: one file, split by seeded shuffle ("Fixed-size sources")."""
    kind, _, name = cfg.task.partition(":")
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.task={cfg.task!r}: file {path} does not exist")
    rows = records_to_rows(FILE_FORMATS[kind](path), cfg, str(path))
    return _seeded_split(rows, cfg, split)


@dataclass(frozen=True)
class HubSplit:
    path: str
    names: tuple[str | None, ...]
    """Dataset configs, read in order and concatenated (hendrycks_math has one per subject)."""
    split: str


@dataclass(frozen=True)
class HubTask:
    """A model-hub dataset with a train and a test split (`datasets.load_dataset`)."""

    train: HubSplit
    eval: HubSplit

    def __call__(self, cfg: DataConfig, split: Split) -> list[PromptRow]:
        import datasets  # lazy: heavy, and only hub tasks need it

        src = self.train if split == "train" else self.eval
        want = cfg.num_train if split == "train" else cfg.num_eval
        if want == 0:
            return []
        try:
            records = [(f"{src.path}{'/' + name if name else ''}:{src.split} row {i}", rec)
                       for name in src.names
                       for i, rec in enumerate(datasets.load_dataset(src.path, name, split=src.split))]
        except Exception as e:  # no hub: ConnectionError, OSError, DatasetNotFoundError...
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"task {cfg.task!r}: could not load {src.path} ({src.split}) from the hub: "
                               f"{first}; without a hub, save it as a file and use "
                               f"data.task=jsonl:<path>") from None
        rows = records_to_rows(records, cfg, f"{src.path}:{src.split}")
        random.Random(cfg.seed).shuffle(rows)
        return rows[:want]


# ---------------------------------------------------------------------------------------------
# The registry and the entry point

MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")
"""The configs of EleutherAI/hendrycks_math, one per MATH subject."""

TASKS: dict[str, Callable[[DataConfig, Split], list[PromptRow]]] = {
    # Easy on purpose (two terms, 0..100, + and -): SmolLM2-135M solves few even of these.
    "arithmetic": GymTask("basic_arithmetic", dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
        allow_parentheses=False, allow_negation=False)),
    # Single-digit sums: the CPU learning demo's task, where SmolLM2-135M starts in reward's mid-range.
    "arithmetic_1digit": GymTask("basic_arithmetic", dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",),
        allow_parentheses=False, allow_negation=False)),
    "gsm_symbolic": GymTask("gsm_symbolic"),
    # 3-4 numbers in 1..50 and targets up to 100 (TinyZero-like), not reasoning-gym's 4-6 / 100..999.
    "countdown": GymTask("countdown", dict(
        min_numbers=3, max_numbers=4, min_value=1, max_value=50, min_target=10, max_target=100)),
    "game24": load_game24,
    "tool_products": load_tool_products,
    "champ": load_champ,
    "gsm8k": HubTask(HubSplit("openai/gsm8k", ("main",), "train"),
                     HubSplit("openai/gsm8k", ("main",), "test")),
    "math": HubTask(HubSplit("EleutherAI/hendrycks_math", MATH_SUBJECTS, "train"),
                    HubSplit("HuggingFaceH4/MATH-500", (None,), "test")),
}


def load_prompts(cfg: DataConfig, split: Split) -> list[PromptRow]:
    """The `split` prompts of `cfg.task` (see the module docstring for the task names)."""
    kind, sep, _ = cfg.task.partition(":")
    loader = TASKS.get(cfg.task) or (load_local_file if sep and kind in FILE_FORMATS else None)
    if loader is None:
        known = ", ".join([*TASKS, *(f"{k}:<path>" for k in FILE_FORMATS)])
        raise ValueError(f"unknown data.task {cfg.task!r} (known: {known})")
    return loader(cfg, split)


# ---------------------------------------------------------------------------------------------
# Tokenization


def prompt_text(row: PromptRow, tokenizer: Any, cfg: DataConfig) -> str:
    """The prompt as text: the chat template with the generation prompt, or raw text."""
    messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
    if cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    if cfg.use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set data.use_chat_template=false")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages)


def render_prompt(row: PromptRow, tokenizer: Any, cfg: DataConfig) -> list[int]:
    """Token ids of the prompt (`prompt_text`, tokenized). A chat template writes BOS/role tokens as
    text itself, so the tokenizer adds its special tokens to raw text only."""
    return list(tokenizer(prompt_text(row, tokenizer, cfg), add_special_tokens=not cfg.use_chat_template)["input_ids"])


def tokenize_prompts(rows: Sequence[PromptRow], tokenizer: Any, cfg: DataConfig
                     ) -> tuple[list[PromptRow], list[list[int]], int]:
    """(rows kept, their token ids, how many were dropped for exceeding data.max_prompt_tokens). The
    texts are tokenized in one batched call (one by one, 20k prompts took ~5 s of a launch)."""
    if not rows:
        return [], [], 0
    texts = [prompt_text(row, tokenizer, cfg) for row in rows]
    all_ids = tokenizer(texts, add_special_tokens=not cfg.use_chat_template)["input_ids"]  # as render_prompt
    kept, ids = [], []
    for row, tokens in zip(rows, all_ids):
        if len(tokens) <= cfg.max_prompt_tokens:
            kept.append(row)
            ids.append(list(tokens))
    return kept, ids, len(rows) - len(kept)
