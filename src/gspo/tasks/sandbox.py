"""Run untrusted Python (model-written code) in a confined subprocess, optionally with a test verdict.

Layers, from strongest to weakest:

* **filesystem (Landlock)**: the program may read and execute only the Python installation (its
  prefixes and site-packages), ``/usr``, ``/lib*``, ``/bin`` and a few device/loader files, and may
  write only in a fresh temporary folder (its cwd, ``HOME`` and ``TMPDIR``). Everything else —
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
  instead. Always refused (seccomp): ptrace, process_vm_readv/writev, pidfd_getfd,
  open_by_handle_at;
* a fresh temp dir as cwd, a minimal environment, stdin on /dev/null, ``python -I`` (no user site,
  no PYTHON* variables, script dir not on ``sys.path``);
* rlimits: address space (``memory_mb``), CPU seconds, max file size, no core dumps, open files,
  processes (enforced when not running as root — which, with the uid switch, is always);
* a new network namespace (only a down loopback, so every connect fails) and a new PID namespace
  (when the sandboxed interpreter, PID 1 there, dies, the kernel kills every process it left,
  including ones that ``setsid()`` out of the process group; signals from inside the namespace
  without a handler do not kill it). Needs CAP_SYS_ADMIN (root) or
  unprivileged user namespaces; otherwise a best-effort shim makes ``socket.socket`` (AF_INET/6)
  and ``socket.create_connection`` raise ``OSError("network disabled in sandbox")``, and Landlock
  (ABI >= 4) refuses every TCP bind/connect at the kernel level. ``SandboxResult.network_isolation``
  says which one was used;
* a wall-clock timeout that SIGKILLs the whole process group.

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
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import marshal
import math
import os
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
from typing import Literal

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
    passed: bool | None = None
    """With ``tests``: the harness ran the program and every test to the end and reported so on its
    private channel (the only thing the ``code`` reward trusts). None without ``tests``."""


# ------------------------------------------------------------------------------------------------
# bootstrap: namespaces, rlimits, confinement (uid, seccomp, Landlock), then exec the interpreter

# Runs as `python -I -B -c _BOOTSTRAP CFG` in the sandbox dir (as the trainer's user): namespaces
# and rlimits; then, in the process that execs the program (a child when there is a PID namespace,
# so that PID 1 stays an unconfined reaper): switch to an unprivileged uid when root, seccomp,
# Landlock. Reports what it applied on status_fd ("fail:<why>" + exit 125 when a required layer fails).
_BOOTSTRAP = r"""
import json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
net, pid_ns, libc, ctypes = "shim", False, None, None
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
except Exception:
    pass
try:
    if not cfg["namespaces"] or libc is None:
        raise OSError("namespaces disabled")
    for flags in (NEWNET | NEWPID, NEWNET, NEWUSER | NEWNET | NEWPID, NEWUSER | NEWNET):
        if libc.unshare(flags) == 0:
            net, pid_ns = "netns", bool(flags & NEWPID)
            break
except Exception:
    pass

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

def fail(what):
    raise OSError("%s (errno %d: %s)" % (what, ctypes.get_errno(), os.strerror(ctypes.get_errno())))

def prctl(*args):
    return libc.prctl(*[ctypes.c_ulong(a) for a in args])

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

SECCOMP_DENY = {
    # ptrace, process_vm_readv, process_vm_writev, pidfd_getfd, name_to_handle_at, open_by_handle_at
    "x86_64": (0xC000003E, (101, 310, 311, 438, 303, 304),
               # chmod fchmod chown fchown lchown utime utimes futimesat fchownat fchmodat utimensat
               # setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr fchmodat2
               # setxattrat removexattrat truncate
               (90, 91, 92, 93, 94, 132, 235, 261, 260, 268, 280, 188, 189, 190, 197, 198, 199,
                452, 463, 466, 76)),
    "aarch64": (0xC00000B7, (117, 270, 271, 438, 264, 265),
                (52, 53, 54, 55, 88, 5, 6, 7, 14, 15, 16, 452, 463, 466, 45)),
}

def seccomp(metadata):
    arch, base, meta = SECCOMP_DENY[os.uname().machine]
    deny = base + (meta if metadata else ())
    ERR, ALLOW = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    checks = [(0x35, 0x40000000)] if arch == 0xC000003E else []  # x32 syscalls: all refused
    checks += [(0x15, nr) for nr in deny]
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, ERR), (0x20, 0, 0, 0)]
    prog += [(code, len(checks) - i, 0, k) for i, (code, k) in enumerate(checks)]
    prog += [(0x06, 0, 0, ALLOW), (0x06, 0, 0, ERR)]
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
    for path, access in cfg["rules"]:
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
    if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("PR_SET_NO_NEW_PRIVS failed")
    seccomp(metadata=uid is None)
    if ruleset >= 0:
        if sys_call(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            fail("landlock_restrict_self failed")
        os.close(ruleset)
        parts.append("landlock=%d" % abi)
    return parts

def confine_and_report():
    sfd = cfg["status_fd"]
    parts = [net + ("+pid" if pid_ns else "")]
    try:
        if libc is None:
            raise OSError("ctypes is unavailable")
        parts += confine()
    except Exception as e:
        if cfg["require_fs"]:
            os.write(sfd, ("fail:%s" % e).encode())
            os.close(sfd)
            os._exit(125)
        parts.append("error=%s" % e)
    os.write(sfd, "|".join(parts).encode())
    os.close(sfd)

argv = cfg["argv"] if net == "netns" else cfg["shim_argv"]
if not pid_ns:
    confine_and_report()
    os.execv(argv[0], argv)
pid = os.fork()
if pid == 0:
    try:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the namespace dies with us even after setsid()
        confine_and_report()
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
for fd in [cfg["status_fd"]] + cfg["child_fds"]:
    try:
        os.close(fd)
    except OSError:
        pass
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
# needs, keep working).
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


def run_untrusted(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    *,
    tests: str | None = None,
    max_output_bytes: int = 1 << 20,
    max_file_mb: int = 16,
    max_open_files: int = 256,
    max_procs: int = 64,
    require_fs_isolation: bool | None = None,
) -> SandboxResult:
    """Run Python source ``code`` as ``main.py`` in a fresh temp dir under the limits above.

    ``tests``: Python statements (asserts) run after ``code`` by the harness; ``result.passed`` is
    the verdict. ``cpu_s`` defaults to ``ceil(timeout_s) + 1`` (a backstop; the wall clock normally
    fires first). ``max_procs`` extra processes/threads via RLIMIT_NPROC (the kernel ignores it for
    uid 0, i.e. only when root cannot switch to an unprivileged uid). ``require_fs_isolation`` (default :data:`REQUIRE_FS_ISOLATION`): raise
    :class:`SandboxUnavailable` when Landlock is unavailable instead of running unconfined.
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
    require = REQUIRE_FS_ISOLATION if require_fs_isolation is None else bool(require_fs_isolation)
    fs = _fs_available()
    if not fs:
        if require:
            raise SandboxUnavailable(_unavailable_message())
        _warn_unconfined()
    cpu = max(1, int(cpu_s) if cpu_s is not None else math.ceil(timeout_s) + 1)
    uid = _sandbox_uid()
    if uid is not None:
        nproc = max_procs + 1  # a fresh uid owns no task yet: the program itself plus max_procs
    else:
        # RLIMIT_NPROC counts all of the user's tasks, so allow max_procs on top of the current count.
        tasks = _user_task_count(os.getuid())
        nproc = 0 if tasks is None else tasks + max_procs
    workdir = tempfile.mkdtemp(prefix="gspo-sandbox-")
    status_r, status_w = os.pipe()
    to_close = [status_r, status_w]
    verdict_r = -1
    nonce = b""
    try:
        # errors="replace": a lone surrogate in model output must not crash the caller.
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        py = [sys.executable, "-I", "-B", "-X", "utf8"]
        child_fds: list[int] = []
        if tests is None:
            argv, shim_argv = [*py, "main.py"], [*py, "-c", _SHIM_RUNNER]
        else:
            nonce = os.urandom(32).hex().encode()
            nonce_fd = _payload_fd(nonce)
            cfg_fd = _payload_fd(_compile_tests(tests))
            verdict_r, verdict_w = os.pipe()
            child_fds = [nonce_fd, cfg_fd, verdict_w]
            to_close += [verdict_r, *child_fds]
            args = [str(nonce_fd), str(cfg_fd), str(verdict_w)]
            land = "1" if fs else "0"
            argv = [*py, "-c", _HARNESS_LOADER, *args, "0", land]
            shim_argv = [*py, "-c", _HARNESS_LOADER, *args, "1", land]
        cfg = {
            "status_fd": status_w,
            "child_fds": child_fds,
            "namespaces": _TRY_NAMESPACES,
            "memory_bytes": memory_mb << 20,
            "cpu_s": cpu,
            "fsize_bytes": max_file_mb << 20,
            "nofile": max_open_files,
            "nproc": nproc,
            "argv": argv,
            "shim_argv": shim_argv,
            "landlock_abi": landlock_abi() if fs else 0,
            "rules": [[workdir, _FS_WORKDIR], *map(list, _base_rules())],
            "uid": uid,
            "require_fs": require,
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
            pass_fds=(status_w, *child_fds),
            start_new_session=True,
        )
        for fd in (status_w, *child_fds):
            os.close(fd)
            to_close.remove(fd)
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None and proc.stderr is not None
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
        if verdict_r >= 0:
            bufs[verdict_r] = bytearray()
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
        status = bytes(bufs[status_r]).decode("ascii", "replace")
        if status.startswith("fail:"):
            raise SandboxUnavailable(f"code sandbox: cannot confine the program: {status[5:]}")
        cpu_hit = rc == -signal.SIGXCPU or (
            rc == -signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu - 0.05
        )
        timed_out = not finished or cpu_hit
        fields = status.split("|")
        isolation: NetworkIsolation = "netns" if fields[0].startswith("netns") else "shim"
        uid_used = next((int(f[4:]) for f in fields if f.startswith("uid=")), None)
        fs_used: FilesystemIsolation = (
            "landlock" if any(f.startswith("landlock=") for f in fields) else "none"
        )
        ok = rc == 0 and not timed_out
        passed = None
        if verdict_r >= 0:
            passed = ok and bytes(bufs[verdict_r]) == nonce
        return SandboxResult(
            ok=ok,
            returncode=rc,
            stdout=bufs[out_fd].decode("utf-8", "replace"),
            stderr=bufs[err_fd].decode("utf-8", "replace"),
            timed_out=timed_out,
            network_isolation=isolation,
            pid_namespace=fields[0].endswith("+pid"),
            output_truncated=truncated or more,
            filesystem_isolation=fs_used,
            uid=uid_used,
            passed=passed,
        )
    finally:
        for fd in to_close:
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)
