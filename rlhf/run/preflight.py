"""What a launch checks beyond the config's values, before any actor starts: the files the config
names and the user code it loads.

Validation of values (rlhf/config_checks.py) stays pure: it reads no file and imports no user
module, so building a `RunConfig` never runs anyone's code. The launch path calls `check_files`
once, after the config is settled and before Ray starts, so that a missing file or a tool that
does not import is one `error:` line instead of a traceback from inside an actor.
"""

from __future__ import annotations

from pathlib import Path

from rlhf.config import EnvConfig, LearnerConfig, RunConfig
from rlhf.data.model_folder import read_json_object
from rlhf.env.sandbox import refusal
from rlhf.env.tools import load_tools
from rlhf.errors import ConfigError


def check_files(c: RunConfig) -> None:
    """The files and code the config names that nothing else reads before Ray starts: `env.tools`
    and `env.environment`, each spec imported; with `env.sandbox=os`, the boundary their code runs
    in made once (`check_sandbox`); `learner.deepspeed_config`, read by every DeepSpeed learner
    rank in its constructor. Each failure is a one-line ConfigError naming the key."""
    if c.env.tools:
        load_tools(c.env.tools)
    if c.env.environment:
        from rlhf.env.episodes import load_environment  # imports torch: only when an environment is named

        load_environment(c.env.environment)
    check_sandbox(c.env)
    check_deepspeed_config(c.learner)


def check_sandbox(e: EnvConfig) -> None:
    """No silent downgrade: a run with tools or an environment and `env.sandbox=os` refuses to start
    where that boundary cannot be made, in one line naming why and `env.sandbox=audit_hook`."""
    if e.sandbox != "os" or not (e.tools or e.environment):
        return
    if message := refusal():
        raise ConfigError(message, key="env.sandbox")


def check_deepspeed_config(learner: LearnerConfig) -> None:
    """`learner.deepspeed_config`, when the DeepSpeed backend reads it, holds a JSON object; a JSON
    error names the file and the line."""
    name = learner.deepspeed_config
    if not name or learner.backend != "deepspeed":
        return
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"learner.deepspeed_config={name!r}: no such file", key="learner.deepspeed_config")
    read_json_object(path, "learner.deepspeed_config")
