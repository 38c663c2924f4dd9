"""MKL's code-branch setting (conditional numerical reproducibility, CNR), read from torch's own copy of
MKL: ``mkl_serv_cbwr_get``, the service function behind MKL's public ``mkl_cbwr_get``, which torch's
x86 wheels link statically into ``libtorch_cpu`` without exporting the public name.

MKL reads ``MKL_CBWR`` once, at its first call; :func:`gspo.repro.pin` sets it and then asks MKL
which branch it runs: a branch other than the pinned one means MKL ran before the pin. Where the
symbol is absent (torch without MKL: ARM, other builds) :func:`branch` says None and nothing is read.
"""

from __future__ import annotations

import ctypes
import os
import platform

UPSTREAM = [("libtorch_cpu", "mkl_serv_cbwr_get")]  # a C symbol of torch's library, not a Python name
# mkl_cbwr.h: MKL_CBWR_BRANCH selects the branch; MKL_CBWR_BRANCH_OFF (CNR off), AUTO, COMPATIBLE
BRANCH, OFF, AUTO, COMPATIBLE = 1, 1, 2, 3
NAMES = {OFF: "OFF (not pinned)", AUTO: "AUTO", COMPATIBLE: "COMPATIBLE"}


def applies() -> bool:
    """x86-64 torch wheels link MKL (2024.x in torch 2.13); elsewhere there is no MKL to ask."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _function() -> ctypes._CFuncPtr | None:
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        f = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_int]
    return f


def branch() -> int | None:
    """The MKL branch torch's MKL runs (reading it starts MKL's CNR setting from ``MKL_CBWR`` if MKL
    has not run yet); None where this torch has no MKL to ask."""
    f = _function() if applies() else None
    return None if f is None else int(f(BRANCH))
