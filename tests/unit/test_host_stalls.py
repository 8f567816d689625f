"""The per-step host-stall counters a learner reports ("Host stalls", actors/learner_base.py): time in
Python's collector (`actors.worker_setup.GcClock`), the caching allocator's driver calls
(`Device.allocator_calls`) and Triton's compiles (`actors.worker_setup.JitClock`)."""

from __future__ import annotations

import gc

import torch

from actors.device import CpuDevice, CudaDevice
from actors.worker_setup import GcClock, JitClock


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


def test_the_jit_clock_counts_triton_compiles_and_keeps_the_hooks_it_found():
    """Triton calls `jit_cache_hook` before compiling a kernel (a true answer skips the compile) and
    `jit_post_compile_hook` after; the clock counts and times each compile, passes both calls on
    to the hooks that were installed before it, answers as they do, and puts them back on close."""
    from triton import knobs

    runtime, calls = knobs.runtime, []
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = lambda **kw: calls.append(("before", kw["key"])) or kw["key"] == "cached"
    runtime.jit_post_compile_hook = lambda **kw: calls.append(("after", kw["key"]))
    try:
        earlier = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        clock = JitClock()
        assert runtime.jit_cache_hook(key="rope") is False  # compile it: the earlier hook's answer
        runtime.jit_post_compile_hook(key="rope")
        assert runtime.jit_cache_hook(key="cached") is True  # skipped: no compile follows
        assert clock.compiles == 1 and clock.seconds > 0
        assert calls == [("before", "rope"), ("after", "rope"), ("before", "cached")]
        clock.close()
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == earlier
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
    clock = JitClock()  # alone: no hooks to pass on
    try:
        assert runtime.jit_cache_hook(key="k") is None
        runtime.jit_post_compile_hook(key="k")
        assert clock.compiles == 1
    finally:
        clock.close()
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == saved


def test_no_jit_clock_where_triton_has_no_compile_hooks(monkeypatch):
    """A Triton without `knobs` (before 3.3), or none at all: the learner reports no compiles, and starts."""
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # `from triton import knobs` raises ImportError
    assert JitClock.start() is None
