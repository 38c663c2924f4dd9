"""The test harness, run by the sandboxed program when there are tests: ``main.py`` as ``__main__``,
then the tests; success is reported only by writing a nonce the program never sees to a private pipe.

``python -I -B -X utf8 boot.py NONCE_FD PAYLOAD_FD VERDICT_FD SHIM LANDLOCK``; the payload (compiled
once in the trainer, see ``programs.py``) is (this module, protected.py, shim.py, the modules the tests
import, the tests). The nonce is read from its descriptor, which is then closed, before the program
starts, and lives only on this interpreter's evaluation stack (``main``); the audit hook installed
before the program runs refuses frame and GC introspection. See the package docstring for the whole
design and what is not defended.

Everything the program can reach after it starts is bound as default arguments while the builtins are
still pristine: the bodies below look up no global or builtin name once the program has run.
"""

import _imp
import _operator
import _signal
import _thread
import builtins
import gc
import os
import sys
import types  # noqa: F401  (reads a traceback's tb_frame at import: must happen before arming)

ModuleType, Namespace = type(sys), type(sys.implementation)
NoneType = type(None)
HELPERS = ("opaque", "pure", "perturb", "kind", "probe_eq", "eq", "ne", "order", "contains")  # H's order
PROTECTED = (
    *("kind", "opaque", "pure", "perturb", "probe_eq", "eq", "ne", "order", "contains", "cmp"),
    *("test_import", "no_signals", "create_builtin", "hook"),
    *("to_list", "to_tuple", "to_dict", "to_set", "to_frozenset"),
)


def main(argv: list[str], payload: tuple) -> None:
    """Entry point (from boot.py)."""
    finish, run, nonce_fd, report = setup(argv, payload)
    del argv, payload
    keep: list = []
    try:
        finish(read_fd(nonce_fd), run(keep))  # the nonce: on the stack while the program runs
    except BaseException as e:
        report(e)
    report(None)


def read_fd(fd: int, _read=os.read, _close=os.close, _join=b"".join) -> bytes:
    parts = []
    while True:
        b = _read(fd, 65536)
        if not b:
            break
        parts.append(b)
    _close(fd)
    return _join(parts)


def setup(argv: list[str], payload: tuple) -> tuple:
    """Everything before the program runs; returns (finish, run, the nonce's fd, report)."""
    nonce_fd, out_fd = int(argv[1]), int(argv[3])
    shim, landlock = argv[4] == "1", argv[5] == "1"
    tests_code, modules = payload[4], payload[3]
    with open("main.py", "rb") as f:
        solution_src = f.read()
    solution_code = compile(solution_src, "main.py", "exec", dont_inherit=True)
    del solution_src
    proxies = module_proxies(modules)
    if shim:
        ns: dict = {"__name__": "gspo_sandbox_shim"}
        exec(payload[2], ns)
        ns["install"]()
    module = ModuleType("__main__")
    g = module.__dict__
    g["__file__"] = "main.py"
    g["__builtins__"] = builtins
    pristine = dict(builtins.__dict__)
    state: list[int] = [0]
    helpers = load_protected(payload[1], protected_env(pristine, proxies, state, landlock), pristine)
    hook, no_signals, create_builtin, cmp, tests_ns, tests_builtins = helpers
    arm = make_arm(hook, no_signals, create_builtin, state)
    run = make_run(arm, solution_code, tests_code, g, tests_ns, tests_builtins, cmp, pristine, module)
    return make_finish(out_fd), run, nonce_fd, make_report(state)


def module_proxies(modules: tuple[str, ...]) -> dict[str, object]:
    """Copies of the modules the tests import, taken before the solution can patch them."""
    for name in modules:
        try:
            __import__(name)
        except BaseException:
            pass
    proxies: dict = {}
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
    return proxies


def protected_env(pristine: dict, proxies: dict, state: list[int], landlock: bool) -> dict:
    """The private namespace protected.py runs in: the constants its functions bind as defaults."""
    return {
        "__builtins__": dict(pristine),
        "SCALARS": (int, float, complex, bool, str, bytes, NoneType),
        "MRO": type.__dict__["__mro__"].__get__,
        "TDICT": type.__dict__["__dict__"].__get__,
        "CMP_NAMES": ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__contains__"),
        "CDESC": (
            *(type(object.__eq__), type(str.join), type(len), NoneType, type((1).__eq__)),
            type(dict.__dict__["fromkeys"]),
        ),
        "H": [None] * len(HELPERS),
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
        "DENY_EVENTS": frozenset(
            {
                *(
                    "sys._getframe",
                    "sys._current_frames",
                    "sys._current_exceptions",
                    "sys._getframemodulename",
                ),
                *("sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents"),
                "sys.monitoring.register_callback",
            }
        ),
        "FRAME_ATTRS": frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"}),
        "CODE_ATTRS": frozenset({"__code__", "__defaults__", "__kwdefaults__"}),
        "PROT": [],
        "DENY_MODULES": frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend", "_signal"}),
        "SPAWN_EVENTS": None
        if landlock
        else frozenset(
            {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn"}
        ),
        "DENIED": ValueError,  # a builtin type (a class of ours could be patched); what namedtuple expects
    }


def load_protected(code: object, env: dict, pristine: dict) -> tuple:
    """Run protected.py in ``env``; returns (hook, no_signals, create_builtin, cmp, the tests'
    namespace, the tests' builtins). The tests' namespace is a plain dict (no class of ours the
    program could reach through ``__subclasses__`` and patch) with a pristine builtins copy whose
    ``__import__`` hands out the module copies."""
    exec(code, env)
    h, prot = env["H"], env["PROT"]
    for i, name in enumerate(HELPERS):
        h[i] = env[name]
    tests_builtins = dict(pristine)
    tests_builtins["__import__"] = env["test_import"]
    tests_ns: dict = {}
    prot += [env[name] for name in PROTECTED]
    prot += [tests_ns, tests_builtins, env["CONVS"], env["__builtins__"]]
    helpers = (env["hook"], env["no_signals"], env["create_builtin"], env["cmp"], tests_ns, tests_builtins)
    env.clear()  # the functions keep what they need in their defaults
    return helpers


def make_arm(hook: object, no_signals: object, create_builtin: object, state: list[int]) -> object:
    """arm(): the guards, just before the solution runs."""

    def arm(
        _sigmod=_signal,
        _no=no_signals,
        _imp=_imp,
        _cb=create_builtin,
        _mods=sys.modules,
        _add=sys.addaudithook,
        _hook=hook,
        _state=state,
        _list=list,
    ):
        _sigmod.signal = _no  # signal.py, imported later, copies it; if imported already, patch it too
        if "signal" in _mods:
            _mods["signal"].signal = _no
        _imp.create_builtin = _cb
        for name in _list(_mods):
            if name == "ctypes" or name[:7] == "ctypes." or name == "_ctypes":
                del _mods[name]
        _add(_hook)
        _state[0] = 1

    return arm


def make_run(
    arm: object,
    sol: object,
    tests: object,
    g: dict,
    T: dict,
    tb: dict,
    cmp: object,
    pristine: dict,
    module: object,
) -> object:
    """run(keep): the solution as ``__main__``, then the tests in their own namespace ``T`` (the
    solution's top-level names as they were when it finished, builtin names excepted); True when both
    ran to the end with no thread left running."""
    sigs = _signal.valid_signals()

    def run(
        keep,
        _arm=arm,
        _exec=exec,
        _sol=sol,
        _tests=tests,
        _g=g,
        _T=T,
        _tb=tb,
        _cmp=cmp,
        _items=dict.items,
        _bn=frozenset(pristine),
        _type=type,
        _str=str,
        _mod=module,
        _mods=sys.modules,
        _sys=sys,
        _count=_thread._count,
        _RE=RuntimeError,
        _flush1=sys.__stdout__.flush,
        _flush2=sys.__stderr__.flush,
        _mask=_signal.pthread_sigmask,
        _block=_signal.SIG_BLOCK,
        _sigs=sigs,
        _gcoff=gc.disable,
    ):
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

    return run


def make_finish(out_fd: int) -> object:
    """finish(nonce, ok): write the nonce to the verdict pipe (the same pipe: device and inode) and
    exit, only when ``ok is True`` and no thread runs; else exit 1. ``os.stat_result`` is a mutable
    class: its fields are read through tuple's own ``__getitem__``."""
    st = os.fstat(out_fd)
    sigs = _signal.valid_signals()

    def finish(
        nonce,
        ok,
        _out=out_fd,
        _dev=st.st_dev,
        _ino=st.st_ino,
        _fstat=os.fstat,
        _at=tuple.__getitem__,
        _write=os.write,
        _exit=os._exit,
        _count=_thread._count,
        _mask=_signal.pthread_sigmask,
        _block=_signal.SIG_BLOCK,
        _sigs=sigs,
        _gcoff=gc.disable,
    ):
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

    return finish


def make_report(state: list[int]) -> object:
    """report(exc): the failure's traceback (or that there was no verdict) on stderr; exit 1."""

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

    return report
