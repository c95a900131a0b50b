"""What the machine and this process hold (Linux /proc, CUDA): the defaults of a run's memory
budget (:mod:`mxconv.run.memory`) and the peak a run reports."""

from __future__ import annotations

import os
from typing import Any

HOST_FRACTION = 0.75  # --max-memory default: of MemAvailable at start, plus what the process holds
GPU_FRACTION = 0.8  # --max-gpu-memory default: of the device's free memory


def _proc_kib(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file (``... kB``) in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (free pages where there is no such file, None if unknown)."""
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is None:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return avail


def process_rss() -> int:
    """Resident memory of this process now (VmRSS), in bytes; 0 where it cannot be read."""
    return _proc_kib("/proc/self/status", "VmRSS") or 0


def process_peak_rss() -> int | None:
    """Peak resident memory of this process so far (VmHWM), in bytes; None where it cannot be read.

    Unlike ``ru_maxrss`` seen by a parent through ``wait4``, it is this program's own: on Linux the
    child of a process that once held N bytes reports at least N there (exec keeps the spawning
    address space's high-water mark), which made a benchmark's own peak look like mxconv's."""
    return _proc_kib("/proc/self/status", "VmHWM")


def default_host_budget() -> int | None:
    """``HOST_FRACTION`` of MemAvailable plus this process's RSS (None: unknown, no limit)."""
    avail = meminfo_available()
    return None if avail is None else int(HOST_FRACTION * avail) + process_rss()


def default_gpu_budget(device: Any) -> int | None:
    """``GPU_FRACTION`` of the free memory of CUDA ``device`` (None for the CPU)."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(GPU_FRACTION * free)
