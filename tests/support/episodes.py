"""A scripted generator and prompts for the multi-turn episode tests (rlhf.env.episodes, tools)."""

from __future__ import annotations

import re

from rlhf.types import Completion


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


# What sample k of a group writes at turn t (its first turn carries `k=<k>` so later turns find it).
SCRIPT = {
    0: ["The answer is 5."],                                                   # answers at once
    1: [call("add", '{"a": 2, "b": 3}'), "The answer is 5."],                   # one call, then answers
    2: ["<tool_call>{not json</tool_call>", call("search", '{"q": 1}'),          # bad JSON, unknown tool,
        call("add", '{"x": 1}'), "The answer is 5."],                           # wrong arguments
    3: [call("add", '{"a": 1, "b": 1}')] * 10,                                  # never stops calling
}


class ScriptedGenerator:
    """Generator whose turns come from SCRIPT; log-prob of token id t is -t/1000 (checkable)."""

    def __init__(self, tok, script=SCRIPT):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompt_ids, sampling):
        self.calls.append(([list(p) for p in prompt_ids], sampling))
        out = []
        for p in prompt_ids:
            text = self.tok.decode(p)
            turn = text.count("<|im_start|>assistant") - 1
            for k in range(sampling.n):
                if turn > 0:
                    k = int(re.search(r"k=(\d)", text).group(1))
                body = self.script[k][min(turn, len(self.script[k]) - 1)]
                ids = self.tok.encode((f"k={k} " if turn == 0 else "") + body, add_special_tokens=False)
                ids.append(self.tok.eos_token_id)
                finish = "stop"
                if len(ids) > sampling.max_new_tokens:
                    ids, finish = ids[: sampling.max_new_tokens], "length"
                out.append(Completion(ids, [-t / 1000 for t in ids], finish))
        return out

    def last_metrics(self):
        return {"gen/engine0_tokens": 10.0, "gen/engine0_s": 1.0, "gen/engine_time_ratio": 1.0}


def prompt_ids(tok, question):
    """The token ids of `question` as a one-message chat, ready for the assistant's turn."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)
