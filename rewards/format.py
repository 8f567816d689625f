"""Format rewards for the `<think>...</think><answer>...</answer>` reply layout.

The rule for an opened tag: when the prompt itself ends with `<think>` (a chat template or a
prompt that starts the model's reasoning for it), the completion is read as if it began with
`<think>`; a completion that repeats the tag is accepted too. Otherwise the completion must
open `<think>` itself.

A well-formed reply is, in full: optional whitespace, `<think>`, any reasoning (possibly empty)
without think/answer tags, `</think>`, whitespace, `<answer>`, a non-empty answer without tags,
`</answer>`, optional whitespace. Nothing may follow the answer block.
"""

from __future__ import annotations

import re
from typing import Any

_LAYOUT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _prompt_text(prompt: Any) -> str:
    """The text of a prompt given as a string or as chat messages (the last message counts)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return ""


def _with_opened_think(prompt: Any, completion: str) -> str:
    if _prompt_text(prompt).rstrip().endswith("<think>") and not completion.lstrip().startswith("<think>"):
        return "<think>" + completion
    return completion


def think_answer_format(prompt: str, completion: str, **row: Any) -> float:
    """1.0 if the reply is exactly `<think>...</think>` then `<answer>...</answer>`, else 0.0.

    >>> think_answer_format("Q", "<think>2+2 is 4</think>\\n<answer>4</answer>")
    1.0
    >>> think_answer_format("Q\\n<think>", "2+2 is 4</think><answer>4</answer>")
    1.0
    >>> think_answer_format("Q", "2+2 is 4</think><answer>4</answer>")
    0.0
    >>> think_answer_format("Q", "<think>a</think><answer>4</answer> and more")
    0.0
    >>> think_answer_format("Q", "<think>a</think><answer>4</answer><answer>5</answer>")
    0.0
    >>> think_answer_format("Q", "<think>a</think><answer> </answer>")
    0.0
    """
    match = _LAYOUT.fullmatch(_with_opened_think(prompt, completion))
    if match is None:
        return 0.0
    think, answer = match.groups()
    if any(tag in think or tag in answer for tag in _TAGS):
        return 0.0
    return 1.0 if answer.strip() else 0.0


def think_answer_format_soft(prompt: str, completion: str, **row: Any) -> float:
    """Partial credit: 0.25 for each of the four tags that appears exactly once (capped at 0.75),
    and 1.0 only for a well-formed reply (as in `think_answer_format`).

    >>> think_answer_format_soft("Q", "<think>a</think><answer>4</answer>")
    1.0
    >>> think_answer_format_soft("Q", "<think>a</think> 4")
    0.5
    >>> think_answer_format_soft("Q", "4")
    0.0
    """
    if think_answer_format(prompt, completion) == 1.0:
        return 1.0
    text = _with_opened_think(prompt, completion)
    return min(0.75, 0.25 * sum(text.count(tag) == 1 for tag in _TAGS))
