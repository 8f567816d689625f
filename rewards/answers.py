"""Final-answer extraction and answer-checking rewards (GSM8K, MATH, short numeric answers).

Choices:
1. Where the answer is: the last `<answer>...</answer>` block, if any, narrows the search; inside
   it (or in the whole text) a GSM8K `#### 42` line wins, then the last `\\boxed{...}`, then the
   tag content itself, then (optionally) the last number. A box inside the answer tags is thus
   found, while a box drafted in the `<think>` part does not override the tagged answer.
2. Numbers compare exactly as fractions: "1,234" == "1234", "$5" == "5.0", "3/4" == "0.75".
3. Symbolic answers (MATH) go through math_verify. Its own timeout uses SIGALRM, which only works
   in a main thread; elsewhere (threads of a Ray actor) it is switched off and the reward pool's
   process timeout is the guard.
4. A row without a reference answer (`answer=None`) is "not applicable": None.

math_verify (and sympy) are imported on first use: `import rewards.answers` stays cheap.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# An integer, decimal or fraction, with thousands commas; a leading minus counts only when it does
# not follow a word character (so "5-3" yields 5 and 3, "x=-3" yields -3).
_NUMBER = re.compile(r"(?<![\w.])[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0 or text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i].strip()
    return None  # unbalanced (truncated completion)


def answer_block(text: str) -> str | None:
    """Content of the last `<answer>...</answer>` block, stripped, or None.

    >>> answer_block("<think>hmm</think> <answer> 42 </answer>")
    '42'
    """
    blocks = _ANSWER_TAG.findall(text)
    return blocks[-1].strip() if blocks else None


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, as written.

    >>> find_numbers("1 + 5 = 6, so -3 and 1,234.5 and 3/4; 5-3")
    ['1', '5', '6', '-3', '1,234.5', '3/4', '5', '3']
    """
    return _NUMBER.findall(text)


def extract_final_answer(text: str, *, last_number: bool = True) -> str | None:
    """The final answer a solution states, as a string, or None.

    >>> extract_final_answer("She has 3 + 4 = 7 apples.\\n#### 7")
    '7'
    >>> extract_final_answer("so the answer is $\\\\boxed{\\\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    >>> extract_final_answer("\\\\boxed{\\\\{1, 2\\\\}}")
    '\\\\{1, 2\\\\}'
    >>> extract_final_answer("<think>maybe \\\\boxed{3}</think><answer>5</answer>")
    '5'
    >>> extract_final_answer("<answer>It is \\\\boxed{12}</answer>")
    '12'
    >>> extract_final_answer("1 + 5 = 6")
    '6'
    >>> extract_final_answer("1 + 5 = 6", last_number=False) is None
    True
    >>> extract_final_answer("no digits here") is None
    True
    """
    tagged = answer_block(text)
    region = text if tagged is None else tagged
    hashes = _HASHES.findall(region)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    boxed = _last_boxed(region)
    if boxed:
        return boxed
    if tagged:
        return tagged
    if last_number:
        numbers = find_numbers(region)
        return numbers[-1] if numbers else None
    return None


def _to_fraction(number: str) -> Fraction | None:
    s = number.replace(",", "").replace("−", "-")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str | int | float | None) -> Fraction | None:
    """The (last) number a short answer states, as an exact Fraction, or None.

    >>> parse_number("$1,234")
    Fraction(1234, 1)
    >>> parse_number("5.0") == parse_number("5")
    True
    >>> parse_number("\\\\frac{3}{4}"), parse_number("-0.75")
    (Fraction(3, 4), Fraction(-3, 4))
    >>> parse_number("x = 12 apples")
    Fraction(12, 1)
    >>> parse_number("50%"), parse_number(7), parse_number("seven")
    (Fraction(50, 1), Fraction(7, 1), None)
    """
    if text is None:
        return None
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", str(text)).replace("(", "").replace(")", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    numbers = find_numbers(s)
    return _to_fraction(numbers[-1]) if numbers else None


def _normalize_text(s: str) -> str:
    return " ".join(s.strip().rstrip(".").casefold().split())


def _same_answer(predicted: str | None, answer: Any) -> float:
    """1.0 when the prediction equals the reference: numerically when the reference is a number,
    else as normalized text."""
    if predicted is None:
        return 0.0
    gold_text = extract_final_answer(str(answer), last_number=False) or str(answer)
    gold = parse_number(gold_text)
    if gold is None:
        return float(_normalize_text(predicted) == _normalize_text(gold_text))
    return float(parse_number(predicted) == gold)


def exact_answer(prompt: str, completion: str, *, answer: Any, **row: Any) -> float | None:
    """1.0 if the completion's final answer equals the reference `answer`, else 0.0.

    The final answer is found by `extract_final_answer` (tags, `####`, `\\boxed{}`, last number);
    a GSM8K-style reference ("...#### 72") is reduced to its final answer too.

    >>> exact_answer("", "The total is $1,234.", answer="1234")
    1.0
    >>> exact_answer("", "<answer>5.0</answer>", answer="#### 5")
    1.0
    >>> exact_answer("", "\\\\boxed{3/4}", answer="0.75")
    1.0
    >>> exact_answer("", "It is -3", answer="3")
    0.0
    >>> exact_answer("", "<answer>Paris</answer>", answer="paris") , exact_answer("", "x", answer=None)
    (1.0, None)
    """
    if answer is None:
        return None
    return _same_answer(extract_final_answer(completion), answer)


def last_number_answer(prompt: str, completion: str, *, answer: Any, **row: Any) -> float | None:
    """1.0 if the last number in the completion equals `answer` (for short answers; a small model
    that restates the question, "1 + 5 = 6", still ends on its result).

    >>> last_number_answer("", "1 + 5 = 6", answer="6")
    1.0
    >>> last_number_answer("", "6, because 1 + 5", answer="6")
    0.0
    """
    if answer is None:
        return None
    numbers = find_numbers(completion)
    return _same_answer(numbers[-1] if numbers else None, answer)


def first_number_answer(prompt: str, completion: str, *, answer: Any, **row: Any) -> float | None:
    """1.0 if the first number in the completion equals `answer` (answer-first short replies).

    >>> first_number_answer("", "6, because 1 + 5", answer="6")
    1.0
    >>> first_number_answer("", "1 + 5 = 6", answer="6")
    0.0
    """
    if answer is None:
        return None
    numbers = find_numbers(completion)
    return _same_answer(numbers[0] if numbers else None, answer)


def _signal_timeout() -> int | None:
    # math_verify's timeout is signal.alarm: only allowed in the main thread, so elsewhere none.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse_bare_math(text: str, timeout: int | None) -> list[Any]:
    """Parse a bare answer (a reference, or the content of answer tags) with math_verify."""
    from math_verify import parse

    if "$" not in text and "\\boxed" not in text:
        # As LaTeX first: unwrapped, "\{2, 1\}" would be read as the plain expression "1".
        parsed = parse(f"${text}$", parsing_timeout=timeout)
        if parsed:
            return parsed
    return parse(text, parsing_timeout=timeout)


def math_equivalence(prompt: str, completion: str, *, answer: Any, **row: Any) -> float | None:
    """1.0 if the completion's answer is mathematically equal to `answer` (via math_verify).

    The reference may be bare LaTeX (MATH: `\\frac{1}{2}`), boxed, or GSM8K-style; the
    completion is read from its `<answer>` block when it has one, else whole (math_verify finds
    boxed and "final answer is" statements itself). None when the reference cannot be parsed.

    >>> math_equivalence("", "So the answer is $\\\\boxed{0.5}$.", answer="\\\\frac{1}{2}")
    1.0
    >>> math_equivalence("", "<answer>\\\\frac{1}{\\\\sqrt{2}}</answer>", answer="\\\\frac{\\\\sqrt{2}}{2}")
    1.0
    >>> math_equivalence("", "<answer>3</answer>", answer="\\\\frac{1}{2}")
    0.0
    """
    if answer is None:
        return None
    from math_verify import verify

    timeout = _signal_timeout()
    gold_text = extract_final_answer(str(answer), last_number=False) or str(answer)
    gold = _parse_bare_math(gold_text, timeout)
    if not gold:
        return None
    tagged = answer_block(completion)
    if tagged:
        predicted = _parse_bare_math(tagged, timeout)
    else:
        from math_verify import parse

        predicted = parse(completion, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=timeout))
