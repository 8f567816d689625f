"""Micro-batches by token budget: the bins (hand-computed), and the same loss and gradients as
fixed micro-batches on a tiny model (GRPO rows and DPO pairs); rollouts to a padded batch, by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf.algo.objectives import DPOObjective, GRPOObjective
from rlhf.data.batching import micro_batch_items, micro_batches, pairs_to_batch
from rlhf.types import PreferencePair, TrainBatch
from tests.support.learners import ragged_batch


def _rows(lengths: list[int], vocab: int = 100, prompt: int = 2, seed: int = 0) -> TrainBatch:
    return ragged_batch(lengths, vocab=vocab, prompt=prompt, seed=seed)


def test_token_budget_bins_hand_computed():
    batch = _rows([9, 7, 12, 5, 10, 3])
    # longest first: 12(2) 10(4) 9(0) 7(1) 5(3) 3(5); budget 24 = rows x longest of the bin
    # [12, 10]: 2 x 12 = 24 | [9, 7]: 2 x 9 = 18 (adding 5 -> 27) | [5, 3]: 10
    assert [b.tolist() for b in micro_batch_items(batch, size=2, max_tokens=24)] == [[2, 4], [0, 1], [3, 5]]
    # an item longer than the budget goes alone; a generous budget takes everything in one pass
    assert [b.tolist() for b in micro_batch_items(batch, size=2, max_tokens=10)] == [[2], [4], [0], [1], [3, 5]]
    assert [b.tolist() for b in micro_batch_items(batch, size=2, max_tokens=1000)] == [[0, 1, 2, 3, 4, 5]]
    # fixed: consecutive runs of `size`
    assert [b.tolist() for b in micro_batch_items(batch, size=4)] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("budget", [10, 24, 40])
def test_token_budget_covers_every_row_once_within_budget(budget):
    lengths = [int(x) for x in torch.randint(2, 30, (40,), generator=torch.Generator().manual_seed(1))]
    batch = _rows(lengths)
    parts = micro_batches(batch, size=8, max_tokens=budget)
    assert sorted(i for items, _ in parts for i in items.tolist()) == list(range(40))
    for items, mb in parts:
        assert mb.input_ids.shape[1] == max(lengths[i] for i in items.tolist())  # trimmed to its longest
        assert len(items) == 1 or mb.input_ids.numel() <= budget
        assert torch.equal(mb.input_ids, batch.input_ids[items, : mb.input_ids.shape[1]])


def test_token_budget_keeps_pairs_together():
    pairs = [PreferencePair(prompt_ids=[5] * 2, chosen_ids=[6] * c, rejected_ids=[7] * r)
             for c, r in [(3, 9), (2, 2), (8, 1), (4, 4)]]
    batch = pairs_to_batch(pairs, pad_id=0)
    # pair lengths (longest row): 11, 4, 10, 6; two rows a pair: [11, 10] = 2 x 2 x 11 = 44 <= 48
    items = micro_batch_items(batch, size=2, max_tokens=48)
    assert [b.tolist() for b in items] == [[0, 2], [1, 3]]
    _, mb = micro_batches(batch, size=2, max_tokens=48)[1]
    assert mb.input_ids[0].tolist()[:4] == [5, 5, 6, 6] and mb.input_ids[2].tolist()[:4] == [5, 5, 7, 7]


def _grads(model, batch, parts, objective) -> tuple[float, dict[str, torch.Tensor]]:
    """Accumulate the loss of every micro-batch (normalised by the whole batch's units), as the learners do."""
    from rlhf.algo.logprobs import token_logprobs

    model.zero_grad()
    denominator = float(objective.num_units(batch))
    total = 0.0
    for mb in parts:
        lp = token_logprobs(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits,
                            mb.input_ids, mb.loss_mask)
        loss, _ = objective(lp, mb, denominator)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["grpo-token-mean", "grpo-seq-mean-token-mean", "dpo"])
def test_token_budget_gives_the_gradients_of_fixed_micro_batches(tiny_qwen2, kind):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    if kind == "dpo":
        g = torch.Generator().manual_seed(2)
        pairs = [PreferencePair(prompt_ids=torch.randint(3, 200, (p,), generator=g).tolist(),
                                chosen_ids=torch.randint(3, 200, (c,), generator=g).tolist(),
                                rejected_ids=torch.randint(3, 200, (r,), generator=g).tolist())
                 for p, c, r in [(4, 6, 2), (3, 9, 5), (5, 2, 2), (2, 7, 8), (6, 3, 4)]]
        batch = pairs_to_batch(pairs, pad_id=0)
        batch.ref_chosen_logps, batch.ref_rejected_logps = torch.randn(5, generator=g), torch.randn(5, generator=g)
        objective = DPOObjective(beta=0.1, loss_type="sigmoid")
    else:
        batch = _rows([9, 7, 12, 5, 10, 3, 14, 6], vocab=200)
        objective = GRPOObjective(loss_agg=kind.removeprefix("grpo-"))
    fixed = [mb for _, mb in micro_batches(batch, size=2)]
    budget = [mb for _, mb in micro_batches(batch, size=2, max_tokens=30)]
    assert len(budget) != len(fixed) or any(not torch.equal(a.input_ids, b.input_ids) for a, b in zip(budget, fixed))
    loss_fixed, grads_fixed = _grads(model, batch, fixed, objective)
    loss_budget, grads_budget = _grads(model, batch, budget, objective)
    assert loss_budget == pytest.approx(loss_fixed, abs=1e-5)
    for name, g in grads_fixed.items():
        torch.testing.assert_close(grads_budget[name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_rollouts_to_batch_pads_rows_and_places_the_sampler_logprobs():
    """Rollout i is prompt i // G then completion i, right-padded; the loss mask and the sampler's
    log-probs cover the completion (of a multi-turn episode, its model tokens), by hand."""
    from rlhf.data.batching import rollouts_to_batch
    from rlhf.types import Completion, RolloutBatch

    completions = [Completion([7, 8], [-0.5, -0.25], "stop"), Completion([9], [-1.0], "length"),
                   Completion([4, 5, 6], [-0.1, -0.2, -0.3], "stop", mask=[True, False, True]),
                   Completion([3], [-2.0], "stop")]
    rollouts = RolloutBatch(rows=[None, None], prompt_ids=[[1, 2], [11]], completions=completions, group_size=2)
    batch = rollouts_to_batch(rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 7, 8], [1, 2, 9, 0], [11, 4, 5, 6], [11, 3, 0, 0]]
    assert batch.attention_mask.tolist() == [[True] * 4, [True, True, True, False], [True] * 4,
                                             [True, True, False, False]]
    assert batch.loss_mask.tolist() == [[False, False, True, True], [False, False, True, False],
                                        [False, True, False, True], [False, True, False, False]]
    assert batch.sampler_logprobs.tolist() == [[0.0, 0.0, -0.5, -0.25], [0.0, 0.0, -1.0, 0.0],
                                               [0.0, pytest.approx(-0.1), pytest.approx(-0.2), pytest.approx(-0.3)],
                                               [0.0, -2.0, 0.0, 0.0]]
    assert batch.advantages.dtype == torch.float32 and batch.advantages.tolist() == [1.0, -1.0, 0.5, -0.5]
    assert batch.input_ids.dtype == torch.long and batch.sampler_logprobs.dtype == torch.float32


def test_flat_tensor_concatenates_lists_in_order():
    import numpy as np

    from rlhf.data.batching import flat_tensor

    ids = flat_tensor([[1, 2], [], [3]], np.int64)
    assert ids.dtype == torch.long and ids.tolist() == [1, 2, 3]
    assert flat_tensor([[-0.5], [0.25]], np.float32).tolist() == [-0.5, 0.25]
    assert flat_tensor([], np.float32).shape == (0,)
