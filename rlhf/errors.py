"""The one-line errors that modules across rlhf/ raise, in a module that imports nothing of ours.

Any module can raise them without importing the config or the checkpoint code, which is what
keeps rlhf/ free of import circles (`tests/unit/test_layering.py` checks it). The entry scripts print
each as one `error:` line with no traceback (details go to the log files): a `ConfigError` or a
`CheckpointError` before the run starts exits 2, a `RunError` during it exits 1 after saying where
to resume. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad key, type or value in a recipe or an override. The message is one line; `key` is the
    dotted key it is about (when one is), so that `load_config` can name the recipe line it is on."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded: damaged, foreign or unreadable. The message is one line."""


class RunError(RuntimeError):
    """A run-ending failure whose message is one line naming the cause and the next action."""
