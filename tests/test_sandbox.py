"""run_untrusted: limits, timeouts, process containment and network isolation (all bounded)."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest
from cli_helpers import procs_with as _procs_with

from gspo.tasks import sandbox
from gspo.tasks.sandbox import confine, run_untrusted

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX only")


@pytest.fixture(autouse=True)
def _unconfined_ok_without_landlock(monkeypatch):
    """On a kernel without Landlock these tests exercise the other layers (run_untrusted would fail
    closed); tests/test_sandbox_filesystem.py covers the refusal itself."""
    if sandbox.landlock_abi() == 0:
        monkeypatch.setattr(sandbox, "REQUIRE_FS_ISOLATION", False)


@pytest.fixture
def token():
    """A unique marker for processes a test spawns; any still alive afterwards are killed by PID."""
    tok = f"gspo-sandbox-test-{uuid.uuid4().hex}"
    yield tok
    for pid in _procs_with(tok):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ok_program_fresh_dir_minimal_env(monkeypatch):
    """OK program: exit 0, output captured, fresh removed cwd, no env leak, empty stdin."""
    monkeypatch.setenv("GSPO_TEST_SECRET", "leak")
    code = (
        "import os, sys\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print('GSPO_TEST_SECRET' in os.environ, repr(sys.stdin.read()))\n"
        "print('err', file=sys.stderr)\n"
    )
    r = run_untrusted(code)
    assert r.ok and r.returncode == 0 and not r.timed_out and not r.output_truncated
    cwd, listing, env_line = r.stdout.splitlines()
    assert "gspo-sandbox-" in os.path.basename(cwd)
    assert listing == "['main.py']"
    assert env_line == "False ''"
    assert r.stderr == "err\n"
    assert not os.path.exists(cwd)


def test_syntax_error_and_exit_code():
    """A syntax error is a failed run with the SyntaxError in stderr; sys.exit(3) returns code 3."""
    r = run_untrusted("def f(:\n    pass\n")
    assert not r.ok and r.returncode == 1 and not r.timed_out
    assert "SyntaxError" in r.stderr and "main.py" in r.stderr
    r = run_untrusted("import sys; sys.exit(3)")
    assert not r.ok and r.returncode == 3


def test_infinite_loop_killed_by_wall_clock():
    """``while True`` is SIGKILLed at the wall-clock timeout: timed_out, returned within timeout + 2 s."""
    t0 = time.monotonic()
    r = run_untrusted("while True:\n    pass\n", timeout_s=1.0, cpu_s=30)
    elapsed = time.monotonic() - t0
    assert r.timed_out and not r.ok and r.returncode == -signal.SIGKILL
    assert 0.9 <= elapsed < 3.0


def test_cpu_limit_kills_busy_loop():
    """RLIMIT_CPU fires before a long wall-clock timeout: SIGKILL at cpu_s, reported as timed out."""
    t0 = time.monotonic()
    r = run_untrusted("while True:\n    pass\n", timeout_s=20.0, cpu_s=1)
    assert r.timed_out and not r.ok and r.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 8.0


def test_memory_bomb_stopped_by_rlimit_as():
    """Allocating without bound dies with MemoryError at ``memory_mb`` instead of eating the host."""
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    r = run_untrusted(code, timeout_s=10.0, memory_mb=200)
    assert not r.ok and not r.timed_out and r.returncode == 1
    assert "MemoryError" in r.stderr


def test_big_file_limited():
    """Writing past ``max_file_mb`` fails with EFBIG ('File too large')."""
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (5 << 20))\n"
    r = run_untrusted(code, max_file_mb=1)
    assert not r.ok and "File too large" in r.stderr


def test_output_capped():
    """Output beyond ``max_output_bytes`` is drained and dropped; the program still completes."""
    r = run_untrusted(
        "import sys\nsys.stdout.write('x' * (3 << 20))\nprint('done', file=sys.stderr)\n",
        max_output_bytes=1000,
    )
    assert r.ok and r.output_truncated
    assert r.stdout == "x" * 1000 and r.stderr == "done\n"


def test_fork_bomb_contained(token):
    """A fork bomb with setsid()-detached sleepers is cut off at the timeout and leaves no survivors."""
    code = (
        "import os, subprocess, time\n"
        "for _ in range(4):\n"
        "    os.fork()\n"  # 16 processes
        f"subprocess.Popen(['sh', '-c', 'sleep 60; :', '{token}'], start_new_session=True)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    r = run_untrusted(code, timeout_s=1.5)
    assert r.timed_out and not r.ok
    assert time.monotonic() - t0 < 3.5
    assert r.stdout.count("up") >= 2  # the forks did happen
    time.sleep(0.2)  # SIGKILL delivery to the namespace is asynchronous
    survivors = _procs_with(token)
    if not r.pid_namespace:  # without a PID namespace setsid() escapes the process-group kill
        pytest.skip(f"no PID namespace here; {len(survivors)} detached sleepers escaped (killed by fixture)")
    assert survivors == []


def test_timeout_kills_process_group_without_namespaces(monkeypatch, token):
    """Shim mode (no namespaces): children in the process group die with the program at the timeout."""
    monkeypatch.setattr(sandbox, "_TRY_NAMESPACES", False)
    code = (
        f"import subprocess, time\nsubprocess.Popen(['sh', '-c', 'sleep 60; :', '{token}'])\ntime.sleep(60)\n"
    )
    r = run_untrusted(code, timeout_s=1.0)
    assert r.timed_out and r.network_isolation == "shim" and not r.pid_namespace
    time.sleep(0.2)
    assert _procs_with(token) == []


def _connect_code(port: int) -> str:
    return (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        "    print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('BLOCKED', e)\n"
        "try:\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        f"    s.settimeout(2); s.connect(('127.0.0.1', {port}))\n"
        "    print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('BLOCKED', e)\n"
    )


@pytest.fixture
def listener():
    """A TCP server socket on 127.0.0.1 in the test process (non-blocking, so accept() never hangs)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.setblocking(False)
    yield srv
    srv.close()


def _assert_no_connection(srv: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        srv.accept()


def test_network_blocked(listener):
    """Connecting to a port open in the test process fails from inside the sandbox (both APIs)."""
    r = run_untrusted(_connect_code(listener.getsockname()[1]))
    assert r.ok, r.stderr
    assert "CONNECTED" not in r.stdout and r.stdout.count("BLOCKED") == 2
    if r.filesystem_isolation == "landlock":  # confined: seccomp refuses socket() itself
        assert r.stdout.count("Operation not permitted") == 2, r.stdout
    _assert_no_connection(listener)


def test_network_blocked_by_shim(monkeypatch, listener):
    """Without namespaces the socket shim blocks inet sockets; main.py still runs as __main__."""
    monkeypatch.setattr(sandbox, "_TRY_NAMESPACES", False)
    code = _connect_code(listener.getsockname()[1]) + "print(__name__, __file__)\n"
    r = run_untrusted(code)
    assert r.ok and r.network_isolation == "shim"
    assert r.stdout.count("BLOCKED network disabled in sandbox") == 2
    assert "__main__ main.py" in r.stdout
    _assert_no_connection(listener)
    r = run_untrusted("x = 1\nraise ValueError('boom')\n")
    assert 'File "main.py", line 2' in r.stderr and "ValueError: boom" in r.stderr
    # socketpair (asyncio's self-pipe, multiprocessing's Pipe) still works; a socket that could reach
    # a host socket file (AF_UNIX) is refused by seccomp when confined
    r = run_untrusted(
        "import socket\na, b = socket.socketpair()\na.sendall(b'hi')\nprint(b.recv(2))\n"
        "try:\n    socket.socket(socket.AF_UNIX).close()\n    print('UNIX')\nexcept OSError as e:\n"
        "    print('DENIED', e.errno)\n"
    )
    assert r.ok and r.stdout.startswith("b'hi'\n"), r.stderr
    if r.filesystem_isolation == "landlock":
        assert r.stdout.endswith("DENIED 1\n"), r.stdout


def test_netns_used_when_root():
    """As root on Linux the sandbox gets its own network and PID namespaces (not just the shim)."""
    if os.geteuid() != 0 or not os.path.exists("/proc/self/ns/net"):
        pytest.skip("namespaces need root here")
    r = run_untrusted("import os; print(os.getpid())")
    assert r.ok and r.network_isolation == "netns" and r.pid_namespace
    assert r.stdout.strip() == "1"


def test_user_task_count_sees_this_process():
    """The RLIMIT_NPROC base count (used when not root) includes at least this process's threads."""
    assert sandbox.host.user_task_count(os.getuid()) >= 1


def test_bad_arguments():
    """Non-positive timeout or memory is a programming error (ValueError)."""
    with pytest.raises(ValueError):
        run_untrusted("pass", timeout_s=0)
    with pytest.raises(ValueError):
        run_untrusted("pass", memory_mb=0)


@pytest.mark.parametrize("machine", sorted(confine.SECCOMP))
@pytest.mark.parametrize("metadata", [False, True])
def test_seccomp_program_is_well_formed(machine, metadata):
    """The classic-BPF filter the launcher loads: jumps forward within the program and in a byte,
    every path ends in a return, and the refused syscall numbers are all there."""
    prog = confine.seccomp_program(metadata, machine)
    assert len(prog) < 4096 and prog[-1][0] == confine.RET
    for i, (code, jt, jf, _k) in enumerate(prog):
        if code in (confine.JEQ, confine.JGE, confine.JSET):
            assert 0 <= jt <= 255 and 0 <= jf <= 255 and i + 1 + max(jt, jf) < len(prog)
    table = confine.SECCOMP[machine]
    checked = {k for code, _, _, k in prog if code == confine.JEQ}
    assert set(table["deny"]) <= checked and (set(table["meta"]) <= checked) == metadata
