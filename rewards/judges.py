"""Generative-judge templates and the parser of a judge's answer: plain text in, a reward out.

    template_problem("Rate {response}")      # -> what a template must be (it lacks {prompt})
    parse_score("Looks right. Score: 8")     # -> 0.8

A recipe's `{judge: score_0_10}` entry (rlhf.reward_model.Judge) fills a template with each sample
and an LLM answers it; these functions are the parts that need no model.

Decisions:
- Template: a built-in name (`TEMPLATES`), a `.txt` file, or the template itself, holding
  `{prompt}` (the row's user text) and `{response}` and no other field (`{{`/`}}` for braces).
  Values are checked with the config (`template_problem`), files when read (`load_template`).
- Parsing (`parse_score`): the last `Score: X` of the answer, else its last number; a value in
  [0, MAX_SCORE] becomes X / MAX_SCORE, so judges mix with 0/1 rule rewards. Anything else (no
  number, out of range) is None: the caller scores it 0 and counts it as a parse failure.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_SCORE = 10.0
TEMPLATES = {
    "score_0_10": (
        "You are grading an answer to a user's request.\n\n[Request]\n{prompt}\n\n[Answer]\n{response}\n\n"
        "Rate how helpful, correct and clear the answer is, from 0 (useless or wrong) to 10 (perfect). "
        "Reply with one line: Score: <number>"),
}
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def is_template_file(spec: str) -> bool:
    return "{" not in spec and spec.endswith(".txt")


def template_problem(spec: str) -> str | None:
    """What a judge template must be, where `spec` is not one, judged from its value alone (a
    `.txt` file passes here and is checked by `load_template`); None where it is fine."""
    if spec in TEMPLATES or is_template_file(spec):
        return None
    missing = [p for p in ("{prompt}", "{response}") if p not in spec]
    if missing:
        return (f"a built-in judge template ({', '.join(TEMPLATES)}), a .txt file, or a template holding "
                f"{{prompt}} and {{response}} (this one lacks {' and '.join(missing)})")
    try:
        spec.format(prompt="", response="")
    except (KeyError, IndexError, ValueError) as e:
        return f"a template whose only fields are {{prompt}} and {{response}} (write {{{{ and }}}} for braces; {e!r})"
    return None


def load_template(spec: str) -> str:
    """The template `spec` names ("Template"); RewardLoadError (one line) for an unreadable or bad file."""
    from rewards.api import RewardLoadError

    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if not is_template_file(spec):
        return spec
    try:
        text = Path(spec).read_text()
    except OSError as e:
        raise RewardLoadError(f"judge template file '{spec}' cannot be read: {e.strerror}") from None
    problem = template_problem(text)
    if problem:
        raise RewardLoadError(f"judge template file '{spec}' is not {problem}")
    return text


def judge_name(spec: str, judge_model: str = "") -> str:
    """The name of a judge's metrics, `reward/<name>/mean`: `judge_`, the template's name (`inline`
    for one written in the recipe) and the judge model's folder name when it has its own."""
    base = spec if spec in TEMPLATES else Path(spec).stem if is_template_file(spec) else "inline"
    name = f"judge_{base}" + (f"_{Path(judge_model).name}" if judge_model else "")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def parse_score(text: str) -> float | None:
    """The score a judge wrote, normalised to [0, 1]; None where it wrote none in range ("Parsing")."""
    numbers = _SCORE.findall(text) or _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1])
    return value / MAX_SCORE if 0.0 <= value <= MAX_SCORE else None
