"""Host memory as the kernel reports it (a leaf module: data loading and the resource checks use it)."""

from __future__ import annotations


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
