"""run_untrusted: no way out and nothing left behind (issue 23's hostile sweep, one test per route).

Host unix sockets (connect, datagram, SCM_RIGHTS), processes that leave the process group
(``setsid()``, double fork) when the call ends, when the launcher or the trainer is killed with -9,
their work dirs, and the limits that were per file or per process only (memfd, total disk, inodes,
memory across processes).
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest
from cli_helpers import procs_with as _procs_with

from gspo.tasks import sandbox
from gspo.tasks.sandbox import run_untrusted

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
    pytest.mark.skipif(
        sandbox.landlock_abi() == 0, reason="kernel without Landlock: the sandbox refuses to run"
    ),
]


@functools.lru_cache(maxsize=1)
def _have_namespaces() -> bool:
    r = run_untrusted("pass")
    return r.pid_namespace and r.private_tmpfs


@pytest.fixture
def _namespaces():
    if not _have_namespaces():
        pytest.skip(
            "no PID and mount namespaces here (needs root with CAP_SYS_ADMIN, or unprivileged user "
            "namespaces): setsid() children can outlive the call and disk is limited per file only"
        )


needs_pid_ns = pytest.mark.usefixtures("_namespaces")
MODES = {"plain": None, "harness": "assert True\n"}


def _wait_for(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture
def token():
    """A unique marker for processes a test spawns; any still alive afterwards are killed by PID."""
    tok = f"gspo-escape-test-{uuid.uuid4().hex}"
    yield tok
    for pid in _procs_with(tok):  # and their children (the unmarked `sleep`)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for p in [pid, *children]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _host_dirs(pid: int) -> list[str]:
    """Work dirs of trainer ``pid`` visible on the host (none with a private tmpfs)."""
    parents = {tempfile.gettempdir(), "/tmp", sandbox.host.tmpfs_mountpoint() or "/tmp"}
    return [d for p in parents for d in glob.glob(os.path.join(p, f"gspo-sandbox-{pid}-*"))]


# ------------------------------------------------------------------------------------------------
# host unix sockets


@pytest.fixture
def host_sockets(tmp_path):
    """Mode-777 unix sockets of the trainer's (stream listener + datagram receiver) in /tmp and in a
    directory the sandbox can still resolve (/dev/shm), non-blocking so that checks never hang."""
    dirs = [tmp_path]
    if os.path.isdir("/dev/shm"):
        dirs.append(tempfile.mkdtemp(prefix="gspo-escape-", dir="/dev/shm"))
    socks, paths = [], []
    for d in dirs:
        os.chmod(d, 0o777)
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            path = os.path.join(str(d), f"{'s' if kind == socket.SOCK_STREAM else 'd'}.sock")
            s = socket.socket(socket.AF_UNIX, kind)
            s.bind(path)
            os.chmod(path, 0o777)
            if kind == socket.SOCK_STREAM:
                s.listen(16)
            s.setblocking(False)
            socks.append(s)
            paths.append(path)
    yield socks, paths
    for s in socks:
        s.close()
    for d in dirs[1:]:
        for p in glob.glob(os.path.join(str(d), "*")):
            os.unlink(p)
        os.rmdir(d)


def _socket_attack(paths: list[str]) -> str:
    """Connect 12 times, send a datagram and an fd (SCM_RIGHTS) to every path; then the raw syscalls
    from a fresh interpreter (no Python-level shim in the way): socket(AF_UNIX), io_uring_setup."""
    inner = textwrap.dedent(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        for name, nr, args in (("socket", 41, (1, 1, 0)), ("io_uring_setup", 425, (8, ctypes.create_string_buffer(120)))):
            r = libc.syscall(nr, *args)
            print("RAW", name, "OK" if r >= 0 else "DENIED %d" % ctypes.get_errno())
        """
    )
    return textwrap.dedent(
        f"""
        import array, os, socket, subprocess, sys
        for path in {paths!r}:
            for i in range(12):
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(path)
                    fds = array.array("i", [os.open("main.py", os.O_RDONLY)])
                    s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                    print("CONNECTED", path)
                except OSError as e:
                    print("DENIED", e.errno)
            try:
                d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                d.sendto(b"x", path)
                print("SENT", path)
            except OSError as e:
                print("DENIED", e.errno)
        if os.uname().machine == "x86_64":
            subprocess.run([sys.executable, "-c", {inner!r}])
        """
    )


@pytest.mark.parametrize("mode", sorted(MODES))
def test_host_unix_sockets_receive_nothing(host_sockets, mode):
    """A host unix socket (stream or datagram, mode 777, in /tmp or /dev/shm) gets no connection, no
    datagram and no descriptor: socket() of every family is refused by seccomp, so the program never
    holds a socket that could reach the host (socketpair() stays, for asyncio: it connects only to
    itself)."""
    socks, paths = host_sockets
    r = run_untrusted(_socket_attack(paths), timeout_s=20.0, tests=MODES[mode])
    assert r.returncode == 0, r.stderr
    assert "CONNECTED" not in r.stdout and "SENT" not in r.stdout and " OK" not in r.stdout, r.stdout
    denied = [line for line in r.stdout.splitlines() if line.startswith("DENIED")]
    assert len(denied) == 13 * len(paths)
    if os.uname().machine == "x86_64":
        assert "RAW socket DENIED 1" in r.stdout and "RAW io_uring_setup DENIED 1" in r.stdout, r.stdout
    for s in socks:
        with pytest.raises(BlockingIOError):
            s.accept() if s.type == socket.SOCK_STREAM else s.recv(16)


# ------------------------------------------------------------------------------------------------
# processes that leave the process group


def _escape_code(token: str, then: str) -> str:
    """A double-forked, setsid()-detached sleeper, then the program itself detaches and ``then``."""
    return (
        textwrap.dedent(
            f"""
        import os, time
        sleeper = ["/bin/sh", "-c", "sleep 60; :", {token!r}]
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sleeper[0], sleeper)
            os._exit(0)
        os.setsid()
        print("detached", flush=True)
        """
        )
        + then
    )


@needs_pid_ns
@pytest.mark.parametrize("mode", sorted(MODES))
def test_setsid_program_dead_when_timeout_returns(token, mode):
    """The program setsid()s out of its process group (and becomes a marked sleeper), a double fork
    leaves another: at the timeout both are dead when run_untrusted returns (no grace period)."""
    then = "os.execv(sleeper[0], sleeper)\n"  # the program itself keeps running, detached
    t0 = time.monotonic()
    r = run_untrusted(_escape_code(token, then), timeout_s=1.5, tests=MODES[mode])
    survivors = _procs_with(token)
    assert r.timed_out and r.returncode == -signal.SIGKILL and r.pid_namespace
    assert "detached" in r.stdout and time.monotonic() - t0 < 4.0
    assert survivors == []


@needs_pid_ns
@pytest.mark.parametrize("mode", sorted(MODES))
def test_detached_children_dead_when_program_exits(token, mode):
    """A program that exits at once (tests passing) leaves a double-forked, setsid()-detached child:
    it is dead when run_untrusted returns."""
    r = run_untrusted(_escape_code(token, "x = 1\n"), timeout_s=10.0, tests=MODES[mode])
    survivors = _procs_with(token)
    assert r.ok and not r.timed_out and r.passed in (None, True), r.stderr
    assert survivors == []


def _launcher_of_this_process() -> list[int]:
    """PIDs of the sandbox launchers this process started (direct children running boot.py)."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            continue
        if ppid == me and sandbox.host.BOOT.encode() + b"\x00{" in cmd:  # boot.py, then its JSON config
            found.append(int(entry))
    return found


@needs_pid_ns
@pytest.mark.parametrize("mode", sorted(MODES))
def test_launcher_killed_leaves_nothing(token, mode):
    """kill -9 of the launcher while its program and detached children run: all of them die (the
    program, PID 1 of the namespace, has PR_SET_PDEATHSIG, which it cannot clear), run_untrusted
    returns a failure, no work dir remains."""
    clear_pdeathsig = (
        "try:\n    import ctypes\n    ctypes.CDLL(None).prctl(1, 0)\nexcept Exception:\n    pass\n"
    )
    code = clear_pdeathsig + _escape_code(
        token, "open('big.bin', 'wb').write(b'x' * (1 << 20))\ntime.sleep(60)\n"
    )
    out: list = []
    t = threading.Thread(target=lambda: out.append(run_untrusted(code, timeout_s=30.0, tests=MODES[mode])))
    t.start()
    try:
        assert _wait_for(lambda: len(_procs_with(token)) >= 1, 15.0), "the sleepers never started"
        launchers = _launcher_of_this_process()
        assert len(launchers) == 1
        os.kill(launchers[0], signal.SIGKILL)
        t.join(10.0)
        assert not t.is_alive() and not out[0].ok and out[0].passed in (None, False)
        assert _wait_for(lambda: _procs_with(token) == [], 3.0), _procs_with(token)
        assert _host_dirs(os.getpid()) == []
    finally:
        t.join(35.0)


TRAINER = """
import sys
from gspo.tasks.sandbox import run_untrusted
print(run_untrusted(sys.stdin.read(), timeout_s=30.0, tests=sys.argv[1] or None))  # no marker in argv
"""


@needs_pid_ns
@pytest.mark.parametrize("mode", sorted(MODES))
def test_trainer_killed_leaves_nothing(token, mode):
    """kill -9 of the trainer (the process calling run_untrusted): the launcher (parent-death signal),
    the program and its detached children all die; no work dir of that trainer remains (and its
    memory cgroup, if any, is removed by the next process's first call)."""
    code = _escape_code(token, "open('big.bin', 'wb').write(b'x' * (1 << 20))\ntime.sleep(60)\n")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, MODES[mode] or ""], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    trainer.stdin.write(code.encode())
    trainer.stdin.close()
    try:
        assert _wait_for(lambda: len(_procs_with(token)) >= 1, 20.0), "the sleepers never started"
        trainer.kill()
        trainer.wait(10)
        assert _wait_for(lambda: _procs_with(token) == [], 3.0), _procs_with(token)
        assert _host_dirs(trainer.pid) == []
        cgroups = sandbox.host.memory_cgroup_parent()
        if cgroups:  # its (empty) memory cgroup goes at the next start
            sandbox.host.sweep_stale_dirs.cache_clear()
            run_untrusted("pass")
            assert glob.glob(os.path.join(cgroups, f"gspo-sandbox-{trainer.pid}-*")) == []
    finally:
        trainer.kill()
        trainer.wait(10)


def test_stale_host_dirs_of_dead_trainers_removed(monkeypatch, tmp_path):
    """Without a private tmpfs (no namespaces) the work dir is a host dir named after the trainer's
    PID; one left by a killed trainer (10+ minutes old) is removed by the next process's first call (a
    live PID's or a recent one stays)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sandbox, "_TRY_NAMESPACES", False)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"gspo-sandbox-{dead.pid}-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "f").write_text("x")
    recent = tmp_path / f"gspo-sandbox-{dead.pid}-def"  # could be a live call of another PID namespace
    recent.mkdir()
    alive = tmp_path / f"gspo-sandbox-{os.getppid()}-abc"
    alive.mkdir()
    hour_ago = time.time() - 3600
    for d in (stale, alive):
        os.utime(d, (hour_ago, hour_ago))
    sandbox.host.sweep_stale_dirs.cache_clear()
    try:
        r = run_untrusted("import os\nprint(os.getcwd())\n")
        assert r.ok and not r.private_tmpfs, r.stderr
        assert r.stdout.strip().startswith(str(tmp_path / f"gspo-sandbox-{os.getpid()}-"))
        assert not stale.exists() and alive.exists() and recent.exists()
        assert _host_dirs(os.getpid()) == [] and not os.path.exists(r.stdout.strip())
    finally:
        sandbox.host.sweep_stale_dirs.cache_clear()


# ------------------------------------------------------------------------------------------------
# limits per call, not per file or per process


def test_memfd_and_shared_memory_refused():
    """memfd_create (held 2 GB under memory_mb=512), SysV shared memory and message queues, POSIX
    message queues, new user namespaces: memory outside RLIMIT_AS or the tmpfs is refused (EPERM); so
    is clearing the parent-death signal that ties the program to its launcher."""
    code = textwrap.dedent(
        """
        import ctypes, os
        try:
            fd = os.memfd_create("bomb")
            os.ftruncate(fd, 2 << 30)
            os.write(fd, b"x" * (64 << 20))
            print("MEMFD")
        except OSError as e:
            print("DENIED", e.errno)
        libc = ctypes.CDLL(None, use_errno=True)
        for name, r in (("shmget", lambda: libc.shmget(0, 1 << 30, 0o1600)), ("msgget", lambda: libc.msgget(0, 0o1600)),
                        ("mq_open", lambda: libc.mq_open(b"/gspo", 0o100 | 2, 0o600, None)),
                        ("unshare", lambda: libc.unshare(0x10000000)), ("pdeathsig", lambda: libc.prctl(1, 0))):
            print(name, "OK" if r() >= 0 else "DENIED %d" % ctypes.get_errno())
        """
    )
    r = run_untrusted(code, memory_mb=512)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == [
        "DENIED 1",
        "shmget DENIED 1",
        "msgget DENIED 1",
        "mq_open DENIED 1",
        "unshare DENIED 1",
        "pdeathsig DENIED 1",
    ]


@needs_pid_ns
def test_total_disk_limited():
    """Many files each under max_file_mb (1,728 MB were written in 3.5 s): the work dir is a tmpfs of
    max_disk_mb, so writing stops with ENOSPC near that total."""
    code = textwrap.dedent(
        """
        import os
        total, err = 0, None
        try:
            for i in range(200):
                with open("f%d" % i, "wb") as f:
                    for _ in range(8):
                        f.write(b"x" * (1 << 20))
                        f.flush()
                        total += 1 << 20
        except OSError as e:
            err = e.errno
        print(total >> 20, err)
        """
    )
    r = run_untrusted(code, timeout_s=20.0, max_disk_mb=32, max_file_mb=16)
    assert r.ok and r.private_tmpfs, r.stderr
    mb, err = r.stdout.split()
    assert int(mb) <= 32 and err == "28", r.stdout  # ENOSPC


@needs_pid_ns
def test_inode_bomb_limited():
    """Creating empty files without end (84,000 in one call) stops at max_files with ENOSPC."""
    code = textwrap.dedent(
        """
        import os
        n, err = 0, None
        try:
            for n in range(100000):
                os.close(os.open("e%d" % n, os.O_CREAT | os.O_WRONLY))
        except OSError as e:
            err = e.errno
        print(n, err)
        """
    )
    r = run_untrusted(code, timeout_s=20.0, max_files=500)
    assert r.ok and r.private_tmpfs, r.stderr
    n, err = r.stdout.split()
    assert int(n) <= 500 and err == "28", r.stdout


@needs_pid_ns
def test_total_memory_across_processes_limited():
    """Forked children each within memory_mb (the per-process address-space limit) but far over it
    together: where a memory cgroup per call is available they share memory_mb + max_disk_mb, and the
    excess is killed (SIGKILL from the cgroup's OOM killer)."""
    if sandbox.host.memory_cgroup_parent() is None:
        pytest.skip("no cgroup-v1 memory controller to make a cgroup per call in: limits are per process")
    code = textwrap.dedent(
        """
        import os, time
        kids = []
        for i in range(5):
            pid = os.fork()
            if pid == 0:
                block = b"x" * (100 << 20)
                time.sleep(2)
                os._exit(0)
            kids.append(pid)
        print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids])
        """
    )
    r = run_untrusted(code, timeout_s=30.0, memory_mb=160, max_disk_mb=16)
    assert r.memory_cgroup, r
    assert -signal.SIGKILL in ast.literal_eval(r.stdout) if r.ok else r.returncode == -signal.SIGKILL, (
        r.stdout,
        r.stderr,
    )
    alone = run_untrusted(code.replace("range(5)", "range(1)"), timeout_s=30.0, memory_mb=160, max_disk_mb=16)
    assert alone.ok and alone.stdout == "[0]\n", alone.stderr  # one child of that size is fine


def test_bad_limits_are_value_errors():
    """Non-positive disk or inode limits are a programming error (ValueError)."""
    with pytest.raises(ValueError):
        run_untrusted("pass", max_disk_mb=0)
    with pytest.raises(ValueError):
        run_untrusted("pass", max_files=0)
