"""A run's folder and what it reports: checkpoints and their signatures, the output folder's
checks, metrics.jsonl with its trackers, and the plots drawn from it; and what a launch checks
before any actor starts, beyond the config's values (`preflight`)."""
