"""The algorithm math: pure tensor functions and the picklable objectives the learners call.

advantages (GRPO group-relative), losses (GRPO/DPO/SimPO), logprobs (token log-probs, packed rows,
the fused head), objectives (a loss as a frozen dataclass). Imports nothing from the loops.
"""
