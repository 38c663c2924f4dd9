"""Run untrusted Python (model-written code) in a resource-limited subprocess.

Layers, from strongest to weakest:

* a fresh temp dir as cwd, a minimal environment, stdin on /dev/null, ``python -I`` (no user site,
  no PYTHON* variables, script dir not on ``sys.path``);
* rlimits: address space (``memory_mb``), CPU seconds, max file size, no core dumps, open files;
* a new network namespace (only a down loopback, so every connect fails) and a new PID namespace
  (when the sandboxed interpreter, PID 1 there, dies, the kernel kills every process it left,
  including ones that ``setsid()`` out of the process group). Needs CAP_SYS_ADMIN (root) or
  unprivileged user namespaces; otherwise a best-effort shim makes ``socket.socket`` (AF_INET/6)
  and ``socket.create_connection`` raise ``OSError("network disabled in sandbox")`` (bypassable via
  ctypes or a subprocess: it stops accidents, not attackers). ``SandboxResult.network_isolation``
  says which one was used;
* a wall-clock timeout that SIGKILLs the whole process group.

The limits are applied by a tiny bootstrap interpreter, not by ``preexec_fn``: ``preexec_fn`` runs
Python code between fork and exec and can deadlock in a multi-threaded parent (the trainer, the
thread pool of :func:`gspo.tasks.rewards.code_execution_reward`).

Linux only (macOS: no namespaces, RLIMIT_AS not enforced, untested). Not a security boundary
against a determined attacker, notably when the trainer runs as root:
root ignores ``RLIMIT_NPROC`` (so a fork bomb is bounded only by the timeout and memory) and may
raise its own rlimits; files outside the temp dir are reachable with the trainer's permissions.
Run training in a disposable container/VM if the policy may be adversarial.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

NetworkIsolation = Literal["netns", "shim"]

# Tests set this False to exercise the shim fallback on machines where namespaces work.
_TRY_NAMESPACES = True


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


# Runs as `python -I -c _BOOTSTRAP CFG` in the sandbox dir: namespaces, rlimits, then exec the user
# code (as PID 1 of the new PID namespace when there is one). Reports the isolation on status_fd.
_BOOTSTRAP = r"""
import json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
net, pid_ns, libc = "shim", False, None
try:
    if not cfg["namespaces"]:
        raise OSError("namespaces disabled")
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (NEWNET | NEWPID, NEWNET, NEWUSER | NEWNET | NEWPID, NEWUSER | NEWNET):
        if libc.unshare(flags) == 0:
            net, pid_ns = "netns", bool(flags & NEWPID)
            break
except Exception:
    pass
os.write(cfg["status_fd"], (net + ("+pid" if pid_ns else "")).encode())
os.close(cfg["status_fd"])

def limit(res, value):
    _, cur = resource.getrlimit(res)
    if cur != resource.RLIM_INFINITY:
        value = min(value, cur)
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        pass

limit(resource.RLIMIT_AS, cfg["memory_bytes"])
limit(resource.RLIMIT_CPU, cfg["cpu_s"])  # soft == hard: SIGKILL, as PID 1 of a namespace ignores SIGXCPU
limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_NOFILE, cfg["nofile"])
if cfg["nproc"]:
    limit(resource.RLIMIT_NPROC, cfg["nproc"])
argv = cfg["argv"] if net == "netns" else cfg["shim_argv"]
if not pid_ns:
    os.execv(argv[0], argv)
pid = os.fork()
if pid == 0:
    try:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the namespace dies with us even after setsid()
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
_, status = os.waitpid(pid, 0)
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
"""

# Shim mode only: refuse new AF_INET/AF_INET6 sockets (AF_UNIX and socketpair, which multiprocessing
# needs, keep working), then run main.py as __main__ (same file name in tracebacks).
_SHIM_RUNNER = r"""
def _gspo_run():
    import __main__, socket, _socket, sys
    inet = (-1, socket.AF_INET, socket.AF_INET6)  # -1: the AF_INET default
    raw = _socket.socket
    def blocked(*args, **kwargs):
        raise OSError("network disabled in sandbox")
    class GuardedSocket(raw):  # socket.socket.__init__ calls _socket.socket.__init__: this one
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family in inet:
                blocked()
            raw.__init__(self, family, type, proto, fileno)
    _socket.socket = GuardedSocket
    socket.create_connection = blocked
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    g = __main__.__dict__
    for k in [k for k in g if k not in ("__name__", "__builtins__", "__doc__", "__spec__")]:
        del g[k]
    g["__file__"] = "main.py"
    sys.argv = ["main.py"]
    exec(code, g)
_gspo_run()
"""


def _user_task_count(uid: int) -> int | None:
    """Tasks (threads) owned by ``uid``, what RLIMIT_NPROC is compared against; None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    n = 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return n


def _exited(pid: int) -> bool:
    """True once ``pid`` has exited, without reaping it (its process-group id stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def _pump(
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
        if pid is not None and _exited(pid):
            return True, truncated
    return True, truncated


def run_untrusted(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    *,
    max_output_bytes: int = 1 << 20,
    max_file_mb: int = 16,
    max_open_files: int = 256,
    max_procs: int = 64,
) -> SandboxResult:
    """Run Python source ``code`` as ``main.py`` in a fresh temp dir under the limits above.

    ``cpu_s`` defaults to ``ceil(timeout_s) + 1`` (a backstop; the wall clock normally fires first).
    ``max_procs`` extra processes/threads via RLIMIT_NPROC, enforced only when not running as root.
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
    cpu = max(1, int(cpu_s) if cpu_s is not None else math.ceil(timeout_s) + 1)
    euid = os.geteuid()
    # RLIMIT_NPROC counts all of the user's tasks, so allow max_procs on top of the current count.
    # Root ignores it (and so does anyone with CAP_SYS_RESOURCE): 0 = not set.
    tasks = None if euid == 0 else _user_task_count(os.getuid())
    nproc = 0 if tasks is None else tasks + max_procs
    workdir = tempfile.mkdtemp(prefix="gspo-sandbox-")
    status_r, status_w = os.pipe()
    try:
        # errors="replace": a lone surrogate in model output must not crash the caller.
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        py = [sys.executable, "-I", "-B", "-X", "utf8"]
        cfg = {
            "status_fd": status_w,
            "namespaces": _TRY_NAMESPACES,
            "memory_bytes": memory_mb << 20,
            "cpu_s": cpu,
            "fsize_bytes": max_file_mb << 20,
            "nofile": max_open_files,
            "nproc": nproc,
            "argv": [*py, "main.py"],
            "shim_argv": [*py, "-c", _SHIM_RUNNER],
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
        )
        os.close(status_w)
        status_w = -1
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None and proc.stderr is not None
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
        with selectors.DefaultSelector() as sel:
            for fd in bufs:
                sel.register(fd, selectors.EVENT_READ)
            try:
                finished, truncated = _pump(sel, bufs, max_output_bytes, deadline, proc.pid)
                while finished and not _exited(proc.pid):  # pipes closed but the process lives on
                    if time.monotonic() >= deadline:
                        finished = False
                        break
                    time.sleep(0.01)
            finally:
                # Always kill the group: on timeout (or KeyboardInterrupt) that is the point; otherwise
                # it removes leftovers (background children). The leader is not reaped yet, so the
                # pgid cannot have been reused.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                # wait4: the program's CPU time (the bootstrap waited for it) identifies a CPU-limit kill.
                _, wstatus, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(wstatus)
            _, more = _pump(sel, bufs, max_output_bytes, time.monotonic() + 0.5)
        proc.stdout.close()
        proc.stderr.close()
        rc = proc.returncode
        cpu_hit = rc == -signal.SIGXCPU or (
            rc == -signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu - 0.05
        )
        timed_out = not finished or cpu_hit
        status = bytes(bufs[status_r]).decode("ascii", "replace")
        isolation: NetworkIsolation = "netns" if status.startswith("netns") else "shim"
        return SandboxResult(
            ok=rc == 0 and not timed_out,
            returncode=rc,
            stdout=bufs[out_fd].decode("utf-8", "replace"),
            stderr=bufs[err_fd].decode("utf-8", "replace"),
            timed_out=timed_out,
            network_isolation=isolation,
            pid_namespace=status.endswith("+pid"),
            output_truncated=truncated or more,
        )
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        shutil.rmtree(workdir, ignore_errors=True)
