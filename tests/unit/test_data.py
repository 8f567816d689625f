"""Prompt datasets: every task loader, split disjointness, determinism, layouts, stream resume."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf.config import DataConfig
from scripts import assets
from rlhf.data import prompts as data
from rlhf.data.prompts import last_boxed, load_prompts, render_prompt, tokenize_prompts
from rlhf.data.stream import PromptStream
from rlhf.types import PromptRow

SAMPLES = Path(__file__).parents[1] / "data"
GSM8K_FILE = SAMPLES / "gsm8k_sample.jsonl"
MATH_FILE = SAMPLES / "math_sample.jsonl"  # hendrycks_math layout: problem/level/type/solution
MATH500_FILE = SAMPLES / "math500_sample.jsonl"  # MATH-500 layout: problem/solution/answer/subject/level/unique_id
CHAMP_FILE = SAMPLES / "champ_sample.json"  # the champ-dataset package's v0.json layout
MATH_ANSWERS = ["11", "\\frac{1}{2}", "4", "2\\sqrt{2}", "6", "(1,2)", "10^{3}", "\\text{(B)}", "3", "90"]


def splits(cfg: DataConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    return load_prompts(cfg, "train"), load_prompts(cfg, "eval")


def assert_disjoint(train: list[PromptRow], eval_: list[PromptRow]) -> None:
    assert not {r.prompt for r in train} & {r.prompt for r in eval_}


# ---------------------------------------------------------------------------------------------
# reasoning-gym tasks


@pytest.mark.parametrize("task", ["arithmetic", "gsm_symbolic", "countdown"])
def test_gym_task_splits_are_sized_disjoint_and_deterministic(task):
    cfg = DataConfig(task=task, num_train=24, num_eval=8, seed=3)
    train, eval_ = splits(cfg)
    assert (len(train), len(eval_)) == (24, 8)
    assert_disjoint(train, eval_)
    assert len({r.prompt for r in eval_}) == 8  # eval has no repeats either
    assert (train, eval_) == splits(cfg)
    assert load_prompts(replace(cfg, seed=4), "train") != train
    for row in train + eval_:
        assert isinstance(row.prompt, str) and row.prompt
        assert isinstance(row.answer, str) and row.answer
        assert row.meta["task"] == task and "difficulty" not in row.meta


def test_arithmetic_is_easy_and_answers_are_right():
    train = load_prompts(DataConfig(task="arithmetic", num_train=50, num_eval=0), "train")
    for row in train:
        expr = row.meta["expression"]
        assert row.prompt == f"Calculate {expr}."
        assert row.meta["num_terms"] == 2 and set(expr.split()[1]) <= {"+", "-"}
        assert all(0 <= int(t) <= 100 for t in expr.split()[::2])
        assert int(row.answer) == eval(expr)


def test_countdown_meta_has_numbers_and_target():
    train = load_prompts(DataConfig(task="countdown", num_train=10, num_eval=0), "train")
    for row in train:
        numbers, target = row.meta["numbers"], row.meta["target"]
        assert isinstance(numbers, list) and 3 <= len(numbers) <= 4
        assert all(isinstance(n, int) and 1 <= n <= 50 for n in numbers)
        assert isinstance(target, int) and 10 <= target <= 100
        assert eval(row.answer) == target  # reasoning-gym's reference solution
        assert sorted(int(t) for t in re.findall(r"\d+", row.answer)) == sorted(numbers)


def test_eval_dedup_fails_clearly_when_the_task_space_is_exhausted(monkeypatch):
    tiny = data.GymTask("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                                                 operators=("+",), allow_parentheses=False))
    monkeypatch.setitem(data.TASKS, "tiny_sum", tiny)  # 11 x 11 = 121 distinct prompts
    with pytest.raises(ValueError, match="eval prompts are not in the train split"):
        load_prompts(DataConfig(task="tiny_sum", num_train=2000, num_eval=10), "eval")


def test_prompt_template_sees_question_and_meta_fields():
    cfg = DataConfig(task="countdown", num_train=3, num_eval=0,
                     prompt_template="{question}\nNumbers: {numbers}; target: {target}.")
    for row in load_prompts(cfg, "train"):
        assert row.prompt.endswith(f"Numbers: {row.meta['numbers']}; target: {row.meta['target']}.")
    bad = replace(cfg, prompt_template="{question} {nope}")
    with pytest.raises(ValueError, match=r"uses a field this task does not have \('nope'\); available: "
                                         r"question, task, source_index, numbers"):
        load_prompts(bad, "train")


# ---------------------------------------------------------------------------------------------
# Game of 24 (needs the cached csv: `bash scripts/setup.sh`, else fetched here from the registry)


@pytest.fixture(scope="module")
def game24_csv() -> Path:
    return assets.fetch_game24()


def test_game24_rows_and_split(game24_csv):
    cfg = DataConfig(task="game24", num_train=100, num_eval=20, seed=1)
    train, eval_ = splits(cfg)
    assert (len(train), len(eval_)) == (100, 20)
    assert_disjoint(train, eval_)
    assert (train, eval_) == splits(cfg)
    for row in train + eval_:
        assert row.answer is None
        assert len(row.meta["numbers"]) == 4 and all(isinstance(n, int) for n in row.meta["numbers"])
        assert row.meta["target"] == 24
        assert " ".join(map(str, row.meta["numbers"])) in row.prompt
    # eval is taken first from the shuffled puzzles: it does not move when num_train changes
    assert load_prompts(replace(cfg, num_train=7), "eval") == eval_
    everything = load_prompts(replace(cfg, num_train=10_000, num_eval=0), "train")
    assert len(everything) == 1362


def test_game24_missing_csv_names_the_file_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"game24\.csv; run `bash scripts/setup.sh`"):
        load_prompts(DataConfig(task="game24"), "train")


# ---------------------------------------------------------------------------------------------
# Hub layouts on the shipped look-alike files


def test_gsm8k_layout_from_jsonl():
    cfg = DataConfig(task=f"jsonl:{GSM8K_FILE}", num_train=7, num_eval=3)
    train, eval_ = splits(cfg)
    assert (len(train), len(eval_)) == (7, 3)
    assert_disjoint(train, eval_)
    by_prompt = {r.prompt: r for r in train + eval_}
    assert by_prompt["A school orders 40 boxes of pencils with 30 pencils per box. How many pencils "
                      "does it order?"].answer == "1200"
    temp = next(r for r in by_prompt.values() if "temperature" in r.prompt)
    assert temp.answer == "-7" and temp.meta["solution"].startswith("The temperature is now")
    assert "####" not in temp.meta["solution"]
    assert sorted(int(r.answer) for r in by_prompt.values()) == [-7, 6, 7, 15, 25, 36, 44, 49, 70, 1200]


def test_math_layout_from_jsonl_takes_the_last_box():
    cfg = DataConfig(task=f"jsonl:{MATH_FILE}", num_train=10, num_eval=0,
                     prompt_template="Problem: {question}")
    rows = load_prompts(cfg, "train")
    records = [json.loads(line) for line in MATH_FILE.read_text().splitlines()]
    expected = {f"Problem: {rec['problem']}": ans for rec, ans in zip(records, MATH_ANSWERS, strict=True)}
    assert {r.prompt: r.answer for r in rows} == expected
    assert all(r.meta["level"].startswith("Level") and r.meta["type"] and r.meta["solution"] for r in rows)


def test_math500_layout_from_parquet_uses_the_answer_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({
        "problem": ["What is $1+1$?", "Compute $\\binom{4}{2}$.", "Evaluate $2^{-1}$."],
        "solution": ["$1+1=\\boxed{2}$.", "$\\binom{4}{2} = \\boxed{6}$.", "It is $\\boxed{\\frac12}$."],
        "answer": ["2", "6", "\\frac{1}{2}"],
        "subject": ["Prealgebra", "Counting & Probability", "Algebra"],
        "level": [1, 2, 2],
        "unique_id": ["test/a/1.json", "test/b/2.json", "test/c/3.json"],
    })
    path = tmp_path / "math500.parquet"
    pq.write_table(table, path)
    rows = load_prompts(DataConfig(task=f"parquet:{path}", num_train=3, num_eval=0), "train")
    assert sorted(r.answer for r in rows) == ["2", "6", "\\frac{1}{2}"]
    assert {r.meta["subject"] for r in rows} == {"Prealgebra", "Counting & Probability", "Algebra"}


def test_prompt_layout_keeps_chat_messages_and_extra_columns(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [{"prompt": "Say hi.", "answer": "hi", "difficulty": 1},
             {"prompt": [{"role": "user", "content": "Say yo."}], "answer": None, "difficulty": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    cfg = DataConfig(task=f"jsonl:{path}", num_train=5, num_eval=0, prompt_template="> {question}")
    rows = load_prompts(cfg, "train")
    by_answer = {r.answer: r for r in rows}
    assert by_answer["hi"].prompt == "> Say hi." and by_answer["hi"].meta["difficulty"] == 1
    assert by_answer[None].prompt == [{"role": "user", "content": "Say yo."}]


@pytest.mark.parametrize("text, boxed", [
    ("so $\\boxed{5}$", "5"),
    ("$\\boxed{\\frac{a}{b}}$ and more", "\\frac{a}{b}"),
    ("first \\boxed{1} then \\boxed{\\{2, 3\\}}", "\\{2, 3\\}"),
    ("\\boxed 7$ degrees", "7"),
    ("\\fbox{x}", "x"),
    ("no box here", None),
    ("\\boxed{unbalanced", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


# ---------------------------------------------------------------------------------------------
# Hub loaders (datasets.load_dataset faked with the look-alike files: no network)


def _records(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()]


@pytest.fixture
def fake_hub(monkeypatch):
    """`datasets.load_dataset` serving the look-alike files in each hub dataset's layout; hendrycks_math
    has one config per subject, so each config serves the sample rows of its subject only."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path == "openai/gsm8k":
            rows = _records(GSM8K_FILE)
        elif path == "EleutherAI/hendrycks_math":
            rows = [r for r in _records(MATH_FILE) if r["type"].lower().replace(" & ", "_and_") == name]
        elif path == "HuggingFaceH4/MATH-500":
            rows = _records(MATH500_FILE)
        else:
            raise ConnectionError(f"no such dataset {path}")
        return datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_gsm8k_hub_loader_reads_train_and_test(fake_hub):
    train, eval_ = splits(DataConfig(task="gsm8k", num_train=4, num_eval=2))
    assert fake_hub == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert (len(train), len(eval_)) == (4, 2) and all(r.answer.lstrip("-").isdigit() for r in train)
    assert all("####" not in r.meta["solution"] for r in train + eval_)


def test_the_qwen_gsm_recipe_takes_a_hub_model_and_gsm8k_in_one_line(fake_hub, tiny_qwen2):
    """A user with a hub: `model.path=Qwen/Qwen2.5-0.5B-Instruct data.task=gsm8k` on the Qwen2.5-Coder
    GSM recipe (docs/recipes.md). The hub id goes to transformers and vLLM unchanged and plans from
    the known-shape table; a local folder, standing in for it here, plans from its config.json; the
    prompts come from GSM8K's hub loader (faked with the look-alike rows)."""
    from rlhf.config import load_config
    from rlhf.data.assets import resolve_model_path
    from rlhf.planner.memory import make_plan
    from rlhf.planner.shapes import KNOWN_SHAPES, gpu_kind, model_shape

    recipe = Path(__file__).resolve().parents[2] / "configs/grpo_gsm8k_qwen2.5-coder-0.5b_1gpu.yaml"
    hub = load_config(recipe, ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "data.task=gsm8k"])
    assert resolve_model_path(hub.model.path) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_shape(hub.model.path) == KNOWN_SHAPES["qwen2.5-0.5b"]
    assert make_plan(hub, model_shape(hub.model.path), gpu_kind("h100-80gb")).best.fits
    local = load_config(recipe, [f"model.path={tiny_qwen2}", "data.task=gsm8k", "data.num_train=6", "data.num_eval=2"])
    assert resolve_model_path(local.model.path) == str(tiny_qwen2) and model_shape(local.model.path).hidden_size == 128
    train, eval_ = splits(local.data)
    assert fake_hub == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert (len(train), len(eval_)) == (6, 2) and all(r.answer.lstrip("-").isdigit() for r in train + eval_)


def test_math_hub_loader_trains_on_every_hendrycks_subject_and_evaluates_on_math500(fake_hub):
    train = load_prompts(DataConfig(task="math", num_train=100, num_eval=5), "train")
    assert fake_hub == [("EleutherAI/hendrycks_math", subject, "train") for subject in data.MATH_SUBJECTS]
    assert sorted(r.answer for r in train) == sorted(MATH_ANSWERS)  # the last \\boxed{} of each solution
    assert {r.meta["type"] for r in train} == {"Prealgebra", "Algebra", "Geometry", "Counting & Probability"}
    fake_hub.clear()
    eval_ = load_prompts(DataConfig(task="math", num_train=100, num_eval=5), "eval")
    assert fake_hub == [("HuggingFaceH4/MATH-500", None, "test")]
    assert sorted(r.answer for r in eval_) == ["(-1,1)", "2", "2", "6", "\\frac{1}{2}"]  # the answer column
    assert {r.meta["unique_id"] for r in eval_} == {f"test/{s}/{i}.json" for i, s in enumerate(
        ["prealgebra", "counting_and_probability", "algebra", "algebra", "intermediate_algebra"], 1)}
    assert all(r.meta["subject"] and r.meta["level"] in (1, 2, 3) for r in eval_)
    assert len(load_prompts(DataConfig(task="math", num_train=100, num_eval=2), "eval")) == 2


def test_math500_layout_from_the_shipped_jsonl():
    rows = load_prompts(DataConfig(task=f"jsonl:{MATH500_FILE}", num_train=5, num_eval=0), "train")
    by_id = {r.meta["unique_id"]: r for r in rows}
    assert by_id["test/algebra/3.json"].answer == "\\frac{1}{2}"  # the column, not the box (\\frac12)
    assert by_id["test/intermediate_algebra/5.json"].meta["subject"] == "Intermediate Algebra"


def test_hub_unreachable_is_one_line_with_the_offline_fix(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError) as err:
        load_prompts(DataConfig(task="gsm8k"), "train")
    assert "\n" not in str(err.value) and "data.task=jsonl:<path>" in str(err.value)


# ---------------------------------------------------------------------------------------------
# CHAMP (the champ-dataset package's file; here its look-alike)


def test_champ_keeps_closed_form_answers_and_splits_by_seed(monkeypatch):
    monkeypatch.setattr(data, "champ_file", lambda: CHAMP_FILE)
    cfg = DataConfig(task="champ", num_train=100, num_eval=2, prompt_template="{question} ({category})")
    train, eval_ = splits(cfg)
    assert (len(train), len(eval_)) == (4, 2)
    assert_disjoint(train, eval_)
    rows = {r.meta["identifier"]: r for r in train + eval_}
    # yes/no and worded answers are dropped; numbers and formulas stay
    assert {i: r.answer for i, r in rows.items()} == {
        "P_Combinatorics_1": "32", "P_Combinatorics_2": "n!", "P_Number-Theory_1": "2",
        "P_Polynomial_1": "(x-1)(x+1)", "P_Inequality_1": "2", "P_Sequence_1": "n(n+1)/2"}
    first = rows["P_Combinatorics_1"]
    assert first.prompt == "How many subsets does a set with 5 elements have? (Combinatorics)"
    assert first.meta["solution"] == "Each element is in or out of a subset. So there are 2^5 = 32 subsets."
    assert load_prompts(replace(cfg, num_train=1), "eval") == eval_  # eval does not move with num_train


def test_champ_answers_pass_their_own_checker(monkeypatch):
    from rewards.answers import math_equivalence

    monkeypatch.setattr(data, "champ_file", lambda: CHAMP_FILE)
    for row in load_prompts(DataConfig(task="champ", num_train=100, num_eval=0), "train"):
        assert math_equivalence(row.prompt, f"So the answer is $\\boxed{{{row.answer}}}$.", answer=row.answer) == 1.0
        assert math_equivalence(row.prompt, "\\boxed{7}", answer=row.answer) == 0.0


def test_champ_from_the_package():
    """The real file (champ-dataset is pinned in requirements/pins.txt): 127 closed-form problems."""
    rows = load_prompts(DataConfig(task="champ", num_train=1000, num_eval=0), "train")
    assert len(rows) == 127 and len({r.meta["identifier"] for r in rows}) == 127
    assert {r.meta["category"] for r in rows} == {"Combinatorics", "Inequality", "Number-Theory", "Polynomial",
                                                  "Sequence"}
    assert all(r.answer and r.meta["solution"] and r.prompt for r in rows)


def test_champ_without_the_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install champ-dataset==1\.0\.0"):
        load_prompts(DataConfig(task="champ"), "train")


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        load_prompts(DataConfig(task="gsm9k"), "train")
    msg = str(err.value)
    assert "\n" not in msg and "'gsm9k'" in msg
    for name in ("arithmetic", "gsm_symbolic", "countdown", "game24", "champ", "gsm8k", "math", "jsonl:<path>"):
        assert name in msg
    with pytest.raises(ValueError, match="unknown data.task 'csv:x.csv'"):
        load_prompts(DataConfig(task="csv:x.csv"), "train")


def test_missing_local_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=f"file {missing} does not exist"):
        load_prompts(DataConfig(task=f"jsonl:{missing}"), "train")


def test_bad_local_files_say_what_is_wrong(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        load_prompts(DataConfig(task=f"jsonl:{bad_json}"), "train")
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"text": "a", "label": 1}\n')
    with pytest.raises(ValueError, match=r"unknown column layout \['label', 'text'\]"):
        load_prompts(DataConfig(task=f"jsonl:{odd}"), "train")


# ---------------------------------------------------------------------------------------------
# Tokenization


@pytest.fixture(scope="module")
def tokenizer():
    from rlhf.data.tiny_models import build_tokenizer

    return build_tokenizer()


def test_render_prompt_chat_template_system_prompt_and_raw(tokenizer):
    row = PromptRow(prompt="What is 2 + 3?", answer="5")
    chat = render_prompt(row, tokenizer, DataConfig())
    assert tokenizer.decode(chat) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    with_system = render_prompt(row, tokenizer, DataConfig(system_prompt="Be brief."))
    assert tokenizer.decode(with_system).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    raw = render_prompt(row, tokenizer, DataConfig(use_chat_template=False, system_prompt="Be brief."))
    assert tokenizer.decode(raw) == "Be brief.\n\nWhat is 2 + 3?"


def test_render_prompt_without_a_chat_template_says_how_to_proceed():
    from rlhf.data.tiny_models import build_tokenizer

    plain = build_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="set data.use_chat_template=false"):
        render_prompt(PromptRow(prompt="hi"), plain, DataConfig())


def test_tokenize_prompts_drops_and_counts_long_prompts(tokenizer):
    rows = [PromptRow(prompt="Add: " + " + ".join(["1"] * n)) for n in (1, 5, 40, 2)]
    cfg = DataConfig(max_prompt_tokens=40)
    kept, ids, dropped = tokenize_prompts(rows, tokenizer, cfg)
    assert dropped == 1 and kept == [rows[0], rows[1], rows[3]]
    assert ids == [render_prompt(r, tokenizer, cfg) for r in kept] and max(map(len, ids)) <= 40


# ---------------------------------------------------------------------------------------------
# PromptStream


def test_prompt_stream_epochs_visit_every_item_once_in_new_orders():
    stream = PromptStream(list(range(10)), seed=0)
    first, second = stream.take(10), stream.take(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and stream.epoch == 1
    assert PromptStream(list(range(10)), seed=0).take(25) == first + second + PromptStream(
        list(range(10)), seed=0).take(30)[20:25]
    assert PromptStream(list(range(10)), seed=1).take(10) != first


def test_prompt_stream_resume_continues_with_exactly_the_same_prompts():
    rows = load_prompts(DataConfig(task="arithmetic", num_train=13, num_eval=0), "train")
    items = [(row, [i, i + 1]) for i, row in enumerate(rows)]  # (row, prompt ids) as the loop keeps them
    uninterrupted = PromptStream(items, seed=5)
    reference = uninterrupted.take(40)
    run = PromptStream(items, seed=5)
    before = run.take(17)  # mid-epoch (13 items per epoch)
    state = json.loads(json.dumps(run.state_dict()))  # survives a plain serialization
    resumed = PromptStream(items, seed=5)
    resumed.load_state_dict(state)
    assert before + resumed.take(23) == reference
    # a state taken exactly at an epoch boundary resumes too
    at_boundary = PromptStream(items, seed=5)
    at_boundary.take(26)
    again = PromptStream(items, seed=5)
    again.load_state_dict(at_boundary.state_dict())
    assert again.take(14) == reference[26:40]


def test_prompt_stream_refuses_a_state_from_other_data():
    state = PromptStream(list(range(10)), seed=0).state_dict()
    with pytest.raises(ValueError, match="resume with the same data config"):
        PromptStream(list(range(1, 11)), seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="at least one item"):
        PromptStream([], seed=0)


def test_tool_products_follow_a_worked_call_and_split_disjointly():
    """The tool recipe's task: 3,000 distinct 2x2-digit products, each after the same worked
    calculator call; eval and train are disjoint and the answers are the products."""
    import re

    from rlhf.data.prompts import TOOL_EXAMPLE

    cfg = DataConfig(task="tool_products", num_train=5000, num_eval=64)
    train, held_out = load_prompts(cfg, "train"), load_prompts(cfg, "eval")
    assert len(held_out) == 64 and len(train) == 3000 - 64  # a fixed-size source: num_train is an upper bound
    questions = [r.user_text() for r in train + held_out]
    assert len(set(questions)) == 3000
    for row in train[:50] + held_out:
        assert row.prompt[:4] == TOOL_EXAMPLE and row.prompt[4]["role"] == "user"
        a, b = map(int, re.fullmatch(r"What is (\d\d) \* (\d\d)\?", row.user_text()).groups())
        assert row.answer == str(a * b)
    assert json.loads(TOOL_EXAMPLE[1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "calculator", "arguments": {"expression": "12 * 34"}}
