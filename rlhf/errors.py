"""The one base class for failures that end a run with a single line.

A `RunError` is what the run itself detected and can explain (a save that found the disk full, a
loss that stayed NaN, a resume that does not fit the checkpoint): the entry scripts print its
message as one `error:` line (no traceback; details go to the log files) followed by where to
resume, and exit 1. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run-ending failure whose message is one line naming the cause and the next action."""
