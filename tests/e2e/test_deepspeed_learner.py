"""DeepSpeed ZeRO-2/3 (and FSDP2) learners over gloo with 2 ranks == one plain PyTorch process.

No Ray here: two processes from torch.multiprocessing, so a failure points at the learner itself.
One spawn runs every backend in turn, and for each every scenario (first GRPO step, checkpoint
round trip, first DPO step) on fresh learners, and writes its results to files; the tests below
check one aspect each against a single-process reference computed with a plain HF model, AdamW and
the same warm-up scheduler.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.multiprocessing as mp

from rlhf.algo.objectives import DPOObjective, GRPOObjective
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.data.batching import shard_for_rank
from rlhf.types import PreferenceBatch, TrainBatch
from tests.support.learners import rendezvous_store

# warmup_steps=3: steps run at lr/3, 2lr/3, lr, so a checkpoint that loses the scheduler's position
# changes the second step. max_grad_norm small enough that clipping is active. Adam's first update is
# lr * g / (|g| + eps): for the few gradients near zero, float reduction order moves it by a few % of
# lr, so the first step's lr (1e-4) keeps that well inside the 1e-5 weight tolerance.
LEARNER = LearnerConfig(lr=3e-4, micro_batch_size=2, max_grad_norm=1.0, warmup_steps=3)
# The offload variants step with DeepSpeedCPUAdam (JIT-compiled on first use, ~1-2 min, then cached).
BACKENDS = {"fsdp2": dict(backend="fsdp2"),
            "zero2": dict(backend="deepspeed", zero_stage=2),
            "zero3": dict(backend="deepspeed", zero_stage=3),
            "zero2-offload": dict(backend="deepspeed", zero_stage=2, offload_optimizer=True),
            "zero3-offload": dict(backend="deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True)}
GRPO = GRPOObjective(loss_agg="token-mean")
DPO = DPOObjective(beta=0.1)
TOL = 1e-5


def _ragged(vocab: int, lengths: list[int], prompt: int, g: torch.Generator):
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    attn = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids[~attn] = 0
    return ids, attn, attn & (torch.arange(t)[None, :] >= prompt)


def grpo_batch(vocab: int, seed: int) -> TrainBatch:
    """5 rows (3 and 2 over 2 ranks: 2 and 1 micro-batches), ragged lengths, right padding."""
    g = torch.Generator().manual_seed(seed)
    ids, attn, loss_mask = _ragged(vocab, [9, 7, 12, 5, 10], 3, g)
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask,
                      advantages=torch.randn(5, generator=g))


def dpo_batch(vocab: int, model) -> PreferenceBatch:
    """3 pairs (2 and 1 over 2 ranks), chosen rows then rejected rows, with reference log-probs
    near the model's own (so the sigmoid is not saturated and gradients are sizeable)."""
    g = torch.Generator().manual_seed(7)
    ids, attn, loss_mask = _ragged(vocab, [8, 11, 6, 10, 7, 9], 4, g)
    batch = PreferenceBatch(ids, attn, loss_mask)
    with torch.no_grad():
        chosen, rejected = DPO.sequence_logps(_logprobs(model, batch), batch)
    return dataclasses.replace(batch, ref_chosen_logps=chosen + torch.randn(3, generator=g),
                               ref_rejected_logps=rejected + torch.randn(3, generator=g))


def _logprobs(model, batch) -> torch.Tensor:
    from rlhf.algo.logprobs import token_logprobs

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits.float(), batch.input_ids, batch.loss_mask)


# ------------------------------------------------------------------ the learner side (2 processes)


def _make_learner(backend: str, rank: int, world: int, port: int, model_path: str, *, with_reference: bool):
    from actors.learner_base import LearnerRank

    cfg = dataclasses.replace(LEARNER, num_ranks=world, **BACKENDS[backend])
    return LearnerRank(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, model_path=model_path,
               model_cfg=ModelConfig(dtype="float32"), learner_cfg=cfg, temperature=1.0,
               with_reference=with_reference, seed=0, driver_store=True)


def _weights(learner, keep: bool | None = None) -> dict[str, torch.Tensor]:
    """Full weights through the weight-sync path (small buckets: several per model); by default
    only rank 0 keeps them, as when it alone feeds the engines."""
    keep = learner.rank == 0 if keep is None else keep
    return {n: t.clone() for bucket in learner.iter_weight_buckets(2**16, torch.float32, keep=keep) for n, t in bucket}


def _local_share(model: torch.nn.Module) -> float:
    """Fraction of the model's parameter elements this rank stores (1.0: a full replica)."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partitioned parameter
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        elif isinstance(p, DTensor):
            local, total = local + p.to_local().numel(), total + p.numel()
        else:
            local, total = local + p.numel(), total + p.numel()
    return local / total


def _rank_main(rank: int, world: int, port: int, model_path: str,
               batches: tuple[TrainBatch, TrainBatch, PreferenceBatch], out: str) -> None:
    """Every backend in turn, on fresh learners in the ranks' one group: `<out>/<backend>/rank<rank>.pt`."""
    import os

    import torch.distributed as dist

    for backend in BACKENDS:
        os.makedirs(f"{out}/{backend}", exist_ok=True)  # both ranks make it
        _backend_case(rank, world, port, backend, model_path, batches, f"{out}/{backend}")
    dist.destroy_process_group()


def _backend_case(rank: int, world: int, port: int, backend: str, model_path: str,
                  batches: tuple[TrainBatch, TrainBatch, PreferenceBatch], out: str) -> None:
    first, second, pairs = (shard_for_rank(b, rank, world) for b in batches)
    learner = _make_learner(backend, rank, world, port, model_path, with_reference=True)
    res: dict = {"initial": _weights(learner), "policy_share": _local_share(learner.model),
                 "reference_share": _local_share(learner.reference),
                 "reference_trainable": any(p.requires_grad for p in learner.reference.parameters()),
                 "logprobs": learner.logprobs(first), "ref_logprobs": learner.logprobs(first, reference=True)}
    res["grpo"] = (learner.train_step(first, GRPO), _weights(learner))
    res["every_rank"] = _weights(learner, keep=True)  # colocated engines: each rank feeds its own
    learner.save(f"{out}/ckpt", model_path, "float32")
    res["continued"] = (learner.train_step(second, GRPO), _weights(learner))
    learner.load(f"{out}/ckpt")
    res["resumed"] = (learner.train_step(second, GRPO), _weights(learner))
    fresh = _make_learner(backend, rank, world, port, model_path, with_reference=False)
    res["dpo"] = (fresh.train_step(pairs, DPO), _weights(fresh))
    torch.save(res, f"{out}/rank{rank}.pt")  # files, not a queue: tensors outlive the process


# ------------------------------------------------------------------ the plain single-process side


def reference_step(model_path: str, batch, objective) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One step written plainly: full batch, one forward, clip, AdamW + warm-up scheduler."""
    from transformers import AutoModelForCausalLM

    from actors.learner_base import make_scheduler

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNER.lr, betas=LEARNER.betas,
                            weight_decay=LEARNER.weight_decay)
    sched = make_scheduler(opt, LEARNER.warmup_steps)
    loss, _ = objective(_logprobs(model, batch), batch, objective.num_units(batch))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), LEARNER.max_grad_norm)
    opt.step()
    sched.step()
    return float(loss.detach()), float(grad_norm), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def setup(tiny_qwen2):
    """The batches and the single-process results, shared by every backend."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    vocab = model.config.vocab_size
    batches = (grpo_batch(vocab, 0), grpo_batch(vocab, 1), dpo_batch(vocab, model))
    with torch.no_grad():
        initial_lp = _logprobs(model, batches[0])
    return {
        "batches": batches, "model": model, "initial_lp": initial_lp,
        "grpo": reference_step(str(tiny_qwen2), batches[0], GRPO),
        "dpo": reference_step(str(tiny_qwen2), batches[2], DPO),
    }


@pytest.fixture(scope="module")
def every_backend(setup, tiny_qwen2, tmp_path_factory):
    """The folder of every backend's results: one spawn of the two ranks runs them all in turn (a
    spawn per backend only repeated ~10 s of imports each)."""
    out = tmp_path_factory.mktemp("backends")
    ctx = mp.get_context("spawn")
    store = rendezvous_store(2)
    procs = [ctx.Process(target=_rank_main, args=(r, 2, store.port, str(tiny_qwen2), setup["batches"], str(out)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    assert [p.exitcode for p in procs] == [0, 0]
    return out


@pytest.fixture(scope="module", params=list(BACKENDS))
def run(request, every_backend):
    """Both ranks' results of one backend, shared by the tests below."""
    out = every_backend / request.param
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_first_step_matches_single_process(run, setup, objective):
    """Loss, grad norm (before clipping) and updated weights of the first step equal the
    single-process step: global normalisation, accumulation over a variable number of
    micro-batches and the rank averaging undone by `loss * world_size` are all exact."""
    results, _ = run
    ref_loss, ref_grad_norm, ref_weights = setup[objective]
    (metrics, weights), (metrics1, weights1) = results[0][objective], results[1][objective]
    assert metrics.loss == pytest.approx(ref_loss, abs=TOL)
    assert metrics1.loss == metrics.loss  # every rank reports the reduced value
    assert metrics.grad_norm == pytest.approx(ref_grad_norm, rel=TOL)
    assert ref_grad_norm > LEARNER.max_grad_norm  # so the clip was applied too
    assert metrics.values["lr"] == pytest.approx(LEARNER.lr * 2 / 3)  # the next step's: warm-up advanced once
    assert weights1 == {}  # only rank 0 holds full tensors
    assert weights.keys() == ref_weights.keys()
    moved = max(float((weights[n] - setup["model"].state_dict()[n]).abs().max()) for n in ref_weights)
    assert moved > LEARNER.lr / 6  # the step did move the weights, by far more than the tolerance
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=TOL, rtol=0, msg=name)


def test_every_rank_can_keep_the_full_weights(run):
    """Colocated engines get the weights from the learner rank on their own device: when every
    rank keeps the gathered tensors, each holds exactly rank 0's full weights."""
    results, _ = run
    rank0, rank1 = results[0]["every_rank"], results[1]["every_rank"]
    assert rank0.keys() == rank1.keys() == results[0]["grpo"][1].keys()
    for name, tensor in rank0.items():
        assert torch.equal(rank1[name], tensor), name
        assert torch.equal(results[0]["grpo"][1][name], tensor), name


def test_full_parameters_equal_the_model(run, setup):
    """Bucketed `full_parameters` (under ZeRO-3: gathered one at a time) before any step are
    exactly the checkpoint's tensors, in HF names, the tied embedding once."""
    results, _ = run
    initial = results[0]["initial"]
    state = dict(setup["model"].named_parameters())
    assert initial.keys() == state.keys()
    for name, p in state.items():
        assert torch.equal(initial[name], p.detach()), name


def test_logprobs_of_policy_and_reference(run, setup):
    results, _ = run
    want = setup["initial_lp"]
    for key in ("logprobs", "ref_logprobs"):
        got = torch.cat([results[0][key], results[1][key]])
        torch.testing.assert_close(got, want * setup["batches"][0].loss_mask, atol=TOL, rtol=TOL, msg=key)


def test_reference_model_is_sharded_and_frozen(run, request):
    """The reference is a frozen sharded copy on every backend (ZeRO-3 inference engine for
    DeepSpeed, whatever the policy's stage); the policy is sharded except under ZeRO-2."""
    results, _ = run
    backend = request.node.callspec.params["run"]
    for r in results:
        assert r["reference_share"] < 0.55
        assert not r["reference_trainable"]
        assert (r["policy_share"] == 1.0) if backend.startswith("zero2") else (r["policy_share"] < 0.55)


def test_checkpoint_round_trip(run):
    """step 1, save, step 2  ==  step 1, save, step 2, load, step 2 again: the checkpoint restores
    the exact model, optimizer moments and scheduler position (warm-up: each step has a new lr)."""
    results, out = run
    for r in results:
        continued, resumed = r["continued"], r["resumed"]
        assert resumed[0].loss == continued[0].loss
        assert resumed[0].grad_norm == continued[0].grad_norm
        assert resumed[0].values["lr"] == continued[0].values["lr"] == pytest.approx(LEARNER.lr)
        assert resumed[1].keys() == continued[1].keys()
        for name, w in continued[1].items():
            assert torch.equal(resumed[1][name], w), name
    # The HF export next to it holds the step-1 weights (those saved) and loads in transformers.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "ckpt" / "model", dtype=torch.float32)
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), results[0]["grpo"][1][name]), name


# ------------------------------------------------------------------ config handling (no processes)


def test_user_deepspeed_config_is_merged_under_the_learner_keys(tmp_path):
    from actors.deepspeed_learner import train_config

    user = {"train_batch_size": "auto", "gradient_accumulation_steps": 8, "optimizer": {"type": "Adam"},
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                             "reduce_bucket_size": "auto"},
            "wall_clock_breakdown": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = dataclasses.replace(LEARNER, backend="deepspeed", zero_stage=3, offload_optimizer=True,
                              deepspeed_config=str(path))
    got = train_config(cfg, ModelConfig(dtype="float32"), world_size=4, pin_memory=False)
    assert got["wall_clock_breakdown"] is True  # the user's own settings arrive
    assert got["zero_optimization"]["overlap_comm"] is True
    assert "reduce_bucket_size" not in got["zero_optimization"]  # "auto": DeepSpeed's default
    assert got["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # ... while the learner's keys are its own
    assert got["zero_optimization"]["stage"] == 3
    assert (got["train_micro_batch_size_per_gpu"], got["train_batch_size"]) == (2, 8)
    assert got["gradient_accumulation_steps"] == 1 and got["managed_gradient_accumulation"] is False
    assert got["bf16"] == {"enabled": False} and got["gradient_clipping"] == LEARNER.max_grad_norm
    assert "optimizer" not in got


def test_offload_params_needs_zero3():
    from actors.deepspeed_learner import DeepSpeedSharding
    from actors.learner_base import RankContext

    cfg = dataclasses.replace(LEARNER, backend="deepspeed", zero_stage=2, offload_params=True)
    with pytest.raises(ValueError, match="offload_params needs learner.zero_stage=3"):
        DeepSpeedSharding(RankContext(0, 1, cfg, ModelConfig(), device=None), "unused", with_reference=False)
