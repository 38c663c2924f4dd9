"""concurrent.futures.ProcessPoolExecutor's worker table (CPython 3.10 to 3.14).

``shutdown(cancel_futures=True)`` cancels the queued jobs but lets the running ones finish; a compare
stopped by Ctrl-C or SIGTERM must end its workers now (a run inside its warm start would go on for
minutes). The executor has no public way to reach its processes: :func:`kill_workers` reads its
private ``_processes`` (PID -> ``multiprocessing.Process``). tests/test_compat.py checks that it
still finds them; ``applies()`` says whether the running Python is one it was written for.
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor

# the private instance attribute relied on (set in ProcessPoolExecutor.__init__, so not resolvable
# on the class: tests/test_compat.py checks it on a live executor)
UPSTREAM_ATTR = "_processes"


def applies() -> bool:
    """CPython keeps the workers in ``_processes`` from 3.2 on; written against 3.10 to 3.14."""
    return sys.implementation.name == "cpython" and (3, 10) <= sys.version_info[:2] <= (3, 14)


def kill_workers(ex: ProcessPoolExecutor) -> int:
    """SIGKILL every worker process of ``ex`` (none yet, or a Python without the table: nothing);
    returns how many were signalled."""
    workers = list((getattr(ex, "_processes", None) or {}).values())
    for proc in workers:
        proc.kill()
    return len(workers)
