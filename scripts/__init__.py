"""The entry points and the driver's composition of a run (importable, for the `rlhf` command).

train_grpo, train_dpo, evaluate, plan (one script per job), launch (the command line, dtype and
memory-plan settling, the run folder, a Ray session that always ends), console (what the terminal
shows, the `ray.init` arguments), cli (the `rlhf` command: `rlhf train|dpo|plan|eval|submit`).
"""
