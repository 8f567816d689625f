"""Tools (rlhf.env.tools) and the sandbox of the `python` tool (rlhf.env.sandbox): each limit is checked
by a test that would fail without it, in both modes of `env.sandbox`; the mode reaches the code of
tools and of one's own environment, and a run refuses to start where the `os` mode cannot be made.
What gets out of each mode: tests/unit/test_sandbox_escapes.py."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from rlhf.config import ConfigError, EnvConfig, config_from_dict
from rlhf.env import sandbox
from rlhf.env.episodes import EpisodeSampler
from rlhf.env.sandbox import SandboxLimits, SandboxUnavailable, current_mode, run_python
from rlhf.env.tools import ToolBox, ToolCall, calculator, describe_tools, load_tools, parse_tool_calls, python
from rlhf.run.preflight import check_files, check_sandbox
from rlhf.types import PromptRow, SamplingSpec

ROOT = Path(__file__).resolve().parents[2]
CODE_ENV = ROOT / "tests" / "fixtures" / "code_env.py"


@pytest.fixture(params=["os", "audit_hook"])
def mode(request, monkeypatch) -> str:
    """A test under both modes, each made the run's (process-wide: restored after the test)."""
    monkeypatch.setattr(sandbox, "_mode", request.param)
    return request.param


# ---- sandbox ------------------------------------------------------------------------------------

@pytest.mark.usefixtures("mode")
def test_sandbox_runs_code_and_keeps_its_own_files():
    r = run_python("open('a.txt', 'w').write('kept'); print(open('a.txt').read(), 6 * 7)")
    assert r.returncode == 0 and r.output.strip() == "kept 42"


@pytest.mark.usefixtures("mode")
def test_sandbox_cannot_open_a_socket():
    r = run_python("import socket\ns = socket.socket()\nprint('opened')")
    assert "opened" not in r.output and "PermissionError" in r.output


@pytest.mark.usefixtures("mode")
def test_sandbox_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')")
    assert not target.exists() and "wrote" not in r.output and "PermissionError" in r.output


@pytest.mark.usefixtures("mode")
def test_sandbox_cannot_read_the_runs_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("run-private-contents")
    r = run_python(f"print(open({str(secret)!r}).read())")
    assert "run-private-contents" not in r.output and "PermissionError" in r.output


@pytest.mark.usefixtures("mode")
def test_sandbox_cannot_read_an_environment_variable_of_the_run(monkeypatch):
    monkeypatch.setenv("RLHF_TEST_SECRET", "s3cr3t-value-828")
    code = ("import os\nprint(dict(os.environ))\n"
            "try:\n    print(open(f'/proc/{os.getppid()}/environ').read())\n"
            "except Exception as e:\n    print(e)")
    r = run_python(code)
    assert "s3cr3t-value-828" not in r.output and "HOME" in r.output


@pytest.mark.usefixtures("mode")
def test_sandbox_busy_loop_is_killed_at_its_limit():
    out = python("while True:\n    pass", timeout_s=1.0)  # unlimited, it never returns
    assert "[killed" in out


@pytest.mark.usefixtures("mode")
def test_sandbox_sleeping_code_is_killed_at_the_wall_clock_limit():
    r = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0, cpu_s=5))
    assert r.timed_out  # unlimited: it sleeps its 60 s and ends on its own


@pytest.mark.usefixtures("mode")
def test_sandbox_output_is_truncated():
    r = run_python("print('x' * 100_000)", SandboxLimits(max_output_chars=500))
    assert len(r.output) < 600 and "truncated" in r.output


@pytest.mark.usefixtures("mode")
def test_sandbox_cannot_start_a_process():
    r = run_python("import subprocess\n"
                   "print(subprocess.run(['echo', 'ran'.upper()], capture_output=True).stdout)")
    assert "RAN" not in r.output and "PermissionError" in r.output


# ---- calculator ---------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,value", [("2 + 3 * 4", "14"), ("(1 + 5) / 4", "1.5"),
                                        ("sqrt(16) + 2**3", "12"),
                                        ("-7 // 2", "-4"), ("max(3, 9) % 4", "1")])
def test_calculator_evaluates_arithmetic(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('ls')", "(1).__class__", "9 ** 9 ** 9", "x + 1",
                                  "open('f')"])
def test_calculator_refuses_everything_else(expr):
    with pytest.raises(ValueError):
        calculator(expr)


# ---- calls --------------------------------------------------------------------------------------

def test_parse_tool_calls_hermes_convention():
    text = ('first <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> then '
            '<tool_call>{bad json}</tool_call><tool_call>["not", "an", "object"]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert calls[1].error and "invalid JSON" in calls[1].error
    assert calls[2].error
    assert parse_tool_calls("no calls here") == []


def hang() -> str:
    time.sleep(30)
    return "never"


def explode(x: int) -> str:
    raise RuntimeError(f"boom {x}")


def test_toolbox_turns_every_bad_call_into_an_error_observation():
    box = ToolBox({"calculator": calculator, "explode": explode, "hang": hang}, timeout_s=0.5,
                  max_output_chars=20)
    assert box.run(ToolCall("calculator", {"expression": "6*7"})).text == "42"
    results = {
        "unknown": box.run(ToolCall("search", {"q": "x"})),
        "wrong args": box.run(ToolCall("calculator", {"expr": "1"})),
        "bad json": box.run(parse_tool_calls("<tool_call>{</tool_call>")[0]),
        "raises": box.run(ToolCall("explode", {"x": 3})),
        "bad expression": box.run(ToolCall("calculator", {"expression": "import os"})),
    }
    assert all(r.status == "error" and r.text.startswith("error:") for r in results.values()), results
    assert "unknown tool 'search'" in results["unknown"].text and "boom 3" in results["raises"].text
    hung = box.run(ToolCall("hang", {}))
    assert hung.status == "timeout"  # unlimited: it never returns
    long = box.run(ToolCall("calculator", {"expression": "2**200"}))
    assert long.text.startswith(str(2**200)[:20]) and "truncated" in long.text


@pytest.mark.usefixtures("mode")
def test_python_tool_gets_the_configured_time_limit():
    box = ToolBox({"python": python}, timeout_s=1.0)
    result = box.run(ToolCall("python", {"code": "import time\ntime.sleep(30)", "timeout_s": 1000}))
    assert result.status == "timeout"  # under the call's own 1000 s limit the 30 s sleep would end on its own
    assert box.run(ToolCall("python", {"code": "print(sum(range(10)))"})).text.strip() == "45"


def test_tool_specs_load_or_fail_as_one_config_line():
    tools = load_tools(["rlhf.env.tools:calculator", "rlhf.env.tools:python"])
    assert list(tools) == ["calculator", "python"]
    assert "calculator(expression: str)" in describe_tools(tools)
    # the first sentence whole, though the docstring wraps it over two lines
    assert ("- calculator(expression: str): Evaluate an arithmetic expression: numbers, + - * / // % **, "
            "parentheses, pi, e and sqrt/abs/round/min/max/log/exp/sin/cos/tan/floor/ceil/factorial/gcd.\n") in describe_tools(tools)
    twice = ["rlhf.env.tools:calculator", "rlhf.env.tools:calculator"]
    for bad in (["rlhf.env.tools:nope"], ["no_such_module_xyz:fn"], twice):
        with pytest.raises(ConfigError) as e:
            load_tools(bad)
        assert "\n" not in str(e.value) and "env.tools[" in str(e.value)
    with pytest.raises(ConfigError, match="env.tools"):
        check_files(config_from_dict({"env": {"tools": ["rlhf.env.tools:nope"]}}))


@pytest.mark.parametrize("key,value", [("max_turns", 0), ("tool_timeout_s", 0), ("max_tool_output_chars", 0),
                                       ("tools", ["no-colon"]), ("sandbox", "docker")])
def test_env_config_is_validated(key, value):
    with pytest.raises(ConfigError, match=f"env.{key}"):
        config_from_dict({"env": {key: value}})


@pytest.mark.usefixtures("mode")
def test_sandbox_memory_is_limited():
    r = run_python("x = bytearray(1024 ** 3)\nprint('allocated'.upper())", SandboxLimits(memory_mb=256))
    assert "ALLOCATED" not in r.output and "MemoryError" in r.output


@pytest.mark.usefixtures("mode")
def test_sandbox_limits_cannot_be_raised_by_the_code():
    r = run_python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (-1, -1))\n"
                   "print('raised'.upper())")
    assert "RAISED" not in r.output


# ---- env.sandbox: which boundary, and no silent downgrade ----------------------------------------

def test_the_configured_mode_reaches_the_code_of_ones_own_environment(mode):
    """`env.environment`'s code runs through the same runner, under the run's `env.sandbox`; the
    metrics say which mode ran."""
    from rlhf.data.tiny_models import build_tokenizer
    from tests.support.episodes import ScriptedGenerator, prompt_ids

    tok = build_tokenizer()
    script = {0: ["```python\nprint(2 + 3)\n```"], 1: ["```python\nprint(open('/etc/hostname').read())\n```"]}
    sampler = EpisodeSampler.from_config(EnvConfig(environment=f"{CODE_ENV}:RunCode", sandbox=mode),
                                         ScriptedGenerator(tok, script), tok)
    assert current_mode() == mode
    row = PromptRow(prompt="What is 2 + 3?", answer="5")
    completions, metrics = sampler([row], [prompt_ids(tok, row.prompt)], SamplingSpec(n=2, max_new_tokens=200))
    assert [c.reward for c in completions] == [1.0, 0.0]
    assert metrics["env/sandbox_isolated"] == (1.0 if mode == "os" else 0.0)


@pytest.fixture
def no_isolation(monkeypatch):
    """This machine as one without user namespaces (a container that forbids them)."""
    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "bwrap cannot isolate the code here (test)")


def test_the_os_mode_never_runs_code_with_less(no_isolation):
    with pytest.raises(SandboxUnavailable, match="env.sandbox=audit_hook"):
        run_python("print(1)", mode="os")
    assert run_python("print(1)", mode="audit_hook").output == "1\n"  # accepted by name only
    tools = EnvConfig(tools=("rlhf.env.tools:python",))
    with pytest.raises(ConfigError) as e:
        check_sandbox(tools)
    assert e.value.key == "env.sandbox" and "\n" not in str(e.value) and "(test)" in str(e.value)
    check_sandbox(EnvConfig(tools=("rlhf.env.tools:python",), sandbox="audit_hook"))
    check_sandbox(EnvConfig())  # no tool, no environment: nothing runs code


def _train_grpo_main():
    spec = importlib.util.spec_from_file_location("_sandbox_train_grpo", ROOT / "scripts" / "train_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_a_run_that_cannot_isolate_its_tools_refuses_to_start_in_one_line(mode, no_isolation, capsys, monkeypatch,
                                                                          tmp_path):
    """Exit status 2 and one line naming the reason and the key, before Ray starts; with the weaker
    mode chosen by name the run starts and its header says which mode is on."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.chdir(ROOT)
    argv = ["--config", "configs/grpo_tiny_cpu.yaml", "env.tools=[rlhf.env.tools:python]",
            f"output_dir={tmp_path / 'out'}", f"env.sandbox={mode}"]
    if mode == "os":
        assert _train_grpo_main()(argv) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: env.sandbox=os: "), lines
        assert "(test)" in lines[0] and "env.sandbox=audit_hook" in lines[0]
    else:
        with pytest.raises(AssertionError, match="Ray was started"):
            _train_grpo_main()(argv)
        assert "sandbox: audit_hook (tool and environment code: an audit hook only, NOT a security boundary)" \
            in capsys.readouterr().out


def test_the_probe_says_why_the_boundary_cannot_be_made(mode, monkeypatch, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    monkeypatch.setenv("PATH", str(fake))
    sandbox._bwrap.cache_clear()
    sandbox.isolation_problem.cache_clear()
    try:
        assert sandbox.isolation_problem() == "bwrap is not installed (Debian/Ubuntu package: bubblewrap)"
        sandbox._bwrap.cache_clear()
        sandbox.isolation_problem.cache_clear()
        bwrap = fake / "bwrap"  # as in a container that forbids user namespaces
        bwrap.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
        bwrap.chmod(0o755)
        assert sandbox.isolation_problem() == ("bwrap cannot isolate the code here "
                                               "(bwrap: setting up uid map: Permission denied)")
    finally:
        sandbox._bwrap.cache_clear()  # the next caller probes this machine again
        sandbox.isolation_problem.cache_clear()
