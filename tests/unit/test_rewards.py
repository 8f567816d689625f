"""Ready-made rewards (answers, format, tasks), spec loading and the RewardFn contract."""

from __future__ import annotations

import doctest
import inspect
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import rewards
import rewards.answers
import rewards.api
import rewards.format
import rewards.tasks
from rewards import RewardLoadError, combine, load_reward_fn
from rewards.answers import exact_answer, extract_final_answer, math_equivalence, parse_number
from rewards.format import think_answer_format, think_answer_format_soft
from rewards.tasks import TASK_REWARDS, countdown, evaluate_arithmetic, extract_expression, game24

FIXTURES = Path(__file__).parents[1] / "fixtures"
USER_FILE = FIXTURES / "user_rewards.py"


@pytest.mark.parametrize("module", [rewards.api, rewards.answers, rewards.format, rewards.tasks])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_import_is_light():
    code = ("import sys, rewards, rewards.api, rewards.answers, rewards.format, rewards.tasks, rewards.pool;"
            "print(sorted(m for m in ('torch', 'math_verify', 'sympy', 'ray', 'vllm', 'rlhf', 'actors')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"


# ---- answers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1,234\n", "1,234"),
    ("The answer is $\\boxed{42}$.", "42"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("<answer>\n-17\n</answer>", "-17"),
    ("<think>I guess \\boxed{3}</think>\n<answer>5</answer>", "5"),
    ("<answer>so \\boxed{7}</answer>", "7"),
    ("<answer>1</answer> later <answer>2</answer>", "2"),
    ("1 + 5 = 6", "6"),
    ("It costs $3.50 in total.", "3.50"),
    ("\\boxed{unbalanced", None),
    ("nothing numeric", None),
    ("", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_final_answer_without_last_number():
    assert extract_final_answer("1 + 5 = 6", last_number=False) is None


@pytest.mark.parametrize("text, expected", [
    ("1,234", 1234), ("$5", 5), ("5.0", 5), ("-3", -3), ("−3", -3), ("3/4", 0.75), ("\\frac{3}{4}", 0.75),
    ("-\\frac{1}{2}", -0.5), ("12 apples", 12), ("x = -2.5", -2.5), ("1{,}000", 1000),
    ("abc", None), ("3/0", None),
])
def test_parse_number(text, expected):
    value = parse_number(text)
    assert (value is None) if expected is None else (value == pytest.approx(expected))


@pytest.mark.parametrize("completion, answer, expected", [
    ("The total is 1,234.", "1234", 1.0),
    ("It costs $5.", "5", 1.0),
    ("<answer>5.0</answer>", "5", 1.0),
    ("\\boxed{3/4}", "0.75", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("The result is -7", "-7", 1.0),
    ("The result is 7", "-7", 0.0),
    ("1 + 5 = 6", "6", 1.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("#### 71", "#### 72", 0.0),
    ("no number", "3", 0.0),
    ("<answer>Paris.</answer>", "paris", 1.0),
    ("12", 12, 1.0),
])
def test_exact_answer(completion, answer, expected):
    assert exact_answer("Q", completion, answer=answer) == expected


def test_exact_answer_not_applicable_without_reference():
    assert exact_answer("Q", "5", answer=None) is None


def test_number_answer_variants():
    from rewards.answers import first_number_answer, last_number_answer

    assert last_number_answer("Q", "1 + 5 = 6", answer="6") == 1.0
    assert first_number_answer("Q", "1 + 5 = 6", answer="6") == 0.0
    assert first_number_answer("Q", "6 since 1 + 5 = 6", answer="6") == 1.0
    assert last_number_answer("Q", "no digits", answer="6") == 0.0


@pytest.mark.parametrize("completion, answer, expected", [
    ("So the answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
    ("<answer>0.5</answer>", "\\frac{1}{2}", 1.0),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("<answer>0.4</answer>", "\\frac{1}{2}", 0.0),
    ("I have no idea", "\\frac{1}{2}", 0.0),
    ("#### 72", "Some steps.\n#### 72", 1.0),
])
def test_math_equivalence(completion, answer, expected):
    assert math_equivalence("Q", completion, answer=answer) == expected


def test_math_equivalence_outside_the_main_thread():
    # math_verify's own timeout uses signal.alarm, which raises in other threads; ours turns it off.
    result = []
    t = threading.Thread(target=lambda: result.append(
        math_equivalence("Q", "\\boxed{0.5}", answer="\\frac{1}{2}")))
    t.start()
    t.join()
    assert result == [1.0]


# ---- format ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, completion, expected", [
    ("Q", "<think>reasoning</think><answer>4</answer>", 1.0),
    ("Q", "  <think>\nline1\nline2\n</think>\n\n<answer>\n4\n</answer>\n", 1.0),
    ("Q", "<think></think><answer>4</answer>", 1.0),
    ("Q<think>", "reasoning</think><answer>4</answer>", 1.0),  # the prompt opened <think>
    ("Q<think>\n", "<think>reasoning</think><answer>4</answer>", 1.0),  # and the model repeated it
    ([{"role": "user", "content": "Q <think>"}], "r</think><answer>4</answer>", 1.0),
    ("Q", "reasoning</think><answer>4</answer>", 0.0),  # nobody opened <think>
    ("Q", "<think>r</think>4", 0.0),
    ("Q", "<answer>4</answer>", 0.0),
    ("Q", "<think>r</think><answer>4</answer> trailing", 0.0),
    ("Q", "<think>r<think>x</think><answer>4</answer>", 0.0),
    ("Q", "<think>r</think><answer></answer>", 0.0),
    ("Q", "<think>r</think><answer>4", 0.0),
])
def test_think_answer_format(prompt, completion, expected):
    assert think_answer_format(prompt, completion) == expected


def test_think_answer_format_soft_gives_partial_credit():
    assert think_answer_format_soft("Q", "<think>r</think><answer>4</answer>") == 1.0
    assert think_answer_format_soft("Q", "<think>r</think><answer>4") == 0.75
    assert think_answer_format_soft("Q", "<think>r</think>4") == 0.5
    assert think_answer_format_soft("Q", "4") == 0.0


# ---- tasks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("completion, numbers, target, expected", [
    ("<answer>(100 - 4) * 5 + 7</answer>", [4, 5, 7, 100], 487, 1.0),
    ("<think>hmm</think><answer>7 + 5 * (100 - 4) = 487</answer>", [100, 4, 5, 7], 487, 1.0),
    ("Let me try.\n(100 - 4) × 5 + 7 = 487", [4, 5, 7, 100], 487, 1.0),
    ("<answer>25 * 4 + 1 - 1</answer>", [1, 1, 4, 25], 100, 1.0),  # repeated numbers, each used once
    ("<answer>(100 - 4) * 5</answer>", [4, 5, 7, 100], 480, 0.0),  # 7 unused: reasoning_gym needs all
    ("<answer>100 * 5 - 4 - 4 - 5</answer>", [4, 5, 100], 487, 0.0),  # numbers reused
    ("<answer>96 * 5 + 7</answer>", [4, 5, 7, 100], 487, 0.0),  # a number not given
    ("<answer>(100 - 4) * 5 + 6</answer>", [4, 5, 6, 100], 487, 0.0),  # wrong value
    ("<answer>100 / (5 - 5) + 4</answer>", [4, 5, 5, 100], 4, 0.0),  # division by zero
    ("<answer>__import__('os').system('echo pwned')</answer>", [4, 5, 7, 100], 487, 0.0),
    ("<answer>(lambda: 487)()</answer>", [4, 5, 7, 100], 487, 0.0),
    ("<answer>4 ** 5 - 100 - 7</answer>", [4, 5, 7, 100], 917, 0.0),  # ** is not allowed
    ("<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", [1], 1, 0.0),  # too long / too deep
    ("no expression", [4, 5, 7, 100], 487, 0.0),
])
def test_countdown(completion, numbers, target, expected):
    assert countdown("Q", completion, numbers=numbers, target=target) == expected


@pytest.mark.parametrize("completion, expected", [
    ("<answer>8 / (3 - 8 / 3)</answer>", 1.0),  # exact fractions: 8 / (1/3) = 24
    ("(8 - 3 - 3) * 8 = 24", 0.0),  # 16, not 24
    ("<answer>8 * 3</answer>", 0.0),  # not all four numbers
    ("<answer>8 * 3 * (8 - 8) + 24</answer>", 0.0),
    ("<answer>open('x').read()</answer>", 0.0),
])
def test_game24(completion, expected):
    assert game24("Q", completion, numbers=[3, 3, 8, 8]) == expected


@pytest.mark.parametrize("expression", ["__import__('os')", "x + 1", "1.5 * 2", "2 ** 3", "1 if 1 else 2",
                                        "[1, 2]", "1 // 2", "1 % 2", "True + 1", "0x10", "1_000"])
def test_evaluate_arithmetic_rejects(expression):
    with pytest.raises(ValueError):
        evaluate_arithmetic(expression)


def test_extract_expression():
    assert extract_expression("<answer>(1 + 2) * 8 = 24</answer>") == "(1 + 2) * 8"
    assert extract_expression("We need 24.\nSo 24 = 3 \\times 8") == "3 * 8"
    assert extract_expression("text only") is None


def test_task_arithmetic_reads_restated_questions():
    assert rewards.tasks.arithmetic("What is 1 + 5?", "1 + 5 = 6", answer="6") == 1.0
    assert rewards.tasks.gsm_symbolic("Q", "so she pays $12.", answer="12") == 1.0


def test_every_task_has_a_loadable_default_reward():
    from rlhf.data.prompts import TASKS

    assert set(TASK_REWARDS) == set(TASKS)  # evaluation's correctness checker of every built-in task
    for spec in TASK_REWARDS.values():
        assert callable(load_reward_fn(spec))


# ---- loading user functions --------------------------------------------------------------------


def test_load_from_file_path():
    fn = load_reward_fn(f"{USER_FILE}:contains_answer")
    assert fn("Q", "it is 42", answer=42) == 1.0
    assert load_reward_fn(f"{USER_FILE}:contains_answer") is fn  # the file is imported once


def test_load_from_relative_file_path(monkeypatch):
    monkeypatch.chdir(FIXTURES.parent)
    fn = load_reward_fn("fixtures/user_rewards.py:contains_answer")
    assert fn("Q", "7", answer=7) == 1.0
    assert rewards.api.resolve_spec("fixtures/user_rewards.py:f") == f"{USER_FILE}:f"


def test_load_from_module_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    fn = load_reward_fn("user_rewards:contains_answer")
    assert fn("Q", "no", answer=42) == 0.0
    assert rewards.api.spec_of(fn) == "user_rewards:contains_answer"


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _load_error_cases(tmp: Path) -> list[tuple[str, str]]:
    """(spec, a fragment the one-line message must contain)."""
    broken_import = _write(tmp / "needs_dep.py", "import not_a_real_dependency_xyz\n")
    syntax = _write(tmp / "syntax.py", "def f(prompt, completion, **row)\n    return 1\n")
    raises = _write(tmp / "raises.py", "raise RuntimeError('bad\\nconfig')\n")
    return [
        ("no_colon_here", "must look like 'package.module:function'"),
        (f"{tmp}/missing.py:f", "missing.py' does not exist"),
        ("not_a_real_module_xyz:f", "is not importable: No module named 'not_a_real_module_xyz'"),
        ("rewards.not_a_module:f", "No module named 'rewards.not_a_module'"),
        (f"{broken_import}:f", "No module named 'not_a_real_dependency_xyz'"),
        (f"{syntax}:f", "failed to import: SyntaxError"),
        (f"{raises}:f", "failed to import: RuntimeError: bad config"),
        (f"{USER_FILE}:no_such_function", "has no attribute 'no_such_function'"),
        ("rewards.answers:no_such_function",
         "reward module 'rewards.answers' has no attribute 'no_such_function'"),
        (f"{USER_FILE}:NOT_CALLABLE", "names a int, not a function"),
        (f"{USER_FILE}:one_param", "must accept (prompt, completion, **row)"),
        (f"{USER_FILE}:no_row_kwargs", "must accept (prompt, completion, **row)"),
        (f"{USER_FILE}:extra_required", "must accept (prompt, completion, **row)"),
    ]


def test_load_errors_are_one_line_and_name_the_problem(tmp_path):
    for spec, fragment in _load_error_cases(tmp_path):
        with pytest.raises(RewardLoadError) as info:
            load_reward_fn(spec)
        message = str(info.value)
        assert "\n" not in message, spec
        assert fragment in message, (spec, message)
        assert isinstance(info.value, ValueError)


def test_combine_weights_and_names():
    scorer = combine([("rewards.answers:exact_answer", 2.0), (f"{USER_FILE}:only_kind_a", 1.0),
                      SimpleNamespace(function="rewards.tasks:arithmetic", weight=0.5)])
    assert [t.name for t in scorer.terms] == ["exact_answer", "only_kind_a", "arithmetic"]
    assert scorer("Q", "6", answer="6", kind="a") == 2.0 + 0.5 + 0.5
    assert scorer("Q", "5", answer="6", kind="b") == 0.0  # None counts as 0
    twice = combine(["rewards.answers:exact_answer", f"{USER_FILE}:contains_answer",
                     "rewards.tasks:arithmetic", "rewards.answers:exact_answer"])
    names = [t.name for t in twice.terms]
    assert names == ["exact_answer", "contains_answer", "arithmetic", "exact_answer_2"]


def test_combine_checks_plain_callables():
    with pytest.raises(RewardLoadError, match="must accept"):
        combine([(lambda prompt: 1.0, 1.0)])
    assert combine([(lambda prompt, completion, **row: 1.0, 3.0)])("Q", "C") == 3.0


# ---- contract: every shipped reward function obeys RewardFn ------------------------------------

SAMPLE_ROWS = {
    "exact_answer": {"answer": "6"},
    "last_number_answer": {"answer": "6"},
    "first_number_answer": {"answer": "6"},
    "math_equivalence": {"answer": "\\frac{1}{2}"},
    "think_answer_format": {},
    "think_answer_format_soft": {},
    "countdown": {"numbers": [1, 2, 3], "target": 6},
    "game24": {"numbers": [3, 3, 8, 8]},
    "arithmetic": {"answer": "6"},
    "gsm_symbolic": {"answer": "6"},
}


def _shipped_reward_functions():
    for module in (rewards.answers, rewards.format, rewards.tasks):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            params = list(inspect.signature(fn).parameters)
            own = fn.__module__ == module.__name__ and not name.startswith("_")
            if own and params[:2] == ["prompt", "completion"]:
                yield f"{module.__name__}:{name}"


def test_every_shipped_reward_function_obeys_the_contract():
    specs = list(_shipped_reward_functions())
    assert {s.rpartition(":")[2] for s in specs} == set(SAMPLE_ROWS), "add a sample row for each new reward"
    for spec in specs:
        fn = load_reward_fn(spec)
        row = {**SAMPLE_ROWS[spec.rpartition(":")[2]], "unrelated_column": 1}  # extra columns are ignored
        value = fn("What is 1 + 5?", "<think>1 + 5 = 6</think><answer>6</answer>", **row)
        assert value is None or (isinstance(value, float) and 0.0 <= value <= 1.0), spec


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "tiny-qwen2"])
def test_completions_decode_in_the_rust_backend_to_batch_decodes_strings(name):
    """`rlhf.scoring.decode_completions` takes the fast tokenizer's `decode_batch` (these tokenizers
    clean up no spaces) and gives exactly `batch_decode`'s strings, special tokens dropped; a
    tokenizer that cleans up spaces keeps `batch_decode`."""
    import random

    from transformers import AutoTokenizer

    from rlhf.data import assets
    from rlhf.scoring import decode_completions

    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir(name)))
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    def token() -> int:  # 5% special tokens
        return rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tokenizer))

    ids = [[token() for _ in range(rng.randrange(0, 64))] for _ in range(200)]
    expected = tokenizer.batch_decode(ids, skip_special_tokens=True)
    calls = []
    slow = tokenizer.batch_decode
    tokenizer.batch_decode = lambda *a, **k: calls.append(1) or slow(*a, **k)
    assert decode_completions(tokenizer, ids) == expected and calls == []  # the Rust path
    assert decode_completions(tokenizer, []) == []
    marks = [tokenizer.decode([s]) for s in special]
    assert not any(m.strip() and m in t for m in marks for t in expected)
    tokenizer.clean_up_tokenization_spaces = True
    assert decode_completions(tokenizer, ids[:3]) == expected[:3] and calls == [1]  # batch_decode's path
