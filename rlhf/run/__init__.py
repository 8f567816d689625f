"""A run's folder and what it reports: checkpoints and their signatures, the output folder's
checks, metrics.jsonl with its trackers, and the plots drawn from it."""
