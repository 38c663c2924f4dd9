"""Run untrusted Python (model-written code) in a confined subprocess, optionally with a test verdict.

Layers, from strongest to weakest:

* **filesystem (Landlock)**: the program may read and execute only the Python installation (its
  prefixes and site-packages), ``/usr``, ``/lib*``, ``/bin`` and a few device/loader files, and may
  write only in its work dir (its cwd, ``HOME`` and ``TMPDIR``). Everything else —
  ``/etc/passwd``, ``/root``, the project, checkpoints, ``/tmp``, ``/proc``, ``/sys``,
  ``/dev/shm`` — is unreadable and unwritable. The ruleset is applied by the kernel before the
  interpreter starts, cannot be lifted, and covers every child process. Not covered by Landlock:
  ``stat()`` (file existence and metadata stay visible) and ``chmod``/``chown``/``utime``/xattrs,
  which the next layer handles;
* **no root**: when the trainer runs as root the program runs as a fresh unprivileged uid (one
  per call), keeping only CAP_DAC_READ_SEARCH (so it can reach an interpreter under ``/root``;
  Landlock still decides what it may read); it can therefore not chmod/chown files it does not own,
  signal or ptrace other processes, or bypass ``RLIMIT_NPROC``. When the trainer is not root, a
  seccomp filter refuses the metadata syscalls (chmod, chown, utime, xattr, truncate by path)
  instead;
* **seccomp** (always): ``socket()`` of every family, unix included, so the program never holds a
  socket that could connect or send a datagram or a descriptor (SCM_RIGHTS) to a host socket file;
  ``socketpair(AF_UNIX)`` stays (asyncio's self-pipe), a pair connected only to itself. Also refused:
  io_uring (it can open sockets), ``memfd_create``/``memfd_secret``, System V IPC and POSIX message
  queues (memory outside ``RLIMIT_AS`` and the work dir's tmpfs), new namespaces (``unshare``, ``setns``,
  ``clone`` flags; ``clone3`` answers ENOSYS so libc falls back to ``clone``), mounts, bpf,
  userfaultfd, perf events, keyrings, clearing the parent-death signal, ptrace,
  process_vm_readv/writev, pidfd_getfd, open_by_handle_at;
* **namespaces** (as root, or with unprivileged user namespaces): a new network namespace (only a
  down loopback), IPC namespace, PID namespace whose PID 1 is the program, and mount namespace whose
  work dir is a **private tmpfs** (``max_disk_mb`` bytes, ``max_files`` inodes in all; over an
  existing host dir such as ``/tmp``, so the work dir exists only in that namespace and nothing of it
  outlives the call). When PID 1 exits or is killed, the kernel kills every process left in the
  namespace (``setsid()``, double forks) before the launcher's wait returns, so nothing runs on once
  :func:`run_untrusted` has returned. PR_SET_PDEATHSIG chains trainer -> launcher -> program: a
  ``kill -9`` of the trainer or of the launcher ends the namespace too. Without namespaces: a
  Python-level shim makes ``socket.socket`` (AF_INET/6) raise ``OSError("network disabled in
  sandbox")``, Landlock (ABI >= 4) refuses TCP bind/connect, the work dir is a host dir named
  ``gspo-sandbox-<trainer pid>-*`` (removed after the call, or by the next process after a crash),
  with no total disk limit, and a ``setsid()`` child can outlive the call. ``SandboxResult``'s
  ``network_isolation``, ``pid_namespace``, ``private_tmpfs`` and ``memory_cgroup`` say what was used;
* a minimal environment, stdin on /dev/null, ``python -I`` (no user site, no PYTHON* variables,
  script dir not on ``sys.path``);
* rlimits: address space (``memory_mb``, per process), CPU seconds, max file size, no core dumps, open
  files, processes (enforced when not running as root — which, with the uid switch, is always);
* a wall-clock timeout after which the launcher SIGKILLs the program (and with it the namespace).

**Total memory of one call**: where this process's cgroup-v1 memory controller lets it make a child
cgroup (probed once; ``SandboxResult.memory_cgroup``), every call gets its own, limited to
``memory_mb + max_disk_mb`` for all its processes together (anonymous memory and tmpfs pages);
removed after the call, or by the next process's first call after a crash. Elsewhere (cgroup v2 only:
a cgroup that holds the trainer cannot enable controllers for children without moving the trainer)
the bound is per process: ``(max_procs + 1) * memory_mb`` address space, plus ``max_disk_mb`` of tmpfs,
plus kernel socket/pipe buffers (about 56 MB per process through socketpairs at ``max_open_files``).

**Without Landlock** (Linux < 5.13, or ``landlock`` missing from the kernel's LSM list):
:func:`run_untrusted` fails closed with :class:`SandboxUnavailable`, a one-line message saying so,
unless called with ``require_fs_isolation=False`` (or :data:`REQUIRE_FS_ISOLATION` is set False),
which runs it anyway and warns once: then reads are unrestricted and, as root, writes are
limited by file permissions of the unprivileged uid only (world-writable directories such as /tmp
stay writable). A policy that writes files is the kind of accident this is meant to stop, so a silent
downgrade would be the wrong default.

**Test verdicts** (``run_untrusted(code, tests=...)``, what the ``code`` reward uses): a harness runs
``code`` as ``__main__``, then the tests, and reports success only by writing a 256-bit nonce that the
program never sees to a dedicated pipe, after the tests ran to the end without an exception. The
nonce arrives on a descriptor the harness reads and closes before the program starts and lives only
on the interpreter's evaluation stack (invisible to Python code, even to ``gc``), so any exit
(``sys.exit(0)``, ``os._exit(0)``, signals, ``atexit``), any output and any write to any descriptor by
the program scores nothing. Before the program runs the harness installs an audit hook (PEP 578;
Python code cannot remove it) that refuses frame and GC introspection (``sys._getframe``,
``tb_frame``, ``gi_frame``, ``gc.get_objects``...), tracing, ctypes and ``/proc``, and disables Python-level signal handlers (a handler receives the interrupted frame). The
tests run in their own namespace: the solution's top-level names as they were when it finished,
pristine builtins (``all``, ``len``, ``__import__``... even if the solution shadows or patches them)
and copies of the modules the tests import taken before the solution ran; so redefining test names or
patching builtins, ``sys.modules`` or module attributes does not reach them, and ``assert`` raises the
real ``AssertionError`` whatever the solution rebinds. The tests' comparisons (``==``, ``!=``, ``<``,
``in``...) compare builtin data by value (subclasses of builtins by their underlying value) and reject
an object whose Python-level ``__eq__``/ordering/``__contains__`` also accepts random probe values (an
"equals everything" object, ``mock.ANY``). The solution must not leave threads running.
Not defended: an attacker who can corrupt interpreter memory (hand-crafted bytecode via
``marshal``/``.pyc``, raw pointers through numpy's ``__array_interface__``, a CPython crash bug) can
forge anything in-process; without Landlock a child process can read the harness's memory through
``/proc``; tests that pass their own functions/classes to the program expose their namespace through
``__globals__``; library classes (``Counter``...) the tests use can be monkeypatched. Tests must be
plain statements: ``SystemExit`` from anywhere (including ``unittest.main()``) is a failure, and
signal handlers are unavailable to the program.

Linux only (macOS: no namespaces, no Landlock, RLIMIT_AS not enforced, untested).

Own implementation (raw syscalls through ctypes) rather than a library or bubblewrap: see
``docs/sandbox.md`` for what was evaluated and why. Each layer is pinned by tests/test_sandbox*.py
and tests/test_code_reward_hacks.py.

Layout. Trainer side: this module (the API), ``host`` (kernel features, Landlock rules, work dirs,
cgroups, uids, cleanup), ``programs`` (the code the children run, the tests' compilation, argv),
``process`` (start, read, stop the launcher). Child side, standard library only, compiled once in the
trainer and run through ``boot.py``: ``launcher`` (namespaces, tmpfs, rlimits, fork, wait),
``confine`` (uid, seccomp, Landlock), ``harness`` and ``protected`` (the test verdict), ``shim``.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from gspo.errors import GspoError
from gspo.tasks.sandbox import host, process, programs
from gspo.tasks.sandbox.host import landlock_abi

__all__ = [
    "REQUIRE_FS_ISOLATION",
    "SandboxResult",
    "SandboxUnavailable",
    "check_filesystem_isolation",
    "landlock_abi",
    "run_untrusted",
]

NetworkIsolation = Literal["netns", "shim"]
FilesystemIsolation = Literal["landlock", "none"]

# Tests set this False to exercise the shim fallback on machines where namespaces work.
_TRY_NAMESPACES = True
# Tests set this False to exercise the no-Landlock path on machines that have it.
_TRY_LANDLOCK = True

REQUIRE_FS_ISOLATION = True
"""Default of ``run_untrusted(require_fs_isolation=...)``: refuse to run without Landlock."""


class SandboxUnavailable(GspoError):
    """The kernel cannot provide a required isolation layer (e.g. no Landlock)."""


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    """Exit code 0 and no time limit hit."""
    returncode: int
    """Exit code; negative signal number when killed (-9 on the wall-clock or CPU limit)."""
    stdout: str
    stderr: str
    timed_out: bool
    """Killed by the wall-clock timeout or the CPU-time limit."""
    network_isolation: NetworkIsolation
    pid_namespace: bool = False
    """Ran as PID 1 of its own PID namespace: no descendant survives it, even after ``setsid()``."""
    output_truncated: bool = False
    """stdout or stderr exceeded ``max_output_bytes`` (the rest was read and dropped)."""
    filesystem_isolation: FilesystemIsolation = "none"
    """``landlock`` when the program could only write its temp dir and read the Python runtime."""
    uid: int | None = None
    """The unprivileged uid the program ran as (the trainer was root), else None."""
    private_tmpfs: bool = False
    """The work dir was a private tmpfs of ``max_disk_mb``/``max_files`` that only this call's mount
    namespace saw (total disk and inode limits; nothing of it outlives the call)."""
    memory_cgroup: bool = False
    """All processes of the call shared one memory limit, ``memory_mb + max_disk_mb`` (a cgroup-v1
    memory controller, where the trainer's cgroup allows one per call); else only per process."""
    passed: bool | None = None
    """With ``tests``: the harness ran the program and every test to the end and reported so on its
    private channel (the only thing the ``code`` reward trusts). None without ``tests``."""


def _no_landlock_reason() -> str:
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} has no Landlock"
    return (
        f"kernel {os.uname().release} does not provide Landlock (needs Linux >= 5.13 with 'landlock' "
        "in the boot-time LSM list, see /sys/kernel/security/lsm)"
    )


def fs_available() -> bool:
    return _TRY_LANDLOCK and landlock_abi() > 0


def check_filesystem_isolation() -> None:
    """Raise :class:`SandboxUnavailable` now (at startup) if :func:`run_untrusted` would refuse to run."""
    if REQUIRE_FS_ISOLATION and not fs_available():
        raise SandboxUnavailable(unavailable_message())


def unavailable_message() -> str:
    return (
        f"code sandbox: no filesystem isolation: {_no_landlock_reason()}, so sandboxed code could read "
        "and write every file this process can; run on such a kernel, or pass "
        "require_fs_isolation=False (only inside a disposable container/VM)"
    )


_warned_lock = threading.Lock()
_warned = False


def _warn_unconfined() -> None:
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"code sandbox runs WITHOUT filesystem isolation ({_no_landlock_reason()}): sandboxed code can "
        "read every file this process can",
        RuntimeWarning,
        stacklevel=3,
    )


def _check_child_files() -> None:
    """Without Landlock only file permissions keep the sandbox's uid from rewriting what later calls
    run (boot.py, shim.py): refuse a world-writable install."""
    for path in (host.BOOT, host.SHIM):
        bad = host.writable_by_others(path)
        if bad is not None:
            raise SandboxUnavailable(
                f"code sandbox: {bad} is writable by other users, so sandboxed code (without Landlock) "
                f"could change {path}, which later calls run; fix its permissions"
            )


def _check_limits(timeout_s: float, memory_mb: int, max_disk_mb: int, max_files: int) -> None:
    if timeout_s <= 0 or memory_mb <= 0 or max_disk_mb <= 0 or max_files <= 0:
        raise ValueError(
            f"timeout_s, memory_mb, max_disk_mb and max_files must be positive, got {timeout_s}, "
            f"{memory_mb}, {max_disk_mb}, {max_files}"
        )


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def run_untrusted(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    *,
    tests: str | None = None,
    max_output_bytes: int = 1 << 20,
    max_file_mb: int = 16,
    max_disk_mb: int = 64,
    max_files: int = 2048,
    max_open_files: int = 256,
    max_procs: int = 64,
    require_fs_isolation: bool | None = None,
) -> SandboxResult:
    """Run Python source ``code`` as ``main.py`` in a fresh work dir under the limits above.

    ``tests``: Python statements (asserts) run after ``code`` by the harness; ``result.passed`` is
    the verdict. ``memory_mb``: address space per process; with a memory cgroup (see the module doc)
    also ``memory_mb + max_disk_mb`` for all processes together. ``cpu_s`` defaults to
    ``ceil(timeout_s) + 1`` (a backstop; the wall clock normally fires first).
    ``max_disk_mb``/``max_files``: size and inodes of the work dir's private tmpfs (all
    files together; ``max_file_mb`` caps each one). ``max_procs`` extra processes/threads via
    RLIMIT_NPROC. ``require_fs_isolation`` (default :data:`REQUIRE_FS_ISOLATION`): raise
    :class:`SandboxUnavailable` when Landlock is unavailable instead of running unconfined.
    """
    _check_limits(timeout_s, memory_mb, max_disk_mb, max_files)
    require = REQUIRE_FS_ISOLATION if require_fs_isolation is None else bool(require_fs_isolation)
    fs = fs_available()
    if not fs:
        if require:
            raise SandboxUnavailable(unavailable_message())
        _warn_unconfined()
    host.sweep_stale_dirs()
    uid = host.sandbox_uid()
    if uid is not None and not fs:
        _check_child_files()
    mount, workdir = host.work_dirs(_TRY_NAMESPACES)
    status_r, status_w = os.pipe()
    to_close = [status_r, status_w]
    cgroup = host.call_cgroup((memory_mb + max_disk_mb) << 20, _TRY_NAMESPACES)
    try:
        # errors="replace": a lone surrogate in model output must not crash the caller.
        code_fd = host.payload_fd(code.encode("utf-8", "replace"))
        to_close.append(code_fd)
        argv, shim_argv, child_fds, verdict_r, nonce = programs.program_argv(tests, fs, to_close)
        cfg = {
            "parent": os.getpid(),
            "cgroup": cgroup,
            "status_fd": status_w,
            "code_fd": code_fd,
            "child_fds": child_fds,
            "namespaces": _TRY_NAMESPACES,
            "mount": mount,
            "workdir": workdir,
            "disk_bytes": max_disk_mb << 20,
            "inodes": max_files + 3,  # the tmpfs root, the work dir, main.py
            "memory_bytes": memory_mb << 20,
            "cpu_s": max(1, int(cpu_s) if cpu_s is not None else math.ceil(timeout_s) + 1),
            "fsize_bytes": max_file_mb << 20,
            "nofile": max_open_files,
            "nproc": host.nproc(uid, max_procs),
            "argv": argv,
            "shim_argv": shim_argv,
            "landlock_abi": landlock_abi() if fs else 0,
            "workdir_access": host.FS_WORKDIR,
            "rules": list(map(list, host.base_rules())),
            "uid": uid,
            "require_fs": require,
        }
        proc = process.spawn(cfg, [status_w, code_fd, *child_fds], to_close)
        return _collect(proc, status_r, verdict_r, nonce, max_output_bytes, timeout_s, cfg["cpu_s"])
    finally:
        _close_all(to_close)
        shutil.rmtree(workdir, ignore_errors=True)  # only exists on the host without a private tmpfs
        host.remove_cgroup(cgroup)


def _collect(
    proc: Any, status_r: int, verdict_r: int, nonce: bytes, cap: int, timeout_s: float, cpu: int
) -> SandboxResult:
    """Read the launcher's output, status and verdict pipes until it is done; the result."""
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    if verdict_r >= 0:
        bufs[verdict_r] = bytearray()
    finished, truncated, usage = process.read_until_exit(proc, bufs, cap, timeout_s)
    proc.stdout.close()
    proc.stderr.close()
    nonce_ok = bytes(bufs[verdict_r]) == nonce if verdict_r >= 0 else None
    return _result(proc.returncode, finished, truncated, usage, bufs, out_fd, err_fd, status_r, cpu, nonce_ok)


def _result(
    rc: int,
    finished: bool,
    truncated: bool,
    usage: Any,
    bufs: dict[int, bytearray],
    out_fd: int,
    err_fd: int,
    status_r: int,
    cpu: int,
    nonce_ok: bool | None,
) -> SandboxResult:
    status = bytes(bufs[status_r]).decode("ascii", "replace")
    if status.startswith("fail:"):
        raise SandboxUnavailable(f"code sandbox: cannot confine the program: {status[5:]}")
    cpu_hit = rc == -signal.SIGXCPU or (
        rc == -signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu - 0.05
    )
    timed_out = not finished or cpu_hit
    fields = status.split("|")
    ok = rc == 0 and not timed_out
    return SandboxResult(
        ok=ok,
        returncode=rc,
        stdout=bufs[out_fd].decode("utf-8", "replace"),
        stderr=bufs[err_fd].decode("utf-8", "replace"),
        timed_out=timed_out,
        network_isolation="netns" if fields[0].startswith("netns") else "shim",
        pid_namespace=fields[0].endswith("+pid"),
        output_truncated=truncated,
        filesystem_isolation="landlock" if any(f.startswith("landlock=") for f in fields) else "none",
        uid=next((int(f[4:]) for f in fields if f.startswith("uid=")), None),
        private_tmpfs="tmpfs" in fields,
        memory_cgroup="cgroup" in fields,
        passed=None if nonce_ok is None else (ok and nonce_ok),
    )
