"""Memory a process holds: its resident size now and at its peak, a device's free memory, and the peak over a block
of work (the allocator's on CUDA, the resident high-water mark on CPU): what bench, eval and serve report."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str, pid: int | str = "self") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss() -> int | None:
    """The process's resident memory now (Linux), or None where /proc is missing."""
    return _status_bytes("VmRSS")


def peak_rss(pid: int | str = "self") -> int | None:
    """A process's resident high-water mark (Linux), or None where /proc is missing or it has exited."""
    return _status_bytes("VmHWM", pid)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors now: CUDA free memory, or the kernel's MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``.

    On Linux the RSS high-water mark is reset by writing 5 to /proc/self/clear_refs, so each block gets its own
    peak (including memory that was already resident, e.g. the weights). Where that is impossible ``bytes`` is
    None and ``method`` says so; nothing else is substituted.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None
        self.method = "cuda max_memory_allocated" if device.type == "cuda" else "peak RSS (VmHWM)"

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self.method = "unavailable (no /proc/self/clear_refs)"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        elif self.method.startswith("peak RSS"):
            self.bytes = _status_bytes("VmHWM")
