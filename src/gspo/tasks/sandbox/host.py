"""Trainer-side resources of a call: kernel features, Landlock rules, the work dir and its tmpfs
mount point, memory cgroups, the sandbox uid, and cleanup after a crashed trainer."""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import site
import stat
import sys
import tempfile
import time

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
BOOT = os.path.join(PACKAGE_DIR, "boot.py")
"""What the launcher and, with tests, the program run (``python -I -B boot.py ...``)."""
SHIM = os.path.join(PACKAGE_DIR, "shim.py")
"""What the program runs without tests and without a network namespace."""

FS_EXEC, FS_WRITE, FS_READ, FS_READDIR = 1, 2, 4, 8
FS_ALL = (1 << 16) - 1  # masked by the launcher to what the kernel's ABI handles
FS_WORKDIR = FS_ALL & ~(FS_EXEC | (1 << 6) | (1 << 11) | (1 << 15))  # no exec, char/block dev, ioctl
FS_RX = FS_EXEC | FS_READ | FS_READDIR
FS_DEV = FS_READ | FS_WRITE | (1 << 14)  # read, write, truncate (open(..., "w"))


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


@functools.lru_cache(maxsize=1)
def base_rules() -> tuple[tuple[str, int], ...]:
    """Landlock rules besides the work dir: what the interpreter needs to start and import, and the
    two files of this package the program runs (read only)."""
    rx = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    rx.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    rx.update(("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"))
    rx.add(os.path.dirname(os.path.realpath(sys.executable)))
    rules = [(p, FS_RX) for p in sorted(rx) if os.path.exists(p)]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.preload", "/etc/localtime", BOOT, SHIM):
        if os.path.exists(f):
            rules.append((f, FS_READ))
    for f in ("/dev/null", "/dev/zero", "/dev/full"):
        rules.append((f, FS_DEV))
    for f in ("/dev/urandom", "/dev/random"):
        rules.append((f, FS_READ))
    return tuple(rules)


def writable_by_others(path: str) -> str | None:
    """``path``, or the first of its directories, when a user other than its owner (the sandbox's uid,
    which without Landlock only file permissions stop) could change it or replace it, else None.
    Entries of a sticky directory (``/tmp``) cannot be replaced by others."""
    p = os.path.realpath(path)
    if _other_writable(os.stat(p)):
        return p
    while p != "/":
        p = os.path.dirname(p)
        st = os.stat(p)
        if _other_writable(st) and not st.st_mode & stat.S_ISVTX:
            return p
    return None


def _other_writable(st: os.stat_result) -> bool:
    # the sandbox uid has no supplementary groups; its gid is its own, or nogroup (65534) as a fallback
    return bool(st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid == 65534))


_uid_counter = itertools.count()
UID_BASE = 0x60000000


def sandbox_uid() -> int | None:
    """A fresh unprivileged uid per call when running as root (so calls cannot touch each other)."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + ((os.getpid() & 0xFFF) << 12) + (next(_uid_counter) & 0xFFF)


def user_task_count(uid: int) -> int | None:
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


def nproc(uid: int | None, max_procs: int) -> int:
    if uid is not None:
        return max_procs + 1  # a fresh uid owns no task yet: the program itself plus max_procs
    # RLIMIT_NPROC counts all of the user's tasks: max_procs on top of the current count, the
    # launcher and the program itself.
    tasks = user_task_count(os.getuid())
    return 0 if tasks is None else tasks + max_procs + 2


def payload_fd(data: bytes) -> int:
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
def tmpfs_mountpoint() -> str | None:
    """An existing host directory to hide under each call's private tmpfs: the work dir then exists
    only inside the call's mount namespace. Not one that holds what the program must read (a Python
    or gspo installed under /tmp); None: mount over a per-call host directory instead."""
    needed = [os.path.realpath(p) for p, _ in base_rules()] + [os.path.realpath(sys.executable)]
    for cand in ("/tmp", "/var/tmp", "/mnt"):
        if os.path.isdir(cand) and not os.path.islink(cand):
            if not any(p == cand or p.startswith(cand + "/") for p in needed):
                return cand
    return None


def work_dirs(namespaces: bool) -> tuple[str, str]:
    """(where the call's tmpfs is mounted, the program's work dir). Inside a shared mount point the
    work dir exists only in the call's mount namespace; otherwise a per-call host dir is both (and is
    removed afterwards, or by :func:`sweep_stale_dirs` after a crash)."""
    mnt = tmpfs_mountpoint() if namespaces else None
    if mnt is not None:
        return mnt, os.path.join(mnt, f"gspo-sandbox-{os.getpid()}-{os.urandom(6).hex()}")
    workdir = tempfile.mkdtemp(prefix=f"gspo-sandbox-{os.getpid()}-")
    return workdir, workdir


@functools.lru_cache(maxsize=1)
def memory_cgroup_parent() -> str | None:
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


def call_cgroup(limit_bytes: int, namespaces: bool) -> str | None:
    """A fresh memory cgroup for one call, limited to ``limit_bytes`` for all its processes together
    (anonymous memory, tmpfs and memfd pages), or None where unavailable."""
    parent = memory_cgroup_parent() if namespaces else None  # (tests: a machine without either)
    if parent is None:
        return None
    path = os.path.join(parent, f"gspo-sandbox-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
    except OSError:
        remove_cgroup(path)
        return None
    return path


def remove_cgroup(path: str | None) -> None:
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
def sweep_stale_dirs() -> None:
    """Remove host work dirs (``gspo-sandbox-<pid>-*``, used only without a private tmpfs) that a
    killed trainer left behind: once per process, only ours, only when that PID is gone and the dir is
    older than 10 minutes; and the empty memory cgroups of dead trainers."""
    for parent in {tempfile.gettempdir(), tmpfs_mountpoint() or tempfile.gettempdir()}:
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
    parent = memory_cgroup_parent()
    for e in os.scandir(parent) if parent else ():
        m = _STALE_DIR.match(e.name)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            remove_cgroup(e.path)  # fails (and is left) while processes are in it
