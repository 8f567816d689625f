"""The `rlhf` command: one name for the jobs in scripts/ (installed by pyproject.toml).

    rlhf train  --config configs/grpo_tiny_cpu.yaml [key=value ...]    # scripts/train_grpo.py
    rlhf dpo    --config configs/dpo_smollm2_cpu.yaml [key=value ...]  # scripts/train_dpo.py
    rlhf plan   --config RECIPE --gpu h200-141gb [key=value ...]       # scripts/plan.py
    rlhf eval   --config RECIPE [--model FOLDER] [key=value ...]       # scripts/evaluate.py
    rlhf submit configs/RECIPE.yaml [key=value ...]                    # scripts/submit.sh (a Ray Job)

Each subcommand hands the rest of its command line to that script's `main`, so `rlhf train ...`
and `python scripts/train_grpo.py ...` are the same run with the same exit status;
`rlhf <subcommand> --help` lists the script's options. `python -m scripts.cli` is the same command.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

COMMANDS = {
    "train": ("scripts.train_grpo", "train a policy with GRPO"),
    "dpo": ("scripts.train_dpo", "train a policy with DPO (IPO, hinge, robust, SimPO)"),
    "plan": ("scripts.plan", "plan a recipe's memory for a GPU"),
    "eval": ("scripts.evaluate", "pass@k of a model on a recipe's held-out prompts"),
    "submit": ("scripts/submit.sh", "submit a training run to a Ray cluster as a Ray Job"),
}
SUBMIT = Path(__file__).resolve().parent / "submit.sh"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}  ({where})" for name, (where, what) in COMMANDS.items()]
    return "\n".join(["usage: rlhf {" + "|".join(COMMANDS) + "} [options ...]", "", "commands:", *lines,
                      "", "`rlhf <command> --help` shows the options of one."])


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r} (usage: rlhf {{{'|'.join(COMMANDS)}}} ...)", file=sys.stderr)
        return 2
    if from_command_line:  # the script's usage lines then name `rlhf <command>`
        sys.argv = [f"rlhf {name}", *rest]
    if name == "submit":
        os.execvp("bash", ["bash", str(SUBMIT), *rest])  # the script cds to the checkout itself
    return importlib.import_module(COMMANDS[name][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
