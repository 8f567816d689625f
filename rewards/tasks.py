"""Checkers for the shipped tasks, and the default reward spec of each task name.

The dataset rows carry the metadata these functions take as keyword arguments (the contract
with the task data module): `answer` for arithmetic/gsm_symbolic/gsm8k/math, `numbers` and
`target` for countdown, `numbers` for game24.

Choices for the expression puzzles (countdown, game24):
1. The expression is read from the last `<answer>` block, else from the last line holding digits
   and an operator; a trailing "= N" (the model restating the target) is dropped.
2. It is evaluated with `ast`, never `eval`: only integer literals, + - * /, unary minus and
   parentheses; anything else (names, calls, `**`, floats) scores 0. Arithmetic is exact (Fraction).
3. Countdown follows reasoning_gym's scorer: the literals used must be exactly the given numbers,
   each once (reasoning_gym compares sorted lists), and the value must equal the target.
   Game24 likewise: all four numbers exactly once, value 24.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from rewards.answers import answer_block, exact_answer

TASK_REWARDS: dict[str, str] = {
    "arithmetic": "rewards.tasks:arithmetic",
    "arithmetic_1digit": "rewards.tasks:arithmetic",
    "gsm_symbolic": "rewards.tasks:gsm_symbolic",
    "countdown": "rewards.tasks:countdown",
    "game24": "rewards.tasks:game24",
    "tool_products": "rewards.tasks:arithmetic",
    "gsm8k": "rewards.answers:exact_answer",
    "math": "rewards.answers:math_equivalence",
    "champ": "rewards.answers:math_equivalence",
}
"""Default reward spec per built-in task name (rlhf.config.DataConfig.task): the 0/1 answer checker
that evaluation counts as correctness (rlhf.evaluate)."""

_MAX_EXPRESSION_CHARS = 256  # bounds parser and evaluator work on adversarial completions
_EXPR_CHARS = re.compile(r"[\d\s+\-*/()]+")
_OPERATOR = re.compile(r"[+\-*/×÷]")
_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub,
               ast.Mult: operator.mul, ast.Div: operator.truediv}
_SPELLINGS = {"×": "*", "÷": "/", "−": "-", "\\times": "*", "\\cdot": "*", "\\div": "/",
              "\\left": "", "\\right": "", "\\(": "", "\\)": "", "\\[": "", "\\]": "", "$": ""}


def evaluate_arithmetic(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an integer arithmetic expression and the integer literals it uses.

    Raises ValueError for anything but integers, + - * /, unary minus and parentheses.

    >>> evaluate_arithmetic("(1 + 2) * 8")
    (Fraction(24, 1), [1, 2, 8])
    >>> evaluate_arithmetic("8 / (3 - 8 / 3)")
    (Fraction(24, 1), [8, 3, 8, 3])
    >>> evaluate_arithmetic("__import__('os')")
    Traceback (most recent call last):
    ...
    ValueError: only integers, + - * / and parentheses are allowed
    >>> evaluate_arithmetic("2 ** 10")
    Traceback (most recent call last):
    ...
    ValueError: operator Pow is not allowed
    """
    if len(expression) > _MAX_EXPRESSION_CHARS or not _EXPR_CHARS.fullmatch(expression):
        raise ValueError("only integers, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(" ".join(expression.split()), mode="eval")  # one line: newlines break parsing
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an expression: {type(e).__name__}") from None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _BINARY_OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        name = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise ValueError(f"operator {name} is not allowed")

    return value(tree.body), used


def extract_expression(completion: str) -> str | None:
    """The arithmetic expression a puzzle reply proposes, or None.

    >>> extract_expression("<think>try</think><answer>(1 + 2) * 8 = 24</answer>")
    '(1 + 2) * 8'
    >>> extract_expression("Let me see.\\n3 × 8 = 24\\nDone!")
    '3 * 8'
    >>> extract_expression("Answer: 24 = (5 - 1) * 6.")
    '(5 - 1) * 6'
    >>> extract_expression("no idea") is None
    True
    """
    for spelling, plain in _SPELLINGS.items():
        completion = completion.replace(spelling, plain)
    text = answer_block(completion)
    if text is None:
        lines = [ln for ln in completion.splitlines() if re.search(r"\d", ln) and _OPERATOR.search(ln)]
        if not lines:
            return None
        text = lines[-1]
    # "expr = 24" or "24 = expr": keep the side with an operator.
    sides = [s for s in text.split("=") if _OPERATOR.search(s)] or [text]
    runs = [r.strip() for r in _EXPR_CHARS.findall(sides[0]) if re.search(r"\d", r)]
    return max(runs, key=len) if runs else None


def _solves(completion: str, numbers: Sequence[int], target: float) -> float:
    expression = extract_expression(completion)
    if expression is None:
        return 0.0
    try:
        value, used = evaluate_arithmetic(expression)
    except ValueError:
        return 0.0
    if sorted(used) != sorted(int(n) for n in numbers):
        return 0.0
    return 1.0 if abs(float(value) - float(target)) <= 1e-9 else 0.0


def countdown(prompt: str, completion: str, *, numbers: Sequence[int], target: int, **row: Any) -> float:
    """1.0 if the reply's expression uses each given number exactly once and equals `target`.

    >>> countdown("", "<answer>(100 - 4) * 5 + 7</answer>", numbers=[4, 5, 7, 100], target=487)
    1.0
    >>> countdown("", "<answer>100 * 5 - 4 * 4</answer>", numbers=[4, 5, 7, 100], target=484)
    0.0
    """
    return _solves(completion, numbers, target)


def game24(prompt: str, completion: str, *, numbers: Sequence[int], **row: Any) -> float:
    """1.0 if the reply's expression uses the four numbers exactly once and equals 24.

    >>> game24("", "<answer>8 / (3 - 8 / 3)</answer>", numbers=[3, 3, 8, 8])
    1.0
    >>> game24("", "<answer>3 * 8</answer>", numbers=[3, 3, 8, 8])
    0.0
    """
    return _solves(completion, numbers, 24)


def arithmetic(prompt: str, completion: str, *, answer: Any, **row: Any) -> float | None:
    """Numeric answer check for the arithmetic task (see rewards.answers.exact_answer).

    >>> arithmetic("What is 1 + 5?", "1 + 5 = 6", answer="6")
    1.0
    """
    return exact_answer(prompt, completion, answer=answer)


def gsm_symbolic(prompt: str, completion: str, *, answer: Any, **row: Any) -> float | None:
    """Numeric answer check for GSM-Symbolic word problems (see rewards.answers.exact_answer).

    >>> gsm_symbolic("", "He pays 3 * $4 = $12.\\n#### 12", answer="12")
    1.0
    """
    return exact_answer(prompt, completion, answer=answer)
