"""run_untrusted's filesystem confinement (Landlock), unprivileged uid and the fail-closed default."""

from __future__ import annotations

import os
import socket
import warnings

import pytest

from gspo.errors import GspoError
from gspo.tasks import sandbox
from gspo.tasks.rewards import load_reward
from gspo.tasks.sandbox import SandboxUnavailable, run_untrusted

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX only")
needs_landlock = pytest.mark.skipif(sandbox.landlock_abi() == 0, reason="kernel without Landlock")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid switch happens only as root")


@pytest.fixture
def outside(tmp_path):
    """A directory of the trainer's, with a world-readable secret and a world-writable subdir."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    tmp_path.chmod(0o755)
    return tmp_path


def _run(code: str, **kw) -> sandbox.SandboxResult:
    return run_untrusted(code, timeout_s=10.0, **kw)


@needs_landlock
@pytest.mark.parametrize(
    "target",
    [
        "/etc/passwd",
        "/proc/self/status",
        "/proc/1/cmdline",
        "{secret}",
        "/sys/kernel/mm/transparent_hugepage",
    ],
)
def test_reads_outside_are_refused(outside, target):
    """Files outside the Python runtime (here: /etc/passwd, /proc, /sys, a world-readable file of the
    trainer's) cannot be read; the failure is EACCES (ENOENT under the private tmpfs that hides /tmp)."""
    path = target.format(secret=outside / "secret.txt")
    r = _run(
        f"import os\ntry:\n    print(open({path!r}).read()[:40])\nexcept OSError as e:\n    print('DENIED', e.errno)\n"
    )
    assert r.ok, r.stderr
    hidden = r.private_tmpfs and path.startswith(str(sandbox.host.tmpfs_mountpoint()) + "/")
    assert r.stdout.startswith("DENIED 2" if hidden else "DENIED 13"), r.stdout
    assert r.filesystem_isolation == "landlock"


@needs_landlock
@pytest.mark.parametrize(
    "target",
    ["{shared}/x", "{base}/x", "/tmp/gspo-escape-{pid}", "/dev/shm/gspo-escape-{pid}", "/root/gspo-escape"],
)
def test_writes_outside_are_refused(outside, target):
    """No file can be created outside the sandbox dir, not even in a world-writable one (/tmp,
    /dev/shm, a 0777 dir of the trainer's) or /root."""
    path = target.format(shared=outside / "shared", base=outside, pid=os.getpid())
    r = _run(
        f"try:\n    open({path!r}, 'w').write('x')\n    print('WROTE')\nexcept OSError as e:\n    print('DENIED', e.errno)\n"
    )
    assert r.ok, r.stderr
    assert r.stdout.startswith("DENIED"), r.stdout
    assert not os.path.exists(path)


@needs_landlock
def test_listing_and_metadata_changes_outside_are_refused(outside):
    """Directories outside cannot be listed; chmod/utime of the trainer's files are refused."""
    secret = outside / "secret.txt"
    code = (
        "import os\nout = []\n"
        f"for fn in (lambda: os.listdir('/'), lambda: os.listdir({str(outside)!r}), "
        f"lambda: os.chmod({str(secret)!r}, 0o777), lambda: os.utime({str(secret)!r}, (0, 0)), "
        f"lambda: os.truncate({str(secret)!r}, 0), lambda: os.symlink('/etc/passwd', 'link') or open('link').read()):\n"
        "    try:\n        fn()\n        out.append('ALLOWED')\n    except OSError as e:\n        out.append(e.errno)\n"
        "print(out)\n"
    )
    r = _run(code)
    assert r.ok, r.stderr
    assert "ALLOWED" not in r.stdout, r.stdout
    assert secret.read_text() == "s3cret" and oct(secret.stat().st_mode & 0o777) == "0o644"
    assert secret.stat().st_mtime > 0


@needs_landlock
def test_inside_the_sandbox_dir_everything_works():
    """The sandbox dir (cwd = HOME = TMPDIR) is fully usable: files, subdirs, tempfile, sqlite; the
    runtime is readable: stdlib, site-packages (numpy), subprocesses of /bin."""
    code = (
        "import os, tempfile, sqlite3, json, subprocess\n"
        "os.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('hi')\nos.rename('a/b/f.txt', 'a/g.txt')\n"
        "d = tempfile.mkdtemp()\nassert d.startswith(os.getcwd())\n"
        "con = sqlite3.connect('db.sqlite')\ncon.execute('create table t(x)')\ncon.commit()\n"
        "import numpy\nprint(subprocess.run(['sh', '-c', 'echo sh-ok'], capture_output=True, text=True).stdout.strip())\n"
        "print(open('a/g.txt').read(), sorted(os.listdir('.')))\n"
    )
    r = _run(code)
    assert r.ok, r.stderr
    assert "sh-ok" in r.stdout and "hi ['a', 'db.sqlite', 'main.py'" in r.stdout


@needs_landlock
def test_tcp_refused_by_kernel_without_netns(monkeypatch):
    """Shim mode (no network namespace): a connect from a fresh interpreter, which the Python-level
    shim does not cover, is refused by the kernel (seccomp refuses the socket; Landlock ABI >= 4 would
    refuse the connect)."""
    if sandbox.landlock_abi() < 4:
        pytest.skip("Landlock ABI < 4 has no network rules")
    monkeypatch.setattr(sandbox, "_TRY_NAMESPACES", False)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.setblocking(False)
    try:
        inner = (
            "import socket\n"
            f"try:\n    s = socket.socket()\n    s.settimeout(2)\n    s.connect(('127.0.0.1', {srv.getsockname()[1]}))\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n    print('BLOCKED', e)\n"
        )
        code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}])\n"
        r = _run(code)
        assert r.network_isolation == "shim" and r.ok, r.stderr
        assert "BLOCKED" in r.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


# the program's capability sets as bit masks: effective, permitted, inheritable (capget, both 32-bit
# words), ambient and bounding (one prctl query per capability)
_CAPS = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
class Hdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
data = (Data * 2)()
assert libc.capget(ctypes.byref(Hdr(0x20080522, 0)), data) == 0, ctypes.get_errno()
caps = [getattr(data[0], f) | getattr(data[1], f) << 32 for f in ("effective", "permitted", "inheritable")]
prctl = lambda *a: libc.prctl(*[ctypes.c_ulong(x) for x in a])
caps.append(sum(1 << c for c in range(64) if prctl(47, 1, c, 0, 0) == 1))  # PR_CAP_AMBIENT_IS_SET
caps.append(sum(1 << c for c in range(64) if prctl(23, c, 0, 0, 0) == 1))  # PR_CAPBSET_READ
"""


@needs_root
@needs_landlock
def test_runs_as_fresh_unprivileged_uid(outside):
    """As root: a fresh uid per call (not 0), no capabilities but DAC_READ_SEARCH (2) in every set the
    kernel keeps (effective, permitted, inheritable, ambient, bounding; /proc is out of the sandbox's
    reach, so the program asks the kernel with capget and prctl), and RLIMIT_NPROC holds (a fork loop
    stops at max_procs)."""
    code = (
        "import os\nprint(os.getuid(), os.geteuid())\n" + _CAPS + "print(*caps)\n"
        "pids, err = [], None\n"
        "for _ in range(20):\n    try:\n        pid = os.fork()\n    except OSError as e:\n        err = e.errno\n"
        "        break\n    if pid == 0:\n        import time\n        time.sleep(2)\n        os._exit(0)\n"
        "    pids.append(pid)\nprint(len(pids), err)\n"
    )
    a, b = _run(code, max_procs=4), _run("import os\nprint(os.getuid())")
    assert a.ok, a.stderr
    uid, euid = map(int, a.stdout.split()[:2])
    assert uid == euid == a.uid and uid != 0 and b.uid not in (None, 0, uid)
    only_dac_read_search = str(1 << 2)
    assert a.stdout.splitlines()[1].split() == [only_dac_read_search] * 5, a.stdout
    n, err = a.stdout.splitlines()[2].split()
    assert int(n) <= 4 and err == "11"  # EAGAIN


def test_cannot_signal_the_trainer(monkeypatch):
    """Without a PID namespace the parent (the launcher, the trainer's child) is visible: signalling it
    is refused (another uid as root; Landlock's signal scope otherwise)."""
    if os.geteuid() != 0 and sandbox.landlock_abi() < 6:
        pytest.skip("same uid and no Landlock signal scoping")
    monkeypatch.setattr(sandbox, "_TRY_NAMESPACES", False)
    code = "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGTERM)\n    print('SENT')\nexcept OSError as e:\n    print('DENIED', e.errno)\n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = _run(code, require_fs_isolation=sandbox.landlock_abi() > 0)
    assert r.stdout.startswith("DENIED"), r.stdout


def test_fail_closed_without_landlock(monkeypatch):
    """No Landlock: run_untrusted and load_reward('code') raise one clear line; opting out runs the
    program with a warning (once) and reports filesystem_isolation='none'."""
    monkeypatch.setattr(sandbox, "_TRY_LANDLOCK", False)
    monkeypatch.setattr(sandbox, "_warned", False)
    with pytest.raises(SandboxUnavailable) as ei:
        run_untrusted("print(1)")
    msg = str(ei.value)
    assert "\n" not in msg and "no filesystem isolation" in msg and "require_fs_isolation=False" in msg
    assert isinstance(ei.value, GspoError)
    with pytest.raises(GspoError, match="no filesystem isolation"):
        load_reward("code")
    with pytest.warns(RuntimeWarning, match="WITHOUT filesystem isolation"):
        r = run_untrusted("print(1)", require_fs_isolation=False)
    assert r.ok and r.stdout == "1\n" and r.filesystem_isolation == "none"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_untrusted("print(2)", require_fs_isolation=False).ok  # warned once per process
    monkeypatch.setattr(sandbox, "REQUIRE_FS_ISOLATION", False)
    assert run_untrusted("print(3)").filesystem_isolation == "none"


@needs_landlock
@pytest.mark.parametrize("tests", [None, "assert True"])
def test_child_files_readable_not_writable(tests):
    """The program may read the two package files it runs (boot.py, shim.py), and cannot change,
    replace or chmod them (later calls run them); nothing else of the package is readable."""
    files = [sandbox.host.BOOT, sandbox.host.SHIM]
    harness = os.path.join(sandbox.host.PACKAGE_DIR, "harness.py")
    code = (
        "import os\n"
        f"for p in {files!r}:\n"
        "    print('READ', len(open(p, 'rb').read()) > 0)\n"
        "    for name, f in (('append', lambda: open(p, 'ab')), ('rename', lambda: os.rename(p, p + '.x')),\n"
        "                    ('chmod', lambda: os.chmod(p, 0o777)), ('unlink', lambda: os.unlink(p))):\n"
        "        try:\n"
        "            f()\n"
        "            print('CHANGED', name)\n"
        "        except OSError as e:\n"
        "            print('DENIED', name, e.errno)\n"
        "try:\n"
        f"    open({harness!r}).read()\n"
        "    print('READ harness')\n"
        "except OSError as e:\n"
        "    print('DENIED harness', e.errno)\n"
    )
    r = _run(code, tests=tests)
    assert r.ok and r.passed in (None, True), r.stderr
    assert r.stdout.count("READ True") == 2 and r.stdout.count("DENIED") == 9, r.stdout
    assert "CHANGED" not in r.stdout
    assert all(os.stat(p).st_mode & 0o777 == os.stat(harness).st_mode & 0o777 for p in files)


@needs_landlock
@pytest.mark.parametrize("tests", [None, "assert True"])
def test_package_modules_not_importable(tests):
    """``-I``: the directory of boot.py/shim.py is not on the program's sys.path, and Landlock hides
    the project's source (an editable install's path): none of the sandbox's modules import."""
    code = (
        "import sys\n"
        "for m in ('boot', 'shim', 'harness', 'protected', 'confine', 'gspo', 'gspo.tasks.sandbox'):\n"
        "    try:\n"
        "        __import__(m)\n"
        "        print('IMPORTED', m)\n"
        "    except ImportError:\n"
        "        print('NO', m)\n"
        "print(any(p.endswith('sandbox') for p in sys.path))\n"
    )
    r = _run(code, tests=tests)
    assert r.ok and r.passed in (None, True), r.stderr
    assert "IMPORTED" not in r.stdout and r.stdout.count("NO ") == 7 and r.stdout.endswith("False\n"), (
        r.stdout
    )


def test_writable_by_others(tmp_path):
    """Without Landlock only permissions guard the files later calls run: a world-writable file, or a
    world-writable directory above it that is not sticky, is named."""
    d = tmp_path / "pkg"
    d.mkdir()
    f = d / "boot.py"
    f.write_text("")
    for p in (tmp_path, d):
        p.chmod(0o755)
    f.chmod(0o644)
    assert sandbox.host.writable_by_others(str(f)) is None
    f.chmod(0o666)
    assert sandbox.host.writable_by_others(str(f)) == str(f)
    f.chmod(0o644)
    d.chmod(0o777)
    assert sandbox.host.writable_by_others(str(f)) == str(d)
    d.chmod(0o1777)  # sticky: others cannot replace what they do not own
    assert sandbox.host.writable_by_others(str(f)) is None
    assert sandbox.host.writable_by_others(sandbox.host.BOOT) is None  # this checkout
