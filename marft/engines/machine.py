"""Where a run ran: the CPU (and whether it does bf16 fast), the GPU, the model's device and dtype.
Read once per process; the sweep (torch-free) records the CPU line, runs and evaluations the whole
description, and ``model.dtype: auto`` picks bf16 from the same flags."""
from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return (names[0] if names else platform.processor() or platform.machine() or "unknown CPU"), frozenset(flags)


def bf16_flags() -> list[str]:
    """The CPU's fast-bf16 extensions present: ``amx_bf16``, ``avx512_bf16``."""
    return sorted(f for f in ("amx_bf16", "avx512_bf16") if f in cpu_info()[1])


def bf16_label(flags) -> str:
    """``AMX``, ``AVX-512 BF16`` or ``no bf16`` for a list of such flags."""
    return "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else "no bf16"


def cpu_line() -> str:
    """The CPU a run ran on, with its matrix extension and core count: numbers differ across machines."""
    return f"{cpu_info()[0]}, {bf16_label(bf16_flags())}, {os.cpu_count()} cores"


def describe_machine(model=None) -> dict:
    """Where a run ran, for its run folder and its evaluations: the CPU (model name, cores, its
    fast-bf16 extensions), torch threads, the GPU if any, and the model's device and dtype; with
    library versions."""
    import torch
    import transformers

    p = next(model.parameters()) if model is not None else None
    gpu = p.device if p is not None and p.device.type == "cuda" else None  # the model's GPU, else the current one
    out = {
        "cpu": cpu_info()[0],
        "cpu_cores": os.cpu_count(),
        "cpu_bf16": bf16_flags(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(gpu) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if p is not None:
        out.update(device=str(p.device), dtype=str(p.dtype).replace("torch.", ""))
    return out


def memory_stats(device=None) -> dict[str, float]:
    """Memory in GB (1e9 bytes) for a run's metrics, as verl and NeMo RL log it: ``memory/rss_gb``,
    this process's resident memory now, and ``memory/max_rss_gb``, the most it has held since it
    started (where the platform says: /proc/self/status, else ``getrusage``); on a CUDA ``device``,
    ``memory/cuda_peak_gb`` (the most allocated since the last call, whose counter it resets) and
    ``memory/cuda_reserved_gb`` (held by torch's caching allocator now)."""
    out: dict[str, float] = {}
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS:", "VmHWM:"))}
        out["memory/rss_gb"] = kb["VmRSS"] * 1024 / 1e9
        out["memory/max_rss_gb"] = kb["VmHWM"] * 1024 / 1e9
    except (OSError, KeyError, ValueError, IndexError):
        try:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
            out["memory/max_rss_gb"] = peak / 1e9 if platform.system() == "Darwin" else peak * 1024 / 1e9
        except (ImportError, OSError):
            pass
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        import torch

        out["memory/cuda_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        out["memory/cuda_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)
    return out
