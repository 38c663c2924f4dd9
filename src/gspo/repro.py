"""The same numbers on another machine: what decides a CPU run's floating-point results, recorded
beside its metrics, and the reproducible mode (config field ``reproducible``) that pins it.

Measured on gspo's tiny MoE (a 30-step warm start and 2 RL steps, every weight of ``final/``
compared bit for bit; docs/guides/reproducibility.md), each of these alone changes every weight:

- **intra-op threads** (``torch.get_num_threads()``, the machine's core count by default): ATen and
  MKL split sums across threads, so 1 and 2 threads add in different orders;
- **ATen's kernel ISA** (``ATEN_CPU_CAPABILITY``, picked from the CPU: ``avx2``, ``avx512``...): exp,
  softmax, SiLU and sums of the vectorised kernels differ in their last bits from the baseline ones;
- **MKL's code branch** (``MKL_CBWR``; unset, MKL picks kernels by CPU model and cache sizes): every
  matmul.

oneDNN (``ONEDNN_MAX_CPU_ISA``) is not on gspo's float32 CPU path (setting it changed nothing); the
mode pins it anyway. The mode runs one thread, ATen's baseline kernels, MKL's ``COMPATIBLE``
branch in strict mode (the same results on every x86-64 CPU, Intel's CNR promise) and
deterministic algorithms. ATen reads its ISA and MKL its branch at their first use, not at import,
so :func:`pin` sets the variables and then asks both what they run: a kernel that already ran
before the pin is refused in one line. Across machines the mode needs the same torch build (its
MKL), Python packages and x86-64: ARM builds have no MKL and other baseline kernels.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from gspo.errors import GspoError

# what the reproducible mode sets before torch's kernels first run
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE,STRICT",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS (GPU runs: run-to-run only, untested here)
}
# the variables that choose kernels or threads, recorded in every run's environment.json
KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES",
)  # fmt: skip
ENV_FILE = "environment.json"


def pin() -> None:
    """Reproducible mode for this process (and the processes it starts, which inherit the
    variables): :data:`PINNED_ENV`, one torch thread, deterministic algorithms. Raises a one-line
    GspoError when ATen or MKL already chose other kernels (torch ran CPU work before the pin)."""
    import torch

    from gspo.compat import mkl_cbwr

    os.environ.update(PINNED_ENV)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    aten = torch.backends.cpu.get_cpu_capability()
    branch = mkl_cbwr.branch()
    if aten != "DEFAULT" or branch not in (None, mkl_cbwr.COMPATIBLE):
        mkl = mkl_cbwr.NAMES.get(branch, str(branch))
        set_first = " ".join(f"{k}={v}" for k, v in PINNED_ENV.items() if k != "CUBLAS_WORKSPACE_CONFIG")
        raise GspoError(
            f"config field 'reproducible': torch ran CPU kernels before gspo could pin them (ATen {aten}, "
            f"MKL branch {mkl}); start Python with {set_first}, or run gspo before any torch operation"
        )


def run_environment() -> dict[str, Any]:
    """What decides this process's floating-point results: versions, threads, the kernels ATen and
    MKL run (their ISA and branch), the variables that choose them, the CPU. Asking ATen and MKL
    fixes their choice from the variables as they are now: call it after :func:`pin`, never before."""
    import torch

    from gspo.compat import mkl_cbwr

    blas = [
        ln.strip()
        for ln in torch.__config__.show().splitlines()
        if "Math Kernel" in ln or "oneDNN" in ln or "MKL-DNN" in ln
    ]
    branch = mkl_cbwr.branch()  # like the ISA below, fixed from the variables now if not yet
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "gspo": _version("gspo"),
        "numpy": _version("numpy"),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_branch": None if branch is None else mkl_cbwr.NAMES.get(branch, str(branch)),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "env": {k: os.environ.get(k) for k in KERNEL_ENV},
        "blas": blas,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "libc": " ".join(platform.libc_ver()),
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "asimd",
    "sve",
)


def _cpu_model() -> dict[str, Any]:
    """The CPU: model name, family / model / stepping and the ISA flags kernels are picked by
    (/proc/cpuinfo on Linux; platform's processor name elsewhere)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block is enough
            info.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    flags = set((info.get("flags") or info.get("features") or "").split())
    return {
        "model": info.get("model name") or platform.processor() or "unknown",
        "family": info.get("cpu family"),
        "model_id": info.get("model"),
        "stepping": info.get("stepping"),
        "isa_flags": [f for f in _ISA_FLAGS if f in flags],
    }


def write_environment(run_dir: Path, step: int, reproducible: bool | None = None) -> None:
    """Append this process's :func:`run_environment` to ``<run_dir>/environment.json`` (one entry per
    start or resume, from ``step`` on: a run resumed on another machine shows both)."""
    path = run_dir / ENV_FILE
    try:
        old = json.loads(path.read_text()) if path.exists() else []
    except (OSError, ValueError):
        old = []
    keep = (
        [e for e in old if isinstance(e, dict) and e.get("from_step", 0) < step]
        if isinstance(old, list)
        else []
    )
    entry = {"from_step": step, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    entry |= {"reproducible": reproducible} | run_environment()
    tmp = path.with_name(f"{ENV_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps([*keep, entry], indent=1))
    tmp.replace(path)


def read_environment(run_dir: Path) -> dict[str, Any] | None:
    """The newest entry of a run's ``environment.json`` (None: none, or not gspo's)."""
    try:
        entries = json.loads((run_dir / ENV_FILE).read_text())
    except (OSError, ValueError):
        return None
    last = entries[-1] if isinstance(entries, list) and entries else None
    return last if isinstance(last, dict) else None


_DESCRIBED = (
    ("reproducible mode", lambda e: "on" if e.get("reproducible") else "off"),
    ("torch", lambda e: e.get("torch")),
    ("transformers", lambda e: e.get("transformers")),
    ("Python", lambda e: e.get("python")),
    ("threads", lambda e: e.get("threads")),
    ("ATen kernels", lambda e: e.get("cpu_capability")),
    ("MKL branch", lambda e: e.get("mkl_branch")),
    ("CPU", lambda e: (e.get("cpu") or {}).get("model") if isinstance(e.get("cpu"), dict) else e.get("cpu")),
)


def describe(envs: dict[str, dict[str, Any] | None]) -> str:
    """One line saying what decided the numbers of these runs (run name -> its environment entry):
    each setting's value, or its values with how many runs had each."""
    known = [e for e in envs.values() if e]
    if not known:
        return "The runs recorded no environment.json (made before gspo recorded what decides their numbers)."
    parts = []
    for name, get in _DESCRIBED:
        counts: dict[str, int] = {}
        for e in known:
            counts[str(get(e))] = counts.get(str(get(e)), 0) + 1
        parts.append(
            f"{name} {next(iter(counts))}"
            if len(counts) == 1
            else f"{name} " + ", ".join(f"{v} ({n} runs)" for v, n in sorted(counts.items()))
        )
    missing = len(envs) - len(known)
    tail = f"; {missing} run(s) recorded none" if missing else ""
    return f"What decided the numbers ({len(known)} runs' environment.json): " + "; ".join(parts) + tail + "."
