"""Fitting a recipe to a GPU: memory (the planner: per-GPU breakdown, candidates, `memory.plan: auto`)
and flops (model FLOPs per token, the numerator of MFU)."""
