"""Group-relative advantages: hand-computed values, constant groups, Dr.GRPO, bad inputs."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algo.advantages import grpo_advantages


def test_two_groups_of_four_hand_computed():
    # Group 1: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 1/sqrt(3),
    # so A = +-0.5 * sqrt(3) = +-0.8660254. Group 2 is constant: exactly 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = grpo_advantages(rewards, 4, eps=0.0)
    h = math.sqrt(3) / 2
    assert_close(a, torch.tensor([h, -h, -h, h, 0.0, 0.0, 0.0, 0.0]))
    assert a.dtype == torch.float32


def test_eps_is_added_to_std():
    # rewards [3, 1, 2]: mean 2, deviations [1, -1, 0], unbiased std = sqrt(2 / 2) = 1.
    a = grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, eps=0.5)
    assert_close(a, torch.tensor([1 / 1.5, -1 / 1.5, 0.0]))


def test_dr_grpo_only_centers():
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 6.0])
    a = grpo_advantages(rewards, 3, scale_by_std=False)
    assert_close(a, torch.tensor([1.0, -1.0, 0.0, -2.0, -2.0, 4.0]))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_constant_groups_are_exact_zeros_not_nan(scale_by_std):
    # mean(0.1, 0.1, 0.1) != 0.1 in floating point; the residue must not leak out as an advantage.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 0.0, 0.0, 1e6, 1e6, 1e6], dtype=torch.float64)
    a = grpo_advantages(rewards, 3, scale_by_std=scale_by_std, eps=0.0)
    assert torch.equal(a, torch.zeros(9))


def test_group_size_two():
    # Two samples: deviations +-d/2, unbiased std = |d| / sqrt(2) -> A = +-1/sqrt(2).
    a = grpo_advantages(torch.tensor([5.0, 1.0]), 2, eps=0.0)
    assert_close(a, torch.tensor([1.0, -1.0]) / math.sqrt(2))


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.zeros(7), 4, "not a multiple"),
        (torch.zeros(4), 1, "group_size must be >= 2"),
        (torch.zeros(4), 0, "group_size must be >= 2"),
        (torch.zeros(2, 4), 4, "flat"),
    ],
)
def test_bad_inputs_raise(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        grpo_advantages(rewards, group_size)
