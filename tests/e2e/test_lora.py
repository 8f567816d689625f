"""LoRA (issue 15): target resolution and pre-start-up checks, the learners with adapters (only the
adapters train, the reference is the model with adapters off, merged/adapter exports equal PEFT's,
exact save/load), the engine serving pushed adapters, and GRPO/DPO end to end with LoRA.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
from pathlib import Path

import pytest
import torch

from rlhf.algo.objectives import DPOObjective, GRPOObjective
from rlhf.config import ConfigError, LearnerConfig, ModelConfig, load_config
from rlhf.data.batching import shard_for_rank
from rlhf.lora import (
    adapter_weights,
    check_lora,
    merged_weights,
    meta_model,
    resolve_target_modules,
    target_modules,
)
from rlhf.run.metrics import read_metrics
from tests.support.learners import attach_reference, make_batch, make_pairs, spawn_ranks
from tests.support.runs import run_training

ROOT = Path(__file__).resolve().parents[2]
LORA = LearnerConfig(lr=1e-2, micro_batch_size=2, max_grad_norm=1.0, lora_rank=4, lora_alpha=8.0, lora_sync="adapter")
LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _peft_model(model_path, cfg: LearnerConfig = LORA, seed: int = 0, nonzero_b: bool = True):
    """The HF model with PEFT adapters as the learner builds it; B randomised so the adapter matters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    targets = target_modules(cfg, model)
    peft = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets))
    if nonzero_b:
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    return peft


# ---------------------------------------------------------------------- rlhf/lora.py


def test_all_linear_is_every_decoder_linear_and_never_the_head(tiny_qwen2):
    model = meta_model(tiny_qwen2)
    assert target_modules(LORA, model) == LINEARS
    names = [n for n, _ in model.named_modules()]
    assert resolve_target_modules(["self_attn.q_proj", "v_proj"], [n for n in names if ".layers." in n]) == \
        ["q_proj", "v_proj"]


def test_a_module_that_matches_nothing_is_one_line(tiny_qwen2):
    with pytest.raises(ConfigError) as e:
        target_modules(dataclasses.replace(LORA, lora_target_modules=("q_proj", "qkv")), meta_model(tiny_qwen2))
    assert "'qkv' matches no linear layer" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'lm_head' matches no linear layer"):  # the head is not the decoder's
        target_modules(dataclasses.replace(LORA, lora_target_modules=("lm_head",)), meta_model(tiny_qwen2))


def _cfg(*overrides: str):
    return load_config(ROOT / "configs/grpo_tiny_cpu.yaml", list(overrides))


def test_check_lora_before_start_up(tiny_qwen2):
    check_lora(_cfg(), tiny_qwen2)  # no LoRA: nothing to check
    check_lora(_cfg("learner.lora_rank=8"), tiny_qwen2)
    with pytest.raises(ConfigError, match="matches no linear layer"):
        check_lora(_cfg("learner.lora_rank=8", "learner.lora_target_modules=[nope]"), tiny_qwen2)
    with pytest.raises(ConfigError, match="needs generation.backend=vllm"):
        check_lora(_cfg("learner.lora_rank=8", "generation.backend=hf", "learner.lora_sync=adapter"), tiny_qwen2)
    check_lora(_cfg("learner.lora_rank=8", "generation.backend=hf", "learner.lora_sync=merged"), tiny_qwen2)
    with pytest.raises(ConfigError, match="learner.lora_rank"):  # rank <= 0: the config's own check
        _cfg("learner.lora_rank=-1")


def test_lora_runs_hold_no_reference_copy_and_adapters_take_the_object_store():
    from actors.weight_sync import CudaIpcTransport, ObjectStoreTransport, choose_transport
    from rlhf.lora import serves_adapters
    from rlhf.rules import holds_reference_model

    assert holds_reference_model(_cfg("grpo.kl_coef=0.05"))
    assert not holds_reference_model(_cfg("grpo.kl_coef=0.05", "learner.lora_rank=8"))
    dpo = load_config(ROOT / "configs/dpo_lora_tiny_cpu.yaml", [])
    assert holds_reference_model(dataclasses.replace(dpo, learner=dataclasses.replace(dpo.learner, lora_rank=0)))
    assert not holds_reference_model(dpo)
    adapter, merged = (_cfg("learner.lora_rank=8", f"learner.lora_sync={s}") for s in ("adapter", "merged"))
    assert serves_adapters(adapter) and not serves_adapters(merged)
    assert not serves_adapters(_cfg("learner.lora_rank=8", "learner.lora_sync=auto"))  # unsettled: merged
    assert isinstance(choose_transport(adapter, "cuda", lambda: ("127.0.0.1", 1)), ObjectStoreTransport)
    assert isinstance(choose_transport(merged, "cuda", lambda: ("127.0.0.1", 1)), CudaIpcTransport)


def _unservable_models(tmp_path: Path) -> dict[str, Path]:
    """config.json-only model folders vLLM cannot serve adapters for (on CPU)."""
    configs = {"gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
               # vLLM-CPU aborts serving adapters on it ("LoRA adapters", vllm_generator)
               "big-vocab": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152}}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    return {name: tmp_path / name for name in configs}


def test_vllm_serving_checks(tiny_qwen2, tmp_path):
    pytest.importorskip("vllm")
    from actors.vllm_lora import settle_lora_sync

    models = _unservable_models(tmp_path)
    adapter = _cfg("learner.lora_rank=8", "learner.lora_sync=adapter")
    assert settle_lora_sync(adapter, str(tiny_qwen2)) is adapter
    with pytest.raises(ConfigError, match="^learner.lora_sync=adapter: vLLM cannot serve LoRA adapters on "
                                          "GPT2LMHeadModel; use learner.lora_sync=merged$"):
        settle_lora_sync(adapter, str(models["gpt2"]))
    merged = _cfg("learner.lora_rank=8", "learner.lora_sync=merged")
    assert settle_lora_sync(merged, str(models["gpt2"])) is merged
    with pytest.raises(ConfigError, match="vLLM-CPU aborts at start-up .* 49152-token vocabulary"):
        settle_lora_sync(adapter, str(models["big-vocab"]))
    with pytest.raises(ConfigError, match="up to rank 512, learner.lora_rank is 1024"):
        settle_lora_sync(_cfg("learner.lora_rank=1024", "learner.lora_sync=adapter"), str(tiny_qwen2))


def test_lora_sync_auto_serves_adapters_where_vllm_can(tiny_qwen2, tmp_path, capsys):
    """`auto` (the default) settles before start-up: adapters where vLLM serves them here (the tiny
    model's vocabulary is small enough for vLLM-CPU), merged elsewhere with the reason printed once,
    merged silently where nothing serves adapters (the HF generator, DPO). Explicit values stay."""
    pytest.importorskip("vllm")
    from actors.vllm_lora import settle_lora_sync

    models = _unservable_models(tmp_path)
    assert _cfg("learner.lora_rank=8").learner.lora_sync == "auto"

    def settled(model: Path, *overrides: str) -> str:
        return settle_lora_sync(_cfg("learner.lora_rank=8", *overrides), str(model)).learner.lora_sync

    assert settled(tiny_qwen2) == "adapter"  # the chosen mode is always said, with the reason
    # (the last line: vLLM's first import in this process logs to stdout before it)
    assert capsys.readouterr().out.splitlines()[-1] == ("learner.lora_sync: auto -> adapter: vLLM serves rank-8 "
                                                        "adapters here: each sync pushes the adapter only")
    assert settled(models["big-vocab"]) == "merged"
    assert capsys.readouterr().out == ("learner.lora_sync: auto -> merged: vLLM-CPU aborts at start-up serving LoRA "
                                       "adapters on a 49152-token vocabulary (works up to 1024)\n")
    assert settled(models["gpt2"]) == "merged" and "GPT2LMHeadModel" in capsys.readouterr().out
    assert settled(tiny_qwen2, "generation.backend=hf") == "merged" and capsys.readouterr().out == ""
    # explicit values stay: adapters vLLM cannot serve are refused (test_vllm_serving_checks), the HF
    # generator's by check_lora
    assert settled(tiny_qwen2, "generation.backend=hf", "learner.lora_sync=adapter") == "adapter"
    assert settled(models["gpt2"], "learner.lora_sync=merged") == "merged"
    assert capsys.readouterr().out == "learner.lora_sync: merged (as set): each sync pushes the merged weights\n"
    assert settle_lora_sync(_cfg(), str(tiny_qwen2)).learner.lora_sync == "auto"  # no LoRA: untouched
    dpo = load_config(ROOT / "configs/dpo_lora_tiny_cpu.yaml", ["learner.lora_sync=auto"])
    assert settle_lora_sync(dpo, str(tiny_qwen2)).learner.lora_sync == "merged"


def test_merged_and_adapter_streams_equal_peft(tiny_qwen2, tmp_path):
    peft = _peft_model(tiny_qwen2)
    named = [(n, p.detach().clone()) for n, p in peft.named_parameters()]
    adapter = dict(adapter_weights(named))
    peft.save_pretrained(tmp_path / "a")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert sorted(adapter) == sorted(saved)
    merged = dict(merged_weights(named, LORA.lora_alpha / LORA.lora_rank))
    reference = dict(peft.merge_and_unload().named_parameters())
    assert sorted(merged) == sorted(reference)
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)
    assert [n for n, _ in merged_weights([(n, None) for n, _ in named], 2.0)] == list(merged)  # non-keeping ranks


# ---------------------------------------------------------------------- learners (2 ranks over gloo)


def _learner(backend: str, rank: int, world: int, port: int, model_path: str, cfg: LearnerConfig,
             with_reference: bool = False):
    if backend.startswith("deepspeed"):
        cfg = dataclasses.replace(cfg, backend="deepspeed", zero_stage=int(backend[-1]))
    from actors.learner_base import LearnerRank

    return LearnerRank(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, model_path=model_path,
               model_cfg=ModelConfig(dtype="float32"), learner_cfg=cfg, temperature=1.0,
               with_reference=with_reference, seed=0, driver_store=True)


def _raw(learner) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in learner.sharding.full_parameters(keep=True)}


def _learner_ranks(rank, world, port, model_path, cfg, batch, pairs, out):
    """Every learner case of this module in turn, on fresh learners in the ranks' one gloo group (a
    spawn per case only repeated ~10 s of imports): each backend's GRPO step, checkpoint and reload
    (`<out>/<backend>/`), then DPO's two references (`<out>/dpo*`)."""
    import os

    import torch.distributed as dist

    for backend in LEARNER_BACKENDS:
        os.makedirs(f"{out}/{backend}", exist_ok=True)  # both ranks make it
        _grpo_case(rank, world, port, backend, model_path, cfg, batch, f"{out}/{backend}")
    _dpo_case(rank, world, port, model_path, cfg, pairs, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def lora_learners(tiny_qwen2, tmp_path_factory) -> Path:
    """The folder of every learner case's results (one spawn of the two ranks for the module)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_qwen2).vocab_size
    out = tmp_path_factory.mktemp("lora-learners")
    spawn_ranks(_learner_ranks, str(tiny_qwen2), LORA, make_batch(vocab), make_pairs(vocab), str(out))
    return out


def _grpo_case(rank, world, port, backend, model_path, cfg, batch, out):
    learner = _learner(backend, rank, world, port, model_path, cfg)
    shard = shard_for_rank(batch, rank, world)
    before = _raw(learner)
    ref0 = learner.logprobs(shard, reference=True)
    learner.train_step(shard, GRPOObjective(loss_agg="token-mean"))
    res = {"before": before, "after": _raw(learner), "ref0": ref0, "ref1": learner.logprobs(shard, reference=True),
           "policy1": learner.logprobs(shard), "trainable": sorted(n for n, p in learner.model.named_parameters()
                                                                    if p.requires_grad)}
    res["merged"] = {n: t.clone() for n, t in learner.served_weights(keep=True, sync=False)}
    res["pushed"] = {n: t.clone() for b in learner.iter_weight_buckets(2**16, torch.float32, keep=True) for n, t in b}
    learner.save(f"{out}/ckpt", model_path, "float32")
    second = shard_for_rank(make_batch(learner.model_config.vocab_size, seed=5), rank, world)
    res["step2"] = learner.train_step(second, GRPOObjective(loss_agg="token-mean")).loss
    torch.save(res, f"{out}/rank{rank}.pt")
    del learner
    # A fresh learner (the base model, new adapters, new optimizer, seed 0) that loads the checkpoint,
    # as a resumed run's does.
    resumed = _learner(backend, rank, world, port, model_path, cfg)
    resumed.load(f"{out}/ckpt")
    loss = resumed.train_step(second, GRPOObjective(loss_agg="token-mean")).loss
    torch.save(loss, f"{out}/resumed{rank}.pt")


def _base_logprobs(model_path, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from rlhf.algo.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids, batch.loss_mask)


LEARNER_BACKENDS = ["fsdp2", "deepspeed-zero2", "deepspeed-zero3"]


@pytest.mark.parametrize("backend", LEARNER_BACKENDS)
def test_lora_learner_trains_only_adapters_and_reference_is_the_base(backend, tiny_qwen2, lora_learners):
    """One step on 2 ranks: base weights untouched, every lora_B moved; the reference (adapters off)
    is the base model before and after; the merged weights equal PEFT's merge of the checkpoint's
    adapter (PEFT format), the adapter push is that adapter file's tensors, the HF export is the
    merged model, and a reloaded learner continues exactly."""
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)  # the batch the ranks stepped on
    folder = lora_learners / backend
    r0, r1 = (torch.load(folder / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["trainable"] and all(".lora_" in n for n in r0["trainable"])
    for name, before in r0["before"].items():  # B starts at 0, so A gets no gradient in step 1
        assert ".lora_" in name or torch.equal(before, r0["after"][name]), name
    assert any(".lora_B." in n and not torch.equal(r0["before"][n], r0["after"][n]) for n in r0["before"])
    base = _base_logprobs(tiny_qwen2, batch)
    ref = torch.cat([r0["ref1"], r1["ref1"]])
    torch.testing.assert_close(torch.cat([r0["ref0"], r1["ref0"]]), base, rtol=0, atol=1e-5)
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-5)
    assert (torch.cat([r0["policy1"], r1["policy1"]]) - base).abs().max() > 1e-3  # the adapter changed the policy
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = folder / "ckpt"
    assert {p.name for p in (ckpt / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32),
                                     str(ckpt / "adapter"))
    merged = dict(peft.merge_and_unload().named_parameters())
    assert sorted(r0["merged"]) == sorted(merged)
    for k, v in merged.items():
        torch.testing.assert_close(r0["merged"][k], v, rtol=0, atol=1e-6)
    from safetensors.torch import load_file  # what an adapter push sends: the checkpoint's adapter file

    assert r0["pushed"].keys() == load_file(str(ckpt / "adapter" / "adapter_model.safetensors")).keys()
    exported = AutoModelForCausalLM.from_pretrained(str(ckpt / "model"), dtype=torch.float32)
    for k, v in exported.named_parameters():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6)
    assert torch.load(folder / "resumed0.pt") == r0["step2"]


def _dpo_case(rank, world, port, model_path, cfg, batch, out):
    """Three DPO steps with the adapters-off reference, then, on a fresh learner, with a separate
    frozen reference model."""
    objective = DPOObjective(beta=0.1, loss_type="sigmoid")
    shard = shard_for_rank(batch, rank, world)
    for with_reference in (False, True):
        learner = _learner("fsdp2", rank, world, port, model_path, cfg, with_reference=with_reference)
        assert (learner.reference is not None) == with_reference
        losses = []
        for _ in range(3):
            step = attach_reference(shard, learner.logprobs(shard, reference=True))
            losses.append(learner.train_step(step, objective).loss)
        torch.save(losses, f"{out}/dpo{int(with_reference)}_{rank}.pt")
        del learner


def test_dpo_adapters_off_reference_equals_a_separate_frozen_reference(lora_learners):
    off, frozen = (torch.load(lora_learners / f"dpo{i}_0.pt") for i in (0, 1))
    assert off[0] != off[-1]  # it trains
    assert off == pytest.approx(frozen, abs=1e-5)


# ---------------------------------------------------------------------- the engine


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_engine_serves_each_pushed_lora_policy(sync, tiny_qwen2):
    """Two pushes of different adapters: after each, the engine's sampled-token log-probs equal
    HF+PEFT's on the same tokens."""
    pytest.importorskip("vllm")
    from actors.vllm_generator import VLLMGenerator
    from rlhf.config import GenerationConfig
    from rlhf.types import SamplingSpec

    cfg = dataclasses.replace(LORA, lora_sync=sync)
    gen = VLLMGenerator(str(tiny_qwen2), GenerationConfig(enforce_eager=True, cpu_kvcache_gib=1), dtype="float32",
                        seed=0, enable_sleep=False, lora=cfg if sync == "adapter" else None)
    try:
        prompts = [[5, 9, 13, 2], [7, 7, 30]]
        for seed in (1, 2):
            peft = _peft_model(tiny_qwen2, cfg, seed=seed)
            named = [(n, p.detach().clone()) for n, p in peft.named_parameters()]
            stream = adapter_weights(named) if sync == "adapter" else merged_weights(named, 2.0)
            gen.update_weights(list(stream))
            gen.finish_weight_update()
            out = gen.generate(prompts, SamplingSpec(n=2, max_new_tokens=6, temperature=1.0, seed=3))
            peft.eval()
            for i, c in enumerate(out):
                expected = _hf_logprobs(peft, prompts[i // 2], c.token_ids)
                torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-4)
        # An engine actor's teardown (killed next) removes the adapter folder, which would outlive
        # the process, and leaves the in-process engine core to die with it.
        folder = gen._lora_root
        assert (folder is not None) == (sync == "adapter") and (folder is None or Path(folder).is_dir())
        gen.shutdown(process_exits=True)
        assert folder is None or not Path(folder).exists()
        assert hasattr(gen, "llm")  # the engine core was left alone
    finally:
        gen.shutdown()
        assert not hasattr(gen, "llm") and gc.get_freeze_count() == 0  # nothing left frozen


# ---------------------------------------------------------------------- end to end (Ray + vLLM-CPU)


STEPS = 3
COMMON = [f"grpo.steps={STEPS}", "save_every=1", "learner.lr=1e-2", "data.num_train=32", "data.num_eval=4",
          "grpo.kl_coef=0.05", "learner.lora_rank=8",
          "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"]
DETERMINISTIC = ["reward/mean", "reward/std", "loss", "kl", "clip_frac", "response_len/mean", "grad_norm"]


def _grpo(output_dir: Path, *extra: str):
    return run_training("scripts/train_grpo.py", "configs/grpo_lora_tiny_cpu.yaml", output_dir, *COMMON, *extra)


@pytest.fixture(scope="module", params=["adapter", "merged"])
def grpo_run(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"lora-{request.param}")
    proc = _grpo(out, f"learner.lora_sync={request.param}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return request.param, out


@pytest.mark.e2e
@pytest.mark.ray
def test_grpo_lora_engine_serves_the_learner_policy_after_every_sync(grpo_run):
    """The mismatch is measured on each step's sampled tokens, right after a sync: in fp32 it is
    noise only when the engine serves exactly the learner's (HF+PEFT) policy. lr=1e-2 moves the
    adapters far past the bound each step, so a missed sync fails here."""
    _, out = grpo_run
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["mismatch/logprob_abs_diff"] < 1e-4 for r in records), [r["mismatch/logprob_abs_diff"] for r in records]
    assert all("timing/sync_s" in r for r in records)
    assert records[-1]["kl"] > 0  # the adapters-off reference differs from the trained policy
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and (ckpt / "model" / "model.safetensors").exists()


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.parametrize("grpo_run", ["adapter"], indirect=True)  # one resume run: the adapter path carries more state
def test_grpo_lora_resumed_run_continues_exactly(grpo_run, tmp_path):
    """A run resumed from the uninterrupted run's step-1 checkpoint (adapters, their optimizer
    state, the data position; the engine loads the base weights and gets the adapters in the push
    before the first generation) repeats its steps 1 and 2. Killing a run mid-way is
    tests/e2e/test_grpo_e2e.py's and tests/e2e/test_faults.py's: a checkpoint is the same folder whether the run then dies or not."""
    sync, full = grpo_run
    out = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_000001", out / "checkpoints" / "step_000001")
    resumed = _grpo(out, f"learner.lora_sync={sync}", "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    expected = {r["step"]: r for r in read_metrics(full / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    for step in range(1, STEPS):
        for k in DETERMINISTIC:
            assert got[step][k] == pytest.approx(expected[step][k], rel=1e-5, abs=1e-7), (step, k)


@pytest.mark.e2e
@pytest.mark.ray
def test_dpo_lora_adapters_off_reference_equals_the_precomputed_one(tmp_path):
    """DPO with LoRA: the reference is the policy with adapters off at every step; the precomputed
    path scores the reference once, from the step-0 policy (B = 0: the base model). Same losses."""
    common = ["dpo.max_steps=3", "save_every=0", "eval_every=0", "learner.lora_rank=8", "learner.lr=1e-2"]
    runs = {}
    for precompute in ("false", "true"):
        out = tmp_path / precompute
        proc = run_training("scripts/train_dpo.py", "configs/dpo_lora_tiny_cpu.yaml", out, *common,
                            f"dpo.precompute_ref={precompute}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        runs[precompute] = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 0]
    assert len(runs["false"]) == 3 and runs["false"][0] != runs["false"][-1]
    assert runs["false"] == pytest.approx(runs["true"], abs=1e-5)
