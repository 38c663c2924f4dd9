"""Host memory as the kernel reports it (a leaf module: data loading and the resource checks use it)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def available_memory() -> int | None:
    """Bytes of memory available for new allocations (MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 (not installed, or no such information here)
        return None


def proc_status_mib() -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (its high-water mark) of this process in MiB; {} off Linux."""
    try:
        text = open("/proc/self/status").read()
    except OSError:
        return {}
    return {m[1]: int(m[2]) / 1024 for m in re.finditer(r"(VmRSS|VmHWM):\s+(\d+)", text)}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextmanager
def phase_peak(name: str, into: dict[str, float], device: Any) -> Iterator[None]:
    """Record the peak memory of one phase of a step into ``into`` (GiB): on a GPU the peak of
    tensors allocated (``memory/{name}_peak_gib``) and of the caching allocator's reserve
    (``memory/{name}_reserved_gib``), each reset when the phase starts; on the CPU the process's
    peak resident set (``memory/{name}_peak_rss_gib``, VmHWM reset through clear_refs; nothing
    where the kernel does not allow that). Absolute, not above the phase's start: they are the
    numbers ``gspo plan`` estimates per phase."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield
        into[f"memory/{name}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        into[f"memory/{name}_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        return
    reset = reset_peak_rss()
    yield
    peak = proc_status_mib().get("VmHWM") if reset else None
    if peak is not None:
        into[f"memory/{name}_peak_rss_gib"] = peak / 1024
