"""Group-relative advantages for GRPO.

Decisions, in order:
- One advantage per completion: a scalar shared by all its tokens (outcome reward, no critic).
- Group baseline: the mean reward of the completion's own group (the other samples of the same
  prompt), so no value model is trained.
- Std scaling: `scale_by_std=True` divides by the group's *unbiased* standard deviation (Bessel,
  N - 1), the same estimator as TRL 1.16 `GRPOTrainer._generate_and_score_completions`
  (`Tensor.std` with its default correction). `scale_by_std=False` is Dr.GRPO (Liu et al. 2025):
  dividing by the std up-weights near-uniform groups, which biases the update towards easy and
  hopeless prompts.
- Constant groups: a group whose rewards are all equal carries no learning signal, so its
  advantages are exactly 0. This is enforced explicitly, because `r - mean(r)` is not exactly 0 in
  floating point (mean(0.1, 0.1, 0.1) != 0.1) and a tiny residue divided by `eps` would be a large
  advantage.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of each completion relative to its group.

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     scale_by_std=True  (GRPO)
        A_i =  r_i - mean_g(r)                          scale_by_std=False (Dr.GRPO)

    std_g is the unbiased (N - 1) standard deviation of group g; A_i = 0 for every completion of
    a group whose rewards are all equal.

    Args:
        rewards: [num_prompts * group_size] float, groups contiguous: rewards[i*G:(i+1)*G] are
            the G completions of prompt i.
        group_size: G, completions per prompt (>= 2: a single sample has no baseline).
        scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std so that near-constant groups stay finite.

    Returns:
        [num_prompts * group_size] float32 advantages, same order as `rewards`.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [num_prompts * group_size] tensor, got shape "
                         f"{tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (advantages compare samples of a group), "
                         f"got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} elements, which is not a multiple of "
                         f"group_size={group_size}")
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    # Exact zeros for constant groups (see "Constant groups" in the module docstring).
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return centered.masked_fill(constant, 0.0).view(-1)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_prompts] bool: True for the groups whose rewards are not all equal, the only ones with a
    non-zero advantage ("Constant groups"); DAPO's dynamic sampling keeps these (rlhf.sampling)."""
    grouped = rewards.float().view(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)
