"""GRPO / DPO / SimPO losses on tiny hand-computed tensors, micro-batch denominators, extremes,
and the objectives built on them."""

import math
import pickle

import pytest
import torch
from torch.testing import assert_close

from rlhf.algo.losses import aggregate_token_loss, dpo_loss, grpo_policy_loss, kl_estimate, simpo_loss
from rlhf.algo.objectives import DPOObjective, GRPOObjective, PreferenceBatch, reduce_metrics
from rlhf.config import DPOConfig, GRPOConfig
from rlhf.types import TrainBatch

# ---------------------------------------------------------------------------------------------
# GRPO hand example. Clip range [0.8, 1.28] (clip_low 0.2, clip_high 0.28).
#   row 0, A = +1, ratios [1.5, 0.5, 1.0]        row 1, A = -1, ratios [1.1, 0.7, (1.3 masked)]
#   1.5: -min(1.5, 1.28) = -1.28  (clipped)      1.1: -min(-1.1, -1.1) = 1.1
#   0.5: -min(0.5, 0.8)  = -0.5                  0.7: -min(-0.7, -0.8) = 0.8  (clipped)
#   1.0: -1.0                                    1.3: masked out
# per-token = [[-1.28, -0.5, -1.0], [1.1, 0.8, -]]; 5 masked tokens, 2 clipped.
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.7, 1.3]])
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
OLD = torch.full((2, 3), -1.0)


def hand_logprobs() -> torch.Tensor:
    return (OLD + RATIOS.log()).requires_grad_(True)


@pytest.mark.parametrize(
    ("loss_agg", "max_len", "expected"),
    [
        ("token-mean", None, (-1.28 - 0.5 - 1.0 + 1.1 + 0.8) / 5),  # -0.176
        ("seq-mean-token-mean", None, ((-2.78 / 3) + (1.9 / 2)) / 2),  # 0.0116667
        ("seq-mean-token-sum-norm", None, ((-2.78 / 3) + (1.9 / 3)) / 2),  # -0.146667 (max_len = T = 3)
        ("seq-mean-token-sum-norm", 4, ((-2.78 / 4) + (1.9 / 4)) / 2),  # -0.11
    ],
)
def test_grpo_hand_computed_aggregations(loss_agg, max_len, expected):
    loss, metrics = grpo_policy_loss(hand_logprobs(), OLD, ADV, MASK, loss_agg=loss_agg, max_len=max_len)
    assert_close(loss, torch.tensor(expected))
    assert_close(metrics["clip_frac"], torch.tensor(0.4))
    assert_close(metrics["ratio"], torch.tensor((1.5 + 0.5 + 1.0 + 1.1 + 0.7) / 5))
    assert_close(metrics["kl"], torch.tensor(0.0))


def test_grpo_gradient_is_zero_on_clipped_tokens():
    # token-mean: d l_t / d logp_t = -A * r_t / 5 where unclipped, 0 where the clipped term wins
    # (and 0 on masked tokens).
    lp = hand_logprobs()
    loss, _ = grpo_policy_loss(lp, OLD, ADV, MASK.float())
    loss.backward()
    assert_close(lp.grad, torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [1.1 / 5, 0.0, 0.0]]))


@pytest.mark.parametrize(
    ("ratio", "adv", "per_token", "clipped"),
    [
        (1.5, 2.0, -2.0 * 1.28, True),  # above range, A > 0: clipped at 1 + clip_high
        (1.5, -2.0, 2.0 * 1.5, False),  # above range, A < 0: pessimistic min keeps the ratio
        (0.5, 2.0, -2.0 * 0.5, False),  # below range, A > 0: keeps the ratio
        (0.5, -2.0, 2.0 * 0.8, True),  # below range, A < 0: clipped at 1 - clip_low
        (1.0, 0.0, 0.0, False),  # zero advantage: no loss, nothing counted as clipped
    ],
)
def test_grpo_single_token_clip_cases(ratio, adv, per_token, clipped):
    lp = torch.tensor([[math.log(ratio)]])
    loss, m = grpo_policy_loss(lp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1))
    assert_close(loss, torch.tensor(per_token))
    assert m["clip_frac"].item() == float(clipped)


def test_kl_estimators_hand_computed():
    # d = logp - ref = [0.5, -1.0]
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    # k3 = exp(-d) + d - 1 = [e^-0.5 - 0.5, e - 2]
    assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.10653066, 0.71828183]))
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_grpo_kl_penalty_added_per_token():
    # A = 0 so only the KL term remains: token-mean of 0.1 * k3 over the 2 masked tokens.
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, 50.0]])  # masked position holds garbage: must not matter
    mask = torch.tensor([[1, 1, 0]])
    loss, m = grpo_policy_loss(lp, lp, torch.zeros(1), mask, ref_logprobs=ref, kl_coef=0.1)
    assert_close(loss, torch.tensor(0.1 * (0.10653066 + 0.71828183) / 2))
    assert_close(m["kl"], torch.tensor((0.10653066 + 0.71828183) / 2))


def test_grpo_extreme_log_ratios_stay_finite():
    lp = torch.tensor([[200.0, -200.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1e30]])  # masked garbage in old log-probs
    loss, m = grpo_policy_loss(lp, old, torch.tensor([-1.0]), torch.tensor([[1, 1, 0]]),
                               ref_logprobs=torch.zeros(1, 3), kl_coef=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_grpo_entropy_metric_and_token_advantages():
    lp = hand_logprobs()
    token_adv = ADV[:, None].expand(2, 3)
    loss_a, _ = grpo_policy_loss(lp, OLD, ADV, MASK)
    loss_b, m = grpo_policy_loss(lp, OLD, token_adv, MASK, entropy=torch.full((2, 3), 2.0))
    assert_close(loss_a, loss_b)
    assert_close(m["entropy"], torch.tensor(2.0))


def _random_batch(seed: int, B: int = 6, T: int = 7, with_ref: bool = True) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = False
    mask[0, 1:] = True
    return TrainBatch(
        input_ids=torch.randint(0, 50, (B, T), generator=g),
        attention_mask=torch.ones(B, T, dtype=torch.bool),
        loss_mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logprobs=-torch.rand(B, T, generator=g) * 3,
        ref_logprobs=-torch.rand(B, T, generator=g) * 3 if with_ref else None,
    )


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_full_batch(loss_agg):
    batch = _random_batch(0)
    obj = GRPOObjective(loss_agg=loss_agg, kl_coef=0.05, max_len=9)
    logprobs = (batch.old_logprobs + 0.3 * torch.randn(6, 7)).requires_grad_(True)

    full, _ = obj(logprobs, batch, obj.num_units(batch))
    (g_full,) = torch.autograd.grad(full, logprobs)

    splits = [slice(0, 2), slice(2, 5), slice(5, 6)]
    denominator = sum(obj.num_units(batch.select(s)) for s in splits)
    parts = [obj(logprobs[s], batch.select(s), denominator) for s in splits]
    total = sum(loss for loss, _ in parts)
    (g_micro,) = torch.autograd.grad(total, logprobs)
    assert_close(total, full)
    assert_close(g_micro, g_full)

    # Metrics: summed loss is the step loss, the others are token-weighted means.
    step = reduce_metrics(m for _, m in parts)
    _, direct = grpo_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                 ref_logprobs=batch.ref_logprobs)
    assert step["loss"] == pytest.approx(full.item(), rel=1e-5)
    assert step["weight"] == float(batch.loss_mask.sum())
    for key in ("clip_frac", "ratio", "kl"):
        assert step[key] == pytest.approx(direct[key].item(), rel=1e-5)


def test_aggregate_without_denominator_matches_means():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(aggregate_token_loss(per_token, mask, "token-mean"), torch.tensor(7.0 / 3))
    assert_close(aggregate_token_loss(per_token, mask, "seq-mean-token-mean"), torch.tensor((1.5 + 4.0) / 2))
    dr_grpo = aggregate_token_loss(per_token, mask, "seq-mean-token-sum-norm")
    assert_close(dr_grpo, torch.tensor((3 / 3 + 4 / 3) / 2))
    assert_close(aggregate_token_loss(per_token, torch.zeros(2, 3), "token-mean"), torch.tensor(0.0))
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate_token_loss(per_token, mask, "sum")  # type: ignore[arg-type]


def test_grpo_objective_config_pickle_and_kl_requirement():
    obj = GRPOObjective.from_config(GRPOConfig(loss_agg="seq-mean-token-mean", kl_coef=0.1), max_len=16)
    assert obj == pickle.loads(pickle.dumps(obj))
    assert (obj.loss_agg, obj.kl_coef, obj.clip_high, obj.max_len) == ("seq-mean-token-mean", 0.1, 0.28, 16)
    with pytest.raises(ValueError, match="ref_logprobs"):
        obj(torch.zeros(6, 7), _random_batch(1, with_ref=False), 6.0)
    with pytest.raises(ValueError, match="loss_agg"):
        GRPOObjective(loss_agg="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_len"):
        GRPOObjective.from_config(GRPOConfig(loss_agg="seq-mean-token-sum-norm"))


def test_grpo_objective_on_policy_and_sampler_mismatch():
    # old_logprobs=None: ratio = 1, so token-mean loss = -sum(A * m) / N and d loss / d logp = -A / N.
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    batch = TrainBatch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                       loss_mask=mask, advantages=torch.tensor([2.0, -1.0]),
                       sampler_logprobs=torch.tensor([[0.0, -1.5, -1.0], [9.0, -0.25, 9.0]]))
    obj = GRPOObjective()
    loss, m = obj(lp, batch, obj.num_units(batch))
    assert_close(loss, torch.tensor(-(2.0 + 2.0 - 1.0) / 3))
    loss.backward()
    assert_close(lp.grad, torch.tensor([[0.0, -2 / 3, -2 / 3], [0.0, 1 / 3, 0.0]]))
    step = reduce_metrics([m])
    assert step["ratio"] == 1.0 and step["clip_frac"] == 0.0
    # |lp - sampler| on masked tokens: 0.5, 1.0, 0.25 -> mean 0.5833 (unmasked 9.0s ignored).
    assert step["mismatch/logprob_abs_diff"] == pytest.approx(1.75 / 3)


# ---------------------------------------------------------------------------------------------
# DPO hand example: beta = 0.5, two pairs.
#   chosen log-ratio = [0.5, -0.5], rejected log-ratio = [-0.5, 0.5]  ->  h = [1, -1], beta h = +-0.5
#   softplus(-0.5) = 0.47407698, softplus(0.5) = 0.97407698
PC, PR = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
RC, RR = torch.tensor([-1.5, -1.5]), torch.tensor([-1.5, -1.5])
SP_NEG, SP_POS = 0.4740769841801067, 0.9740769841801067


@pytest.mark.parametrize(
    ("loss_type", "ls", "expected"),
    [
        ("sigmoid", 0.0, [SP_NEG, SP_POS]),
        # cDPO: 0.9 * softplus(-+0.5) + 0.1 * softplus(+-0.5)
        ("sigmoid", 0.1, [0.5240769841801067, 0.9240769841801066]),
        ("ipo", 0.0, [0.0, 4.0]),  # (h - 1/(2 beta))^2 = (h - 1)^2
        ("hinge", 0.0, [0.5, 1.5]),  # relu(1 - beta h)
        # robust: (0.9 softplus(-+0.5) - 0.1 softplus(+-0.5)) / 0.8
        ("robust", 0.1, [0.41157698418010663, 1.0365769841801067]),
    ],
)
def test_dpo_hand_computed(loss_type, ls, expected):
    losses, rc, rr = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type=loss_type, label_smoothing=ls)
    assert_close(losses, torch.tensor(expected))
    assert_close(rc, torch.tensor([0.25, -0.25]))
    assert_close(rr, torch.tensor([-0.25, 0.25]))


def test_simpo_hand_computed():
    # beta 2, gamma 0.5: u = 2 * ([-0.5, -1.0] - [-1.0, -0.6]) - 0.5 = [0.5, -1.3]
    losses, rc, rr = simpo_loss(torch.tensor([-0.5, -1.0]), torch.tensor([-1.0, -0.6]), beta=2.0, gamma=0.5)
    assert_close(losses, torch.tensor([SP_NEG, 1.5410084538329922]))  # softplus(-u)
    assert_close(rc, torch.tensor([-1.0, -2.0]))
    assert_close(rr, torch.tensor([-2.0, -1.2]))


def test_dpo_bad_arguments():
    with pytest.raises(ValueError, match="simpo_loss"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="simpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0.5"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="robust", label_smoothing=0.5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust", "simpo"])
def test_preference_losses_finite_at_margin_1e4(loss_type):
    pc = torch.tensor([1e4, -1e4, 0.0], requires_grad=True)
    pr = torch.tensor([-1e4, 1e4, 0.0], requires_grad=True)
    zeros = torch.zeros(3)
    if loss_type == "simpo":
        losses, _, _ = simpo_loss(pc, pr, beta=1.0, gamma=0.5, label_smoothing=0.1)
    else:
        losses, _, _ = dpo_loss(pc, pr, zeros, zeros, beta=1.0, loss_type=loss_type, label_smoothing=0.1)
    losses.sum().backward()
    assert torch.isfinite(losses).all()
    assert torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()
    # Pair 1 is 2e4 wrong; softplus is linear there, so the cost is finite and exact:
    # 0.9 * 2e4 (sigmoid), 0.9 * 2e4 / 0.8 (robust), (-2e4 - 1/(2 beta))^2 (ipo),
    # 1 + 2e4 (hinge), 0.9 * (2e4 + 0.5) (simpo, gamma shifts the margin).
    expected = {"sigmoid": 18000.0, "robust": 22500.0, "ipo": (2e4 + 0.5) ** 2, "hinge": 20001.0,
                "simpo": 18000.45}[loss_type]
    assert losses[1].item() == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# DPOObjective on token log-probs.


def _preference_batch(P: int = 3, T: int = 6, seed: int = 0) -> tuple[PreferenceBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(2 * P, T, dtype=torch.bool)
    for row in range(2 * P):
        loss_mask[row, 2 : 3 + row % (T - 2)] = True  # prompt of 2 tokens, responses of varied length
    token_lp = -torch.rand(2 * P, T, generator=g) * 2
    ref_c, ref_r = (-torch.rand(P, generator=g) * 4, -torch.rand(P, generator=g) * 4)
    batch = PreferenceBatch(torch.zeros(2 * P, T, dtype=torch.long), torch.ones(2 * P, T, dtype=torch.bool),
                            loss_mask, ref_c, ref_r)
    return batch, token_lp


def test_dpo_objective_matches_loss_on_summed_logps():
    batch, token_lp = _preference_batch()
    obj = DPOObjective(beta=0.2, loss_type="sigmoid")
    loss, m = obj(token_lp, batch, obj.num_units(batch))
    chosen = (token_lp[:3] * batch.loss_mask[:3]).sum(-1)
    rejected = (token_lp[3:] * batch.loss_mask[3:]).sum(-1)
    losses, rc, rr = dpo_loss(chosen, rejected, batch.ref_chosen_logps, batch.ref_rejected_logps, beta=0.2)
    assert_close(loss, losses.mean())
    step = reduce_metrics([m])
    assert step["rewards/chosen"] == pytest.approx(rc.mean().item(), rel=1e-5)
    assert step["rewards/margin"] == pytest.approx((rc - rr).mean().item(), rel=1e-5, abs=1e-6)
    assert step["rewards/accuracy"] == pytest.approx((rc > rr).float().mean().item())
    assert step["logps/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5)


def test_dpo_objective_ipo_and_simpo_use_length_averages():
    batch, token_lp = _preference_batch()
    lengths = batch.loss_mask.sum(-1).float()
    avg = (token_lp * batch.loss_mask).sum(-1) / lengths
    ipo, _ = DPOObjective(beta=0.5, loss_type="ipo")(token_lp, batch, 3.0)
    expected, _, _ = dpo_loss(avg[:3], avg[3:], batch.ref_chosen_logps / lengths[:3],
                              batch.ref_rejected_logps / lengths[3:], beta=0.5, loss_type="ipo")
    assert_close(ipo, expected.mean())
    no_ref = PreferenceBatch(batch.input_ids, batch.attention_mask, batch.loss_mask)
    simpo, _ = DPOObjective(beta=2.0, loss_type="simpo", simpo_gamma=0.3)(token_lp, no_ref, 3.0)
    assert_close(simpo, simpo_loss(avg[:3], avg[3:], beta=2.0, gamma=0.3)[0].mean())
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        DPOObjective(loss_type="sigmoid")(token_lp, no_ref, 3.0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "simpo"])
def test_dpo_micro_batches_sum_to_full_batch(loss_type):
    batch, token_lp = _preference_batch(P=4, seed=1)
    obj = DPOObjective.from_config(DPOConfig(beta=0.3, loss_type=loss_type, label_smoothing=0.1))
    full, _ = obj(token_lp, batch, obj.num_units(batch))
    total = torch.tensor(0.0)
    for pairs in (torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([3])):
        mb = batch.select(pairs)
        rows = torch.cat([pairs, pairs + 4])
        assert torch.equal(mb.loss_mask, batch.loss_mask[rows]) and len(mb) == len(pairs)
        total = total + obj(token_lp[rows], mb, 4.0)[0]
    assert_close(total, full)
    assert obj == pickle.loads(pickle.dumps(obj))


def test_reduce_metrics_weights():
    out = reduce_metrics([{"loss": 0.5, "weight": 2.0, "kl": 1.0}, {"loss": 0.25, "weight": 6.0, "kl": 7.0}])
    assert out == {"loss": 0.75, "weight": 8.0, "kl": 1.0}
    assert reduce_metrics([{"loss": 0.0, "weight": 0.0, "kl": 0.0}])["kl"] == 0.0
