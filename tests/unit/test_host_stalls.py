"""The per-step host-stall counters a learner reports ("Host stalls", actors/learner_base.py): time in
Python's collector (`actors.worker_setup.GcClock`) and the caching allocator's driver calls
(`Device.allocator_calls`)."""

from __future__ import annotations

import gc

import torch

from actors.device import CpuDevice, CudaDevice
from actors.worker_setup import GcClock


def test_the_gc_clock_counts_full_collections_and_their_seconds_until_closed():
    clock = GcClock()
    try:
        gc.collect(0)  # a young collection: timed, not full
        assert clock.full == 0 and clock.seconds > 0
        young = clock.seconds
        gc.collect()
        assert clock.full == 1 and clock.seconds > young
    finally:
        clock.close()
    gc.collect()
    assert clock.full == 1 and clock._tick not in gc.callbacks
    clock.close()  # closing twice is harmless


def test_allocator_calls_read_the_caching_allocators_counters(monkeypatch):
    stats = {"num_device_alloc": 42, "num_alloc_retries": 3, "num_device_free": 40}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: stats)
    assert CudaDevice().allocator_calls() == (42, 3)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: {})  # no CUDA context yet
    assert CudaDevice().allocator_calls() == (0, 0)
    assert CpuDevice().allocator_calls() == (0, 0)
