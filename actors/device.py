"""The one place that talks to the accelerator runtime (`torch.cuda`; ROCm builds map onto it).

Everything else asks `detect()` for a `Device` and calls its methods, so a CPU run and a GPU run go
through the same code with no `if torch.cuda.is_available()` scattered around. A CI grep can
enforce it: `torch.cuda` appears in this file only.

Decisions (docs/design/devices.md has the measurements behind them):
- Two implementations, picked once: CUDA when `torch.cuda.is_available()` (inside a Ray actor that
  means "this actor was given a GPU"), CPU otherwise.
- CPU memory: the process's resident set (`/proc/self/status`: VmRSS, peak VmHWM), because CPU
  tensors have no allocator of their own to ask; 0.0 where /proc is absent.
- Host threads: on CPU the learner ranks of a host share its cores (`share_host_threads`); on GPU
  the thread count is left as the launcher set it, and `cluster.pin_cores` puts each GPU's
  processes on its block of the host's cores (`host_cores`, the rule in actors/host_cores.py).
- Peak FLOP/s (`peak_flops(dtype)`): the dense matrix peak of the device (the denominator of MFU),
  from the vendors' data sheets by device name (`PEAK_TFLOPS`); None where unknown (CPUs, other
  GPUs), and then no MFU is reported rather than a guess.
- Compute dtype (`compute_dtype`, called by the launcher before any actor starts): bf16 only where
  the hardware computes it natively. A CPU without native bf16 (no AVX512-BF16/AMX on x86, no BF16
  extension on Arm, or PyTorch/oneDNN capped below it by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA)
  emulates it many times slower than fp32, so there `bfloat16` becomes `float32` (same math, more
  exact), and `auto` is bf16 on GPUs and native-bf16 CPUs, fp32 elsewhere.
- FP8 (`generation.quantization: fp8`) by one rule, `fp8_problem`: FP8 matrix hardware, i.e. NVIDIA
  compute capability 8.9+ (Ada, Hopper, Blackwell) or AMD gfx942/gfx950/gfx12 (MI300, MI325, MI350,
  MI355, RDNA4). vLLM would also start FP8 on older GPUs (Marlin weight-only kernels: memory saved,
  no FP8 math) and on MI200; rollouts there are refused, since the point is the speed. vLLM-CPU has
  no FP8 kernels.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from actors.host_cores import gpu_cores, host_gpu_ids

_GIB = 2**30

# Dense (no sparsity) tensor-core peaks in TFLOP/s: bf16, and fp32 as TF32 where the vendor lists it.
# Matched by substring of torch.cuda.get_device_name(), in this order (H100 PCIe before H100 SXM).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 378.0}),
    ("H100", {"bfloat16": 989.0, "float32": 494.0}),  # SXM / HBM3
    ("H200", {"bfloat16": 989.0, "float32": 494.0}),
    ("MI300X", {"bfloat16": 1307.0, "float32": 653.7}),
    ("MI250X", {"bfloat16": 383.0, "float32": 95.7}),
    ("MI250", {"bfloat16": 362.1, "float32": 90.5}),
    ("A100", {"bfloat16": 312.0, "float32": 156.0}),
)


def peak_tflops_for(device_name: str, dtype: str) -> float | None:
    """The table's peak for a device name and a compute dtype ("bfloat16", "float32"), or None."""
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            return peaks.get(dtype)
    return None


class Device(Protocol):
    """What the learners, generators and weight sync need to know about the accelerator."""

    kind: Literal["cuda", "cpu"]
    dist_backend: Literal["nccl", "gloo"]

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its device (before creating process groups or tensors)."""
        ...

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The torch.device tensors of rank `local_rank` live on."""
        ...

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the driver (before a colocated engine wakes up)."""
        ...

    def synchronize(self) -> None:
        """Wait for queued kernels (before timing, or before another process reads our memory)."""
        ...

    def memory_allocated_gib(self) -> float: ...

    def peak_memory_gib(self) -> float: ...

    def reset_peak(self) -> None: ...

    def allocator_calls(self) -> tuple[int, int]:
        """(driver allocations, failed ones retried after freeing the cache) of this process's caching
        allocator so far; each is a slow call inside a step, and a retry also a device-wide sync.
        (0, 0) where there is no such allocator (CPU)."""
        ...

    def share_host_threads(self, processes: int) -> None:
        """Size this process's intra-op thread pool for `processes` busy processes on the host."""
        ...

    def host_cores(self, host_gpus: Sequence[str]) -> list[int]:
        """This process's GPUs' block of the host's cores among `host_gpus` (`actors.host_cores`);
        [] where there is nothing to pin (a CPU run, whose threads `share_host_threads` sizes)."""
        ...

    def peak_flops(self, dtype: str) -> float | None:
        """Dense matrix peak in FLOP/s for compute in `dtype` (`PEAK_TFLOPS`); None where unknown."""
        ...

    def fp8_problem(self) -> str | None:
        """Why this device cannot run FP8 rollouts (`fp8_problem`), or None where it can."""
        ...


@dataclass(frozen=True)
class CudaDevice:
    """NVIDIA (and ROCm, which PyTorch exposes through the same `torch.cuda` API)."""

    kind: Literal["cuda", "cpu"] = "cuda"
    dist_backend: Literal["nccl", "gloo"] = "nccl"

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated_gib(self) -> float:
        return torch.cuda.memory_allocated() / _GIB

    def peak_memory_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / _GIB

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def allocator_calls(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats()
        return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))

    def share_host_threads(self, processes: int) -> None:
        pass  # the GPU does the work; keep the launcher's thread count

    def host_cores(self, host_gpus: Sequence[str]) -> list[int]:
        # Ray sets CUDA_VISIBLE_DEVICES (HIP_VISIBLE_DEVICES) of an actor to the GPU ids it was given.
        return gpu_cores(host_gpu_ids(os.environ, 0), host_gpus, sorted(os.sched_getaffinity(0)))

    def peak_flops(self, dtype: str) -> float | None:
        tflops = peak_tflops_for(torch.cuda.get_device_name(), dtype)
        return None if tflops is None else tflops * 1e12

    def fp8_problem(self) -> str | None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        arch = getattr(props, "gcnArchName", "") if torch.version.hip else ""
        return fp8_problem("cuda", props.name, (props.major, props.minor), arch)


def _proc_status_kib(field: str) -> int:
    """A `kB` line of /proc/self/status (VmRSS, VmHWM), 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class CpuDevice:
    """CPU: gloo process groups, no caches to empty, memory read from the OS."""

    kind: Literal["cuda", "cpu"] = "cpu"
    dist_backend: Literal["nccl", "gloo"] = "gloo"

    def set_device(self, local_rank: int) -> None:
        pass

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def empty_cache(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def memory_allocated_gib(self) -> float:
        return _proc_status_kib("VmRSS") * 1024 / _GIB

    def peak_memory_gib(self) -> float:
        return _proc_status_kib("VmHWM") * 1024 / _GIB

    def reset_peak(self) -> None:
        # Writing "5" to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
        try:
            with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def allocator_calls(self) -> tuple[int, int]:
        return 0, 0

    def share_host_threads(self, processes: int) -> None:
        # Ray gives an actor with a fractional CPU share one thread. Learners never run while the
        # generator or the reward pool works (the loop is sequential), so they split the cores,
        # unless RLHF_CPU_THREADS fixes the count (benchmarks with an equal thread budget per side).
        fixed = os.environ.get("RLHF_CPU_THREADS")
        torch.set_num_threads(int(fixed) if fixed else max(1, len(os.sched_getaffinity(0)) // max(1, processes)))

    def host_cores(self, host_gpus: Sequence[str]) -> list[int]:
        return []

    def peak_flops(self, dtype: str) -> float | None:
        return None  # CPU peaks depend on the ISA, the core count and the clock: no table

    def fp8_problem(self) -> str | None:
        return fp8_problem("cpu")


FP8_ROCM_ARCHS = ("gfx942", "gfx950", "gfx12")
"""AMD architectures with FP8 matrix instructions (`fp8_problem`), as prefixes of `gcnArchName`."""


def fp8_problem(kind: str, name: str = "", capability: tuple[int, int] = (0, 0),
                rocm_arch: str = "") -> str | None:
    """Why a device cannot run FP8 rollouts, a phrase, or None where it can ("FP8" in the module
    docstring). `kind` as `Device.kind`, `name` the GPU's, `capability` CUDA's (major, minor),
    `rocm_arch` the ROCm `gcnArchName` ("" on NVIDIA)."""
    if kind == "cpu":
        return "a CPU engine has no FP8 (vLLM-CPU has no FP8 kernels)"
    if rocm_arch:
        if rocm_arch.startswith(FP8_ROCM_ARCHS):
            return None
        return f"{name} ({rocm_arch.split(':')[0]}) has no FP8 matrix cores (AMD: MI300/MI325, MI350/MI355)"
    if tuple(capability) >= (8, 9):
        return None
    return (f"{name} (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor cores "
            f"(NVIDIA: 8.9+, i.e. L4/L40, H100/H200, B200)")


def cpu_bf16() -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, a one-line description of its capability): ATen's
    vector ISA (`torch.backends.cpu.get_cpu_capability()`, capped by ATEN_CPU_CAPABILITY), oneDNN's
    bf16 path (capped by ONEDNN_MAX_CPU_ISA) and the CPU's own bf16 flags (`compute_dtype`)."""
    aten = torch.backends.cpu.get_cpu_capability()
    onednn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    flags = _cpu_flags()
    native_flags = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})  # x86; "bf16": Arm's Features line
    vector_ok = aten not in ("DEFAULT", "NO AVX", "AVX2")  # AVX2 kernels convert bf16 element by element
    native = bool(native_flags) and onednn and vector_ok
    described = (f"ATen {aten}, oneDNN bf16 {'on' if onednn else 'off'}, "
                 f"bf16 instructions: {', '.join(native_flags) or 'none'}")
    return native, described


def cpu_capability() -> str:
    """One line for benchmark records and logs, e.g. 'ATen AVX512, oneDNN bf16 on, bf16 instructions:
    avx512_bf16 (native bf16)'."""
    native, described = cpu_bf16()
    return f"{described} ({'native' if native else 'emulated'} bf16)"


def isolate_cpu_compile_cache() -> None:
    """Point vLLM's compile cache (VLLM_CACHE_ROOT) of this process at a folder of this CPU's
    capability, e.g. `~/.cache/vllm/cpu-avx2-onednn-avx2`. vLLM keys its AOT-compiled CPU model by
    the model and config, not by the ISA that ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA allow, so an
    artifact built for AVX-512 fails to load under an AVX2 cap; vLLM then compiles again and writes
    over the file it has mapped, and the engine dies of SIGBUS at its first weight sync (measured:
    the SmolLM2 recipe under forced AVX2 after an unforced run). Call it before the engine starts."""
    tag = f"cpu-{torch.backends.cpu.get_cpu_capability()}-onednn-{os.environ.get('ONEDNN_MAX_CPU_ISA', 'any')}"
    tag = tag.lower().replace(" ", "")
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm")
    if os.path.basename(root) != tag:
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(root, tag)


def _cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (x86 `flags`, Arm `Features`); empty where absent."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compute_dtype(requested: str, kind: str | None = None) -> tuple[str, str]:
    """The dtype a run computes in for `model.dtype: requested` on a device of `kind` (this
    process's when None), and why, in words ("Compute dtype" in the module docstring). Returns
    float32 or bfloat16, never auto."""
    kind = kind or detect().kind
    if requested == "float32":
        return "float32", "requested"
    if kind != "cpu":
        return "bfloat16", "requested" if requested == "bfloat16" else "auto on a GPU"
    native, described = cpu_bf16()
    if native:
        return "bfloat16", "requested" if requested == "bfloat16" else f"auto on a CPU with native bf16 ({described})"
    return "float32", f"this CPU has no native bf16 ({described}), where bf16 runs many times slower than fp32"


def gpu_identity() -> tuple[str, float] | None:
    """(name, total memory in GiB) of this process's GPU 0, for the memory planner; None on CPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / _GIB


def detect() -> Device:
    """CUDA if this process sees a GPU, else CPU."""
    return CudaDevice() if torch.cuda.is_available() else CpuDevice()
