"""TRL 1.16 as the oracle: the same random tensors through TRL's code and ours.

What is called and what is ported:
- GRPO loss: TRL's real `GRPOTrainer._compute_loss`, on an instance built with
  `object.__new__(GRPOTrainer)` and only the attributes that method reads. The one method it
  calls that needs a model, `_get_per_token_logps_and_entropies` (the forward pass), is replaced
  on the instance by one returning the test's log-probs, so the loss arithmetic is all TRL's.
- GRPO advantages: computed inline in `GRPOTrainer._generate_and_score_completions`
  (trl/trainer/grpo_trainer.py, the `sum_then_normalize` branch), which needs generation and
  reward functions, so its four arithmetic lines are ported in `trl_advantages` below; the std
  is TRL's own callable `trl.trainer.utils.nanstd`.
- DPO: TRL 1.16 has no standalone `dpo_loss`; the loss lives in `DPOTrainer._compute_loss`,
  which is called for real with `object.__new__(DPOTrainer)` and a fake model whose fused-head
  output carries the test's token log-probs (reference log-probs precomputed, as TRL allows).
- cDPO (sigmoid + label smoothing): TRL 1.16's DPO sigmoid ignores label_smoothing, so the
  oracle is `CPOTrainer.cpo_loss(loss_type="sigmoid")` fed with the DPO log-ratios, which is
  the cDPO formula term for term.
- SimPO: `trl.experimental.cpo.CPOTrainer.cpo_loss(loss_type="simpo")` and its
  `get_batch_logps(average_log_prob=True)`.
- Log-probs / entropies: `trl.trainer.utils.selective_log_softmax` and `entropy_from_logits`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close
from trl import DPOTrainer, GRPOTrainer
from trl.experimental.cpo import CPOTrainer
from trl.trainer.utils import entropy_from_logits as trl_entropy
from trl.trainer.utils import nanstd, selective_log_softmax

from rlhf.algo.advantages import grpo_advantages
from rlhf.algo.logprobs import entropy_from_logits, sequence_logprobs, token_logprobs
from rlhf.algo.losses import dpo_loss
from rlhf.algo.objectives import DPOObjective, GRPOObjective, PreferenceBatch, reduce_metrics
from rlhf.types import TrainBatch

TIGHT = {"rtol": 1e-6, "atol": 1e-6}
ENTROPY = {"rtol": 1e-5, "atol": 1e-5}
"""Entropies: ours is logsumexp - E[logits], TRL's -sum(p log p); in fp32 the two formulas round
apart by up to 1.2e-6 on an AVX2 CPU (values ~2.5), past TIGHT."""


class FakeAccelerator:
    """Single process: every collective is the identity."""

    num_processes = 1
    device = torch.device("cpu")

    def reduce(self, t, reduction="sum"):
        return t

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def autocast(self):
        return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Advantages


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """Port of GRPOTrainer._generate_and_score_completions, scale_rewards in {"group", "none"}."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
    std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize(("scale_rewards", "scale_by_std"), [("group", True), ("none", False)])
def test_advantages_match_trl(scale_rewards, scale_by_std):
    torch.manual_seed(0)
    rewards = torch.cat([torch.randn(4 * 8), torch.ones(8), torch.randint(0, 2, (8,)).float()])
    ours = grpo_advantages(rewards, 8, scale_by_std=scale_by_std, eps=1e-4)  # TRL's eps is 1e-4
    assert_close(ours, trl_advantages(rewards, 8, scale_rewards), **TIGHT)


# ---------------------------------------------------------------------------------------------
# GRPO loss: TRL loss_type -> our loss_agg


def trl_grpo_trainer(loss_type: str, logps: torch.Tensor, *, beta: float, max_completion_length: int,
                     grad_accum: int, steps_per_generation: int) -> GRPOTrainer:
    t = object.__new__(GRPOTrainer)
    t.__dict__.update(
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=max_completion_length,
        accelerator=FakeAccelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False,
                             steps_per_generation=steps_per_generation),
    )
    # Stands in for the model forward only; see the module docstring.
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    return t


def _grpo_case(seed: int, B: int = 4, prompt_len: int = 3, C: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([C, 2, 4, 1])[:B]
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    logps = -torch.rand(B, C, generator=g) * 3
    old = logps + 0.4 * torch.randn(B, C, generator=g)  # ratios spread across both clip bounds
    ref = logps + 0.5 * torch.randn(B, C, generator=g)
    adv = torch.randn(B, generator=g)
    return prompt_len, completion_mask, logps, old, ref, adv


@pytest.mark.parametrize(
    ("trl_loss_type", "loss_agg", "micro_batches"),
    [
        ("grpo", "seq-mean-token-mean", 2),
        ("dr_grpo", "seq-mean-token-sum-norm", 2),
        ("dapo", "token-mean", 2),  # global token normalizer == our denominator
        ("bnpo", "token-mean", 1),  # per-micro-batch token mean == our local denominator
    ],
)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_trl(trl_loss_type, loss_agg, micro_batches, beta):
    Lp, cmask, logps, old, ref, adv = _grpo_case(seed=1)
    B, C = cmask.shape
    ours = GRPOObjective(clip_low=0.2, clip_high=0.28, loss_agg=loss_agg, kl_coef=beta, max_len=C)
    # Our batch is prompt + completion; prompt positions carry garbage log-probs and mask False.
    pad = torch.full((B, Lp), -7.0)
    batch = TrainBatch(
        input_ids=torch.zeros(B, Lp + C, dtype=torch.long),
        attention_mask=torch.ones(B, Lp + C, dtype=torch.bool),
        loss_mask=torch.cat([torch.zeros(B, Lp, dtype=torch.bool), cmask.bool()], 1),
        advantages=adv, old_logprobs=torch.cat([pad, old], 1), ref_logprobs=torch.cat([pad, ref], 1),
    )
    size = B // micro_batches
    parts = [slice(i * size, (i + 1) * size) for i in range(micro_batches)]
    denominator = sum(ours.num_units(batch.select(s)) for s in parts)
    our_metrics = []
    for s in parts:
        trl_lp = logps[s].clone().requires_grad_(True)
        trainer = trl_grpo_trainer(trl_loss_type, trl_lp, beta=beta, max_completion_length=C,
                                   grad_accum=micro_batches, steps_per_generation=micro_batches)
        inputs = {
            "prompt_ids": torch.zeros(size, Lp, dtype=torch.long), "prompt_mask": torch.ones(size, Lp),
            "completion_ids": torch.zeros(size, C, dtype=torch.long), "completion_mask": cmask[s],
            "advantages": adv[s], "old_per_token_logps": old[s], "ref_per_token_logps": ref[s],
            "num_items_in_batch": cmask.sum().float(),  # the whole generation batch
        }
        trl_loss = trainer._compute_loss(None, inputs)
        (trl_grad,) = torch.autograd.grad(trl_loss, trl_lp)

        our_lp = torch.cat([pad[s], logps[s]], 1).requires_grad_(True)
        our_loss, metrics = ours(our_lp, batch.select(s), denominator)
        (our_grad,) = torch.autograd.grad(our_loss, our_lp)
        assert_close(our_loss, trl_loss, **TIGHT)
        assert_close(our_grad[:, Lp:], trl_grad, **TIGHT)
        assert our_grad[:, :Lp].eq(0).all()
        our_metrics.append(metrics)
        trl_metrics = trainer._metrics["train"]
        step = reduce_metrics([metrics])
        assert step["clip_frac"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=1e-6)
        if beta > 0:
            assert step["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5)
    assert 0 < reduce_metrics(our_metrics)["clip_frac"] < 1  # the case exercises clipping


# ---------------------------------------------------------------------------------------------
# DPO


def trl_dpo_trainer(loss_type: str, beta: float, label_smoothing: float) -> DPOTrainer:
    t = object.__new__(DPOTrainer)
    t.__dict__.update(
        model=SimpleNamespace(training=True), accelerator=FakeAccelerator(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    return t


def fake_fused_model(token_lp: torch.Tensor):
    """What TRL's fused LM head returns: log_probs[:, t-1] scores token t, 0 where labels are -100."""

    def forward(*, input_ids, attention_mask, use_cache, labels, fused_lm_head):
        keep = labels[:, 1:] != -100
        zeros = torch.zeros_like(keep, dtype=torch.float32)
        return SimpleNamespace(log_probs=token_lp[:, 1:] * keep, entropy=zeros, mean_logits=zeros,
                               is_top1=keep & False, aux_loss=None)

    return forward


def _dpo_case(P: int = 3, prompt_len: int = 2, T: int = 8, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.zeros(2 * P, T, dtype=torch.long)
    for row in range(2 * P):
        completion_mask[row, prompt_len : prompt_len + 1 + (row * 3) % (T - prompt_len)] = 1
    token_lp = -torch.rand(2 * P, T, generator=g) * 2
    ref_c, ref_r = -torch.rand(P, generator=g) * 6, -torch.rand(P, generator=g) * 6
    return completion_mask, token_lp, ref_c, ref_r


@pytest.mark.parametrize(("loss_type", "label_smoothing"),
                         [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1), ("robust", 0.0)])
def test_dpo_matches_trl_dpo_trainer(loss_type, label_smoothing):
    cmask, token_lp, ref_c, ref_r = _dpo_case()
    P = ref_c.shape[0]
    beta = 0.3
    trainer = trl_dpo_trainer(loss_type, beta, label_smoothing)
    trl_lp = token_lp.clone().requires_grad_(True)
    inputs = {"input_ids": torch.zeros_like(cmask), "attention_mask": torch.ones_like(cmask),
              "completion_mask": cmask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    trl_loss = trainer._compute_loss(fake_fused_model(trl_lp), inputs, return_outputs=False)
    (trl_grad,) = torch.autograd.grad(trl_loss, trl_lp)

    batch = PreferenceBatch(inputs["input_ids"], inputs["attention_mask"].bool(), cmask.bool(), ref_c, ref_r)
    obj = DPOObjective(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    our_lp = token_lp.clone().requires_grad_(True)
    our_loss, metrics = obj(our_lp, batch, obj.num_units(batch))
    (our_grad,) = torch.autograd.grad(our_loss, our_lp)
    assert_close(our_loss, trl_loss, **TIGHT)
    assert_close(our_grad[:, 1:], trl_grad[:, 1:], **TIGHT)

    step, trl_m = reduce_metrics([metrics]), trainer._metrics["train"]
    assert step["weight"] == P
    assert step["logps/chosen"] == pytest.approx(trl_m["logps/chosen"][0], rel=1e-6)
    assert step["logps/rejected"] == pytest.approx(trl_m["logps/rejected"][0], rel=1e-6)
    if loss_type != "ipo":  # TRL logs IPO rewards from summed log-ratios, ours are per token
        names = [("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                 ("rewards/margin", "rewards/margins"), ("rewards/accuracy", "rewards/accuracies")]
        for ours_key, trl_key in names:
            assert step[ours_key] == pytest.approx(trl_m[trl_key][0], rel=1e-5, abs=1e-6)


def trl_cpo_trainer(loss_type: str, beta: float, label_smoothing: float,
                    simpo_gamma: float = 0.5) -> CPOTrainer:
    t = object.__new__(CPOTrainer)
    t.__dict__.update(alpha=0.0, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                      simpo_gamma=simpo_gamma, accelerator=FakeAccelerator())
    return t


def test_cdpo_label_smoothing_matches_trl_cpo_sigmoid():
    torch.manual_seed(3)
    pc, pr, rc, rr = (-torch.rand(5) * 10 for _ in range(4))
    ours, our_c, our_r = dpo_loss(pc, pr, rc, rr, beta=0.2, loss_type="sigmoid", label_smoothing=0.15)
    # CPO's sigmoid loss on (pc - rc, pr - rr) is -(1-ls) logsig(beta h) - ls logsig(-beta h), i.e. cDPO.
    trl, trl_c, trl_r = trl_cpo_trainer("sigmoid", 0.2, 0.15).cpo_loss(pc - rc, pr - rr)
    assert_close(ours, trl, **TIGHT)
    assert_close((our_c, our_r), (trl_c, trl_r), **TIGHT)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl_cpo(label_smoothing):
    torch.manual_seed(4)
    P, T, V = 3, 7, 11
    logits = torch.randn(2 * P, T, V)
    input_ids = torch.randint(0, V, (2 * P, T))
    loss_mask = torch.zeros(2 * P, T, dtype=torch.bool)
    for row in range(2 * P):
        loss_mask[row, 2 : 3 + row % 5] = True
    labels = input_ids.masked_fill(~loss_mask, -100)

    trl_avg = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trl_sum = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=False)
    token_lp = token_logprobs(logits, input_ids, loss_mask)
    assert_close(sequence_logprobs(token_lp, loss_mask, average=True), trl_avg, **TIGHT)
    assert_close(sequence_logprobs(token_lp, loss_mask), trl_sum, **TIGHT)

    cpo = trl_cpo_trainer("simpo", 2.0, label_smoothing, simpo_gamma=0.7)
    trl_losses, trl_c, trl_r = cpo.cpo_loss(trl_avg[:P], trl_avg[P:])
    obj = DPOObjective(beta=2.0, loss_type="simpo", label_smoothing=label_smoothing, simpo_gamma=0.7)
    batch = PreferenceBatch(input_ids, torch.ones_like(loss_mask), loss_mask)
    loss, metrics = obj(token_lp, batch, float(P))
    assert_close(loss, trl_losses.mean(), **TIGHT)
    step = reduce_metrics([metrics])
    assert step["rewards/chosen"] == pytest.approx(trl_c.mean().item(), rel=1e-6)
    assert step["rewards/rejected"] == pytest.approx(trl_r.mean().item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Log-probs and entropies


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_and_entropy_match_trl(temperature):
    torch.manual_seed(5)
    logits = torch.randn(3, 9, 17) * 2
    ids = torch.randint(0, 17, (3, 9))
    ours = token_logprobs(logits, ids, temperature=temperature, chunk_tokens=4)
    trl = selective_log_softmax(logits[:, :-1], ids[:, 1:], temperature=temperature)
    assert_close(ours[:, 1:], trl, **TIGHT)
    ours_h = entropy_from_logits(logits, temperature=temperature, chunk_tokens=4)
    assert_close(ours_h[:, 1:], trl_entropy(logits[:, :-1] / temperature), **ENTROPY)
