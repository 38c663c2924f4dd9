"""tests/test_phase_memory.py's CPU phases, in a fresh process: prints the RSS at start and the two
phases' peaks, in MiB."""

import torch

from gspo.memory import phase_peak, proc_status_mib

MiB = 2**20
peaks = {}
start = proc_status_mib()["VmRSS"]
with phase_peak("big", peaks, "cpu"):
    x = torch.ones(256 * MiB // 4)  # written: resident, not just reserved
    del x
with phase_peak("small", peaks, "cpu"):
    torch.ones(1024).sum()
print(start, peaks["memory/big_peak_rss_gib"] * 1024, peaks["memory/small_peak_rss_gib"] * 1024)
