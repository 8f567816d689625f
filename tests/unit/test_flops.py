"""Model FLOPs from a config (hand-computed for a small shape and for Qwen2.5-1.5B's published size)
and the device peak table behind `perf/mfu`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf.planner.flops import matmul_params, train_flops, train_flops_per_token

SMALL = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=16, vocab_size=10)


def test_small_shape_hand_computed():
    # per layer: q, o 8x8 each = 128; k, v 8x4 each = 64; MLP 3 x 8 x 16 = 384 -> 576; 2 layers 1152
    # LM head 10 x 8 = 80 -> 1232
    assert matmul_params(SMALL) == 1232
    # 6 x 1232 + 12 x 2 layers x 8 (heads x head_dim) x 5 tokens
    assert train_flops_per_token(SMALL, 5) == 6 * 1232 + 12 * 2 * 8 * 5
    assert train_flops(SMALL, [5, 3]) == 5 * train_flops_per_token(SMALL, 5) + 3 * train_flops_per_token(SMALL, 3)


def test_qwen2_5_1_5b_matches_its_parameter_count():
    """Qwen2.5-1.5B: 1.54B parameters of which 0.23B embedding (tied with the LM head); its matmul
    parameters are the body (1.31B) plus the LM head once (0.23B), and biases are negligible."""
    qwen = SimpleNamespace(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=8960, vocab_size=151936)
    assert matmul_params(qwen) == pytest.approx(1.54e9, rel=0.01)


def test_device_peaks():
    from actors.device import CpuDevice, peak_tflops_for

    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops_for("NVIDIA H200", "float32") == 494.0
    assert peak_tflops_for("AMD Instinct MI300X", "bfloat16") == 1307.0
    assert peak_tflops_for("AMD Instinct MI250X", "bfloat16") == 383.0
    assert peak_tflops_for("NVIDIA GeForce RTX 4090", "bfloat16") is None  # unknown: no MFU, not a guess
    assert CpuDevice().peak_flops("bfloat16") is None
