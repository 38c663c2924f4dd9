"""Confinement of the sandboxed program, applied by the launcher's child just before it execs the
interpreter: drop root (one capability kept), seccomp filter, Landlock ruleset.

Runs in the launcher (see ``launcher.py``), which executes this module from the code the trainer
compiled; the trainer imports it only for tests. Standard library only, raw syscalls through ctypes
(``docs/sandbox.md`` says why no library is used). The order matters: the Landlock ruleset is opened
while still root (paths under ``/root`` open), then the uid switch (which clears the parent-death
signal, so it is set again), no-new-privs, seccomp (which then refuses changing that signal), and
Landlock restrict last.
"""

import os
import signal

try:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
except Exception:  # no ctypes: the program refuses to run unless confinement is optional
    libc = None

PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_CAPBSET_DROP = 1, 8, 24
PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 22, 38, 47
CAP_DAC_READ_SEARCH = 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446

# fmt: off
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
# fmt: on

RET_ALLOW, RET_EPERM, RET_ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_*
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # classic BPF opcodes
CLONE_NEW_FLAGS = 0x7E020000


def prctl(*args: int) -> int:
    return libc.prctl(*[ctypes.c_ulong(a) for a in args])


def fail(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(f"{what} (errno {err}: {os.strerror(err)})")


def sys_call(nr: int, *args: object) -> int:
    return libc.syscall(ctypes.c_long(nr), *args)


def drop_root(uid: int) -> int:
    """Become ``uid`` (or nobody), keeping CAP_DAC_READ_SEARCH only, as an ambient capability so the
    exec'd interpreter has it: enough to reach a Python installed under /root; Landlock decides what
    may actually be read."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        if cap != CAP_DAC_READ_SEARCH and prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            fail(f"cannot drop capability {cap}")
    if prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
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
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    data = (Data * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = 1 << CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(Hdr(0x20080522, 0)), data) != 0:
        fail("capset failed")
    if prctl(PR_CAP_AMBIENT, 2, CAP_DAC_READ_SEARCH, 0, 0) != 0:  # PR_CAP_AMBIENT_RAISE
        fail("cannot raise the ambient capability")
    return os.getuid()


def seccomp_program(metadata: bool, machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k). Refused with EPERM: the syscalls in SECCOMP, socket() of every
    family (socketpair: AF_UNIX only, a connected pair with no way to the host), clone() with
    namespace flags, prctl(PR_SET_PDEATHSIG) (the program must die with its launcher); ``metadata``:
    chmod/chown/utime/xattr/truncate too. clone3 (its flags are out of a filter's reach) gets ENOSYS,
    so that libc falls back to clone. Syscalls of another ABI (32-bit compat, x32): EPERM. A machine
    without a table raises KeyError: the program refuses to run (unless confinement is optional)."""
    t = SECCOMP[machine]
    prog: list[tuple[int, int | str, int | str, int]] = [(LD_W_ABS, 0, 0, 4), (JEQ, 0, "eperm", t["arch"])]
    prog.append((LD_W_ABS, 0, 0, 0))  # the syscall number
    if t["x32"]:
        prog.append((JGE, "eperm", 0, 0x40000000))  # x32 syscalls
    prog += [(JEQ, "eperm", 0, nr) for nr in t["deny"] + (t["meta"] if metadata else ())]
    prog += [
        (JEQ, "enosys", 0, t["clone3"]),
        (JEQ, "pair", 0, t["socketpair"]),
        (JEQ, "clone", 0, t["clone"]),
    ]
    prog.append((JEQ, "prctl", 0, t["prctl"]))
    prog.append((RET, 0, 0, RET_ALLOW))
    labels = {"pair": len(prog)}  # (classic BPF jumps forward only)
    prog += [(LD_W_ABS, 0, 0, 16), (JEQ, "allow", "eperm", 1)]  # args[0] (low word) == AF_UNIX
    labels["clone"] = len(prog)
    prog += [(LD_W_ABS, 0, 0, 16), (JSET, "eperm", "allow", CLONE_NEW_FLAGS)]
    labels["prctl"] = len(prog)
    prog += [(LD_W_ABS, 0, 0, 16), (JEQ, "eperm", "allow", PR_SET_PDEATHSIG)]  # keep the launcher's
    labels["allow"] = len(prog)
    prog.append((RET, 0, 0, RET_ALLOW))
    labels["eperm"] = len(prog)
    prog.append((RET, 0, 0, RET_EPERM))
    labels["enosys"] = len(prog)
    prog.append((RET, 0, 0, RET_ENOSYS))

    def rel(i: int, j: int | str) -> int:
        return labels[j] - i - 1 if isinstance(j, str) else j

    return [(code, rel(i, jt), rel(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog)]


def seccomp(metadata: bool) -> None:
    prog = seccomp_program(metadata, os.uname().machine)

    class Filt(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint32),
        ]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filt))]

    arr = (Filt * len(prog))(*[Filt(*p) for p in prog])
    fprog = Prog(len(prog), arr)
    mode = ctypes.c_ulong(2)  # SECCOMP_MODE_FILTER
    if (
        libc.prctl(
            ctypes.c_int(PR_SET_SECCOMP), mode, ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)
        )
        != 0
    ):
        fail("seccomp filter refused")


def landlock_ruleset(abi: int, rules: list, shim: bool) -> int:
    """A Landlock ruleset fd allowing ``rules`` ([path, access] pairs; files get file rights only);
    without a network namespace (``shim``, ABI >= 4) also refusing TCP bind/connect."""
    handled = (1 << 13) - 1
    if abi >= 2:
        handled |= 1 << 13  # REFER
    if abi >= 3:
        handled |= 1 << 14  # TRUNCATE
    if abi >= 5:
        handled |= 1 << 15  # IOCTL_DEV
    file_rights = 1 | 2 | 4 | (1 << 14) | (1 << 15)

    class Attr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

    net_rules = 3 if (abi >= 4 and shim) else 0
    attr = Attr(handled, net_rules, 3 if abi >= 6 else 0)  # scope: abstract unix sockets, signals
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    fd = sys_call(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        fail("landlock_create_ruleset failed")
    for path, access in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        allowed = access & handled
        if not os.path.isdir(path):
            allowed &= file_rights
        rule = Beneath(allowed, pfd)
        r = sys_call(
            SYS_LANDLOCK_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)
        )
        os.close(pfd)
        if r != 0:
            fail(f"landlock_add_rule failed for {path}")
    return fd


def confine(cfg: dict, shim: bool) -> list[str]:
    """Apply every layer to this process; returns what was applied (``uid=``, ``landlock=``)."""
    parts = []
    abi = cfg["landlock_abi"]
    rules = [[cfg["workdir"], cfg["workdir_access"]], *cfg["rules"]]
    ruleset = landlock_ruleset(abi, rules, shim) if abi > 0 else -1  # while still root: /root opens
    uid = cfg["uid"]
    if uid is not None:
        parts.append(f"uid={drop_root(uid)}")
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # which the uid change cleared
    if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("PR_SET_NO_NEW_PRIVS failed")
    seccomp(metadata=uid is None)
    if ruleset >= 0:
        if sys_call(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            fail("landlock_restrict_self failed")
        os.close(ruleset)
        parts.append(f"landlock={abi}")
    return parts
