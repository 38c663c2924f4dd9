"""Trainer-side process handling: start the launcher, collect its output, stop it and everything it
started."""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

from gspo.tasks.sandbox import host, programs

ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def exited(pid: int) -> bool:
    """True once ``pid`` has exited, without reaping it (its process-group id stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def pump(
    sel: selectors.BaseSelector, bufs: dict[int, bytearray], cap: int, deadline: float, pid: int | None = None
) -> tuple[bool, bool]:
    """Read the pipes until all hit EOF or process ``pid`` exits (True), or ``deadline`` (False).

    Keeps the first ``cap`` bytes per pipe and drains the rest, so the child never blocks on a full
    pipe. Returns (finished, truncated). Stopping at exit matters when a background child keeps
    the pipes open after the program itself is done.
    """
    truncated = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            return False, truncated
        for key, _ in sel.select(min(left, 0.05) if pid is not None else left):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf = bufs[key.fd]
            room = cap - len(buf)
            if len(chunk) > room:
                truncated = True
            if room > 0:
                buf += chunk[:room]
        if pid is not None and exited(pid):
            return True, truncated
    return True, truncated


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for child ``pid`` to exit, without reaping it."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            select.select([fd], [], [], timeout)
        finally:
            os.close(fd)
        return exited(pid)
    end = time.monotonic() + timeout
    while not exited(pid) and time.monotonic() < end:
        time.sleep(0.002)
    return exited(pid)


def stop(pid: int) -> None:
    """End the launcher ``pid`` and everything it started. SIGTERM makes it SIGKILL the program (with
    a PID namespace, its PID 1) and exit once that is reaped, i.e. once the kernel has emptied the
    namespace; then (or when it does not exit in time) SIGKILL its process group: the launcher and,
    without a PID namespace, the program's leftovers. The launcher is not reaped yet, so the pgid cannot be reused."""
    if not exited(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        wait_exit(pid, 5.0)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_until_exit(
    proc: subprocess.Popen, bufs: dict[int, bytearray], cap: int, timeout_s: float
) -> tuple[bool, bool, Any]:
    """Collect the pipes until the launcher exits or the deadline; stop it; reap it.
    Returns (finished in time, output truncated, the launcher's rusage)."""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        finished = truncated = False
        try:
            finished, truncated = pump(sel, bufs, cap, deadline, proc.pid)
            while finished and not exited(proc.pid):  # pipes closed but the process lives on
                if time.monotonic() >= deadline:
                    finished = False
                    break
                time.sleep(0.01)
        finally:
            # Always: on timeout (or KeyboardInterrupt) that is the point; otherwise it removes leftovers.
            stop(proc.pid)
            # wait4: the program's CPU time (the launcher waited for it) identifies a CPU-limit kill.
            _, wstatus, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wstatus)
        _, more = pump(sel, bufs, cap, time.monotonic() + 0.5)
    return finished, truncated or more, usage


def spawn(cfg: dict, fds: list[int], to_close: list[int]) -> subprocess.Popen:
    """Start the launcher (its own session: a stuck one is killed with its process group), handing it
    ``fds``, which this process then closes."""
    code_fd = host.payload_fd(programs.launcher_payload())
    to_close.append(code_fd)
    fds = [*fds, code_fd]
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", host.BOOT, json.dumps(cfg), str(code_fd)],
        cwd="/",
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=fds,
        start_new_session=True,
    )
    for fd in fds:
        os.close(fd)
        to_close.remove(fd)
    return proc
