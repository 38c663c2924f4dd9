"""The sandbox launcher: one per call, started by the trainer as ``python -I -B boot.py CFG FD``.

It joins the call's memory cgroup, dies with the trainer, enters new namespaces (network, IPC, PID,
mount) and mounts the private tmpfs, writes ``main.py``, sets the rlimits, then forks the program:
the child confines itself (``confine.py``) and execs the interpreter. The launcher stays outside the
new PID namespace and waits; its child is PID 1 there, so when it exits or is killed the kernel kills
and reaps every process left in the namespace (setsid(), double forks) before the launcher's wait
returns. PR_SET_PDEATHSIG chains trainer -> launcher -> program, so a kill -9 of either ends the
namespace too. SIGTERM to the launcher: SIGKILL the program, wait, exit as it did. (A separate trusted
PID 1 above the program would cost a Python fork, ~+30 % per call.) The program reports what was
applied on ``status_fd`` ("fail:<why>" + exit 125 when a required layer fails).

Standard library only; run from code the trainer compiled once (compiling it per call cost ~5 ms).
"""

import json
import os
import resource
import select
import signal
import sys

TYPE_CHECKING = False  # (typing is not imported: it would add to every call's startup)
if TYPE_CHECKING:
    from types import ModuleType

NEWNS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000


def main(argv: list[str], payload: tuple) -> None:
    """Entry point (from boot.py): argv[1] the JSON config, payload[1] the code of confine.py,
    payload[2] that of gspo.procs."""
    cfg = json.loads(argv[1])
    confine = type(sys)("gspo_sandbox_confine")
    exec(payload[1], confine.__dict__)
    procs = type(sys)("gspo_procs")
    exec(payload[2], procs.__dict__)
    procs.die_with_parent(signal.SIGKILL, cfg["parent"], 125)  # the trainer may have died already
    in_cgroup = join_cgroup(cfg["cgroup"])
    flags = unshare(confine) if cfg["namespaces"] and confine.libc is not None else 0
    if flags:  # again: a credential change (new user namespace) may clear it
        procs.die_with_parent(signal.SIGKILL, cfg["parent"], 125)
    tmpfs = bool(flags & NEWNS) and private_tmpfs(confine, cfg)
    enter_workdir(cfg)
    set_limits(cfg)
    net = "netns" if flags else "shim"
    parts = [net + ("+pid" if flags & NEWPID else "")] + (["tmpfs"] if tmpfs else [])
    parts += ["cgroup"] if in_cgroup else []
    fork_and_wait(cfg, confine, net, parts)


def join_cgroup(cgroup: str | None) -> bool:
    """Join before forking: every process of the call shares its memory limit."""
    if not cgroup:
        return False
    try:
        with open(cgroup + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return False
    return True


def write_file(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        pass


def unshare(confine: "ModuleType") -> int:
    """The namespaces entered: all of them (as root), with a new user namespace, or a network one only."""
    full = NEWNS | NEWIPC | NEWNET | NEWPID
    uid, gid = os.getuid(), os.getgid()
    for flags in (full, NEWUSER | full, NEWUSER | NEWNET):
        if confine.libc.unshare(flags) == 0:
            if flags & NEWUSER:  # files in the tmpfs need an owner mapped in the new user namespace
                write_file("/proc/self/setgroups", "deny")
                write_file("/proc/self/uid_map", f"{uid} {uid} 1")
                write_file("/proc/self/gid_map", f"{gid} {gid} 1")
            return flags
    return 0


def private_tmpfs(confine: "ModuleType", cfg: dict) -> bool:
    """Mounts stay in this mount namespace (MS_PRIVATE); the tmpfs is freed when its last process exits."""
    ctypes = confine.ctypes
    mount = confine.libc.mount
    mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    opts = f"size={cfg['disk_bytes']},nr_inodes={cfg['inodes']},mode=755"
    target = cfg["mount"].encode()
    return mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode()) == 0


def enter_workdir(cfg: dict) -> None:
    """cd into the work dir (made in the tmpfs; without one it is the trainer's host dir) and write
    ``main.py`` there from the code fd."""
    workdir = cfg["workdir"]
    if workdir != cfg["mount"]:
        os.mkdir(workdir, 0o700)
    os.chdir(workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    with open("main.py", "wb") as f:
        while True:
            b = os.read(cfg["code_fd"], 65536)
            if not b:
                break
            f.write(b)
    os.close(cfg["code_fd"])


def limit(res: int, value: int) -> None:
    _, cur = resource.getrlimit(res)
    if cur != resource.RLIM_INFINITY:
        value = min(value, cur)
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        pass


def set_limits(cfg: dict) -> None:
    limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    limit(resource.RLIMIT_CPU, cfg["cpu_s"])  # soft == hard: SIGKILL
    limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, cfg["nofile"])
    if cfg["nproc"]:
        limit(resource.RLIMIT_NPROC, cfg["nproc"])


def program(cfg: dict, confine: "ModuleType", net: str, parts: list[str], alive_r: int) -> None:
    """The launcher's child: PID 1 of the namespace (its exit empties it). PR_SET_PDEATHSIG is cleared
    by the uid switch, so confine() sets it again before seccomp (which then refuses changing it); the
    launcher may have died before that: its pipe says so. Never returns."""
    sfd = cfg["status_fd"]
    try:
        try:
            if confine.libc is None:
                raise OSError("ctypes is unavailable")
            confine.prctl(confine.PR_SET_PDEATHSIG, signal.SIGKILL)
            parts += confine.confine(cfg, net == "shim")
        except Exception as e:
            if cfg["require_fs"]:
                os.write(sfd, f"fail:{e}".encode())
                os._exit(125)
            parts.append(f"error={e}")
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(125)
        os.close(alive_r)
        os.write(sfd, "|".join(parts).encode())
        os.close(sfd)
        argv = cfg["argv"] if net == "netns" else cfg["shim_argv"]
        os.execv(argv[0], argv)
    finally:
        os._exit(127)


def fork_and_wait(cfg: dict, confine: "ModuleType", net: str, parts: list[str]) -> None:
    """Fork the program, wait for it, exit as it did (killed by a signal: by the same signal)."""
    alive_r, alive_w = os.pipe()  # alive_w stays open here: EOF on alive_r means the launcher died
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a stop request waits for the handler
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (exec keeps the mask)
        os.close(alive_w)
        program(cfg, confine, net, parts, alive_r)
    os.close(alive_r)
    for fd in [cfg["status_fd"], *cfg["child_fds"]]:
        os.close(fd)
    try:
        pidfd = os.pidfd_open(child)  # names this process even once reaped: no PID reuse race
    except (AttributeError, OSError):
        pidfd = None

    def stop(*_: object) -> None:
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
