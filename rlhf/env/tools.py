"""Tools a model calls while it reasons: plain typed functions, named by spec like rewards.

    def calculator(expression: str) -> str        # `rlhf.env.tools:calculator`
    env.tools: [rlhf.env.tools:calculator, rlhf.env.tools:python, my_tools.py:lookup]

Decisions:
- Tools are functions: a tool is `fn(**arguments) -> str` (anything else is turned into `str`); its
  name is the function's name. Specs load through the reward loader (`rewards.api.load_function`),
  so a bad spec is the same one-line error before start-up, as a `ConfigError` naming `env.tools`.
- Call format: the Qwen2.5/Hermes convention,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the model's turn, several
  per turn allowed, run in order.
- Nothing crashes the run: bad JSON, an unknown tool, wrong arguments or a tool
  that raises become an error observation (`error: ...`) the model reads next turn, counted by
  cause; a call that outlives `timeout_s` is cut and answered `error: timed out`. Tools run on a
  daemon thread so the wait can be cut; the thread of a hung pure-Python tool is left behind
  (it cannot be killed, and it does not hold up the run's exit). The built-in `python` tool runs
  in a child process that is killed at the limit, inside the run's `env.sandbox` boundary
  (rlhf.env.sandbox: its own namespaces by default), so it leaves nothing behind.
- Time limits: a tool that declares a keyword-only `timeout_s` parameter receives the configured
  limit (whatever the model passed), so its own limit and the wait agree.
- Output cut: outputs are cut to `max_output_chars` here, for every tool.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rewards.api import RewardLoadError, load_function
from rlhf.errors import ConfigError
from rlhf.env.sandbox import SandboxLimits, cut, run_python

ToolFn = Callable[..., Any]

# ---------------------------------------------------------------------------------------------
# Built-in tools.

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log,
              "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan, "floor": math.floor,
              "ceil": math.ceil, "factorial": math.factorial, "gcd": math.gcd}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_MAX_POWER = 10_000  # exponents above this would let `9**9**9` eat the CPU


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, pi, e and
    sqrt/abs/round/min/max/log/exp/sin/cos/tan/floor/ceil/factorial/gcd. Parsed with `ast`,
    never `eval`: names, attributes and anything else are refused."""
    return _number(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POWER})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        if node.func.id == "factorial" and _evaluate(node.args[0]) > 1000:
            raise ValueError("factorial argument is too large (at most 1000)")
        return _FUNCTIONS[node.func.id](*(_evaluate(a) for a in node.args))
    raise ValueError(f"unsupported expression: {ast.unparse(node)}")


def _number(value: float | int) -> str:
    """Integers as integers (`6`, not `6.0`), other floats with Python's shortest repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def python(code: str, *, timeout_s: float = 5.0) -> str:
    """Run a Python script (standard library only) in a sandboxed child process and return what it
    prints (rlhf.env.sandbox: time, CPU, memory limits, no network, no files outside its own folder)."""
    limits = SandboxLimits(wall_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)))
    result = run_python(code, limits)
    return result.output if result.output.strip() else f"(no output, exit status {result.returncode})"


# ---------------------------------------------------------------------------------------------
# Calls: parsing and running.


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `error` is set (and name/arguments may be empty) when the call is malformed."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` of a model turn, in order ("Call format"); a call that is not
    a JSON object with a string `name` and an object `arguments` comes back with `error` set."""
    calls = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"invalid JSON in tool call ({e.msg})"))
            continue
        name = data.get("name") if isinstance(data, dict) else None
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            shape = 'a tool call must be {"name": str, "arguments": {...}}'
            calls.append(ToolCall(str(name or ""), {}, shape))
        else:
            calls.append(ToolCall(name, arguments))
    return calls


@dataclass(frozen=True)
class ToolResult:
    """A call's observation text and how it went: `ok`, `error` (the model's mistake or the tool's
    exception) or `timeout`."""

    text: str
    status: str


class ToolBox:
    """The configured tools by name, run with a time limit and a cut output ("Nothing crashes the run",
    "Time limits", "Output cut")."""

    def __init__(self, tools: dict[str, ToolFn], *, timeout_s: float = 10.0,
                 max_output_chars: int = 2000) -> None:
        self.tools, self.timeout_s, self.max_output_chars = tools, timeout_s, max_output_chars

    @classmethod
    def from_specs(cls, specs: list[str] | tuple[str, ...], **limits: Any) -> ToolBox:
        """Load every spec ("Tools are functions"); a spec that fails is a one-line ConfigError naming
        `env.tools`."""
        return cls(load_tools(specs), **limits)

    def run(self, call: ToolCall) -> ToolResult:
        """The observation for one call; never raises for anything the model wrote."""
        if call.error:
            return ToolResult(f"error: {call.error}", "error")
        fn = self.tools.get(call.name)
        if fn is None:
            known = ", ".join(sorted(self.tools))
            return ToolResult(f"error: unknown tool {call.name!r} (tools: {known})", "error")
        arguments = dict(call.arguments)
        if _takes_timeout(fn):
            arguments["timeout_s"] = self.timeout_s
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return ToolResult(f"error: wrong arguments for {call.name}: {e}", "error")
        except ValueError:  # no signature to check: let the call say
            pass
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["out"] = fn(**arguments)
            except Exception as e:  # the tool's own failure, shown to the model
                outcome["error"] = e

        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s + 1.0)  # a little over: a tool enforcing `timeout_s` reports its own cut
        if thread.is_alive():
            return ToolResult(f"error: {call.name} timed out after {self.timeout_s:g}s", "timeout")
        if "error" in outcome:
            e = outcome["error"]
            return ToolResult(f"error: {type(e).__name__}: {cut(str(e), 300)}", "error")
        text = cut(str(outcome["out"]), self.max_output_chars)
        return ToolResult(text, "timeout" if "[killed: wall-clock limit" in text else "ok")


def _takes_timeout(fn: ToolFn) -> bool:
    try:
        param = inspect.signature(fn).parameters.get("timeout_s")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def load_tools(specs: list[str] | tuple[str, ...]) -> dict[str, ToolFn]:
    """name -> function for each spec; a bad spec or two tools of one name is a ConfigError."""
    tools: dict[str, ToolFn] = {}
    for i, spec in enumerate(specs):
        try:
            fn = load_function(spec, kind="tool")
        except RewardLoadError as e:
            raise ConfigError(f"env.tools[{i}]: {e}", key="env.tools") from None
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in tools:
            raise ConfigError(f"env.tools[{i}]: two tools are named {name!r}", key="env.tools")
        tools[name] = fn
    return tools


def describe_tools(tools: dict[str, ToolFn]) -> str:
    """One line per tool, `name(signature): first docstring sentence`, for a system prompt that tells
    the model which tools it has and how to call them."""
    lines = ['Call a tool by writing <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>; '
             "its output comes back in the next message. Tools:"]
    for name, fn in tools.items():
        params = inspect.signature(fn, eval_str=True).parameters.values()
        params = [p for p in params if p.name != "timeout_s"]
        shown = [p.name if p.annotation is p.empty
                 else f"{p.name}: {getattr(p.annotation, '__name__', p.annotation)}" for p in params]
        paragraph = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
        doc = paragraph.split(". ")[0].rstrip(".") + "." if paragraph else ""  # its first sentence
        lines.append(f"- {name}({', '.join(shown)}): {doc}")
    return "\n".join(lines)
